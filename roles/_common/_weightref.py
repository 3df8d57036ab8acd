"""The ref that names one published version of a model's weights (what the controller passes
from a trainer to its generators; see :mod:`._weights`)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from orchestr import Buffer, register

from ._weightplan import (
    BucketPlan,
    BucketSpec,
    ChecksumMismatchError,
    ManifestMismatchError,
    TensorSlot,
    few,
)

__all__ = ["BucketRef", "WeightsRef"]


class BucketRef(NamedTuple):
    dtype: str
    numel: int
    checksum: str
    buffer: Buffer


@register
@dataclasses.dataclass(frozen=True)
class WeightsRef:
    """One published version: the manifest, a buffer handle and checksum per bucket, and the
    slot's stamp. Small (tens of bytes per tensor); pass it in any actor call."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    version: int
    tensors: tuple[TensorSlot, ...]
    buckets: tuple[BucketRef, ...]
    stamp: Buffer
    algorithm: str = "crc32"  # what a ref stored before this field existed used
    #: each bucket's checksum is one digest per piece of this many bytes (0: one per bucket)
    piece_bytes: int = 0

    def __post_init__(self) -> None:
        # from the wire, tuples arrive as lists: rebuild the named tuples
        try:
            tensors = tuple(TensorSlot(n, d, tuple(s), b, o) for n, d, s, b, o in self.tensors)
            buckets = tuple(BucketRef(d, n, c, buf) for d, n, c, buf in self.buckets)
        except (TypeError, ValueError) as exc:
            raise ManifestMismatchError(f"malformed weights ref: {exc}") from None
        object.__setattr__(self, "tensors", tensors)
        object.__setattr__(self, "buckets", buckets)

    @property
    def plan(self) -> BucketPlan:
        return BucketPlan(self.tensors, tuple(BucketSpec(b.dtype, b.numel) for b in self.buckets))

    @property
    def nbytes(self) -> int:
        return self.plan.nbytes

    def verify(self, sums: list[str]) -> None:
        """Raise :class:`ChecksumMismatchError` unless ``sums`` (one per bucket, as the
        publisher forms them) are the published checksums."""
        for i, (b, got) in enumerate(zip(self.buckets, sums, strict=True)):
            if got != b.checksum:
                names = [t.name for t in self.tensors if t.bucket == i]
                raise ChecksumMismatchError(
                    f"bucket {i} of weights version {self.version} ({b.numel} {b.dtype}: "
                    f"{few(names, 3)}) arrived with {self.algorithm} {got}, the publisher "
                    f"computed {b.checksum}; the publisher's memory was changed after publish "
                    f"or the transfer corrupted it. Nothing was loaded"
                )
