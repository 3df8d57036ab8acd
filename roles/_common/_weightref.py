"""The refs that name one published version of a model's weights (what the controller passes
from a trainer to its generators; see :mod:`._weights`): :class:`WeightsRef` for a model one
process publishes whole, :class:`ShardedWeightsRef` for one whose rows its members publish."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from orchestr import Buffer, register

from ._weightplan import (
    BucketPlan,
    BucketSpec,
    ChecksumMismatchError,
    ManifestMismatchError,
    TensorSlot,
    few,
    plan_buckets,
    to_dtype,
)

__all__ = ["AnyWeightsRef", "BucketRef", "ShardedWeightsRef", "WeightsRef"]


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


@register
@dataclasses.dataclass(frozen=True)
class ShardedWeightsRef:
    """One published version of a model whose tensors are split by rows (dimension 0, as
    FSDP2 shards them) over a sharded trainer's members. Each member publishes its rows of
    each tensor as a tensor of its own: ``parts`` holds their :class:`WeightsRef` s in rank
    order (members with no rows publish none). ``tensors`` is the whole model's manifest,
    ``(name, dtype, shape)`` each. A loader reads every part and lays each tensor's rows,
    part after part, into the whole (:meth:`~._weights.WeightLoader.load`): no process on
    the trainer's side holds the whole model. Small; pass it in any actor call."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    version: int
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]
    parts: tuple[WeightsRef, ...] = ()

    def __post_init__(self) -> None:
        try:
            tensors = tuple((str(n), str(d), tuple(int(x) for x in s)) for n, d, s in self.tensors)
        except (TypeError, ValueError) as exc:
            raise ManifestMismatchError(f"malformed sharded weights ref: {exc}") from None
        object.__setattr__(self, "tensors", tensors)
        object.__setattr__(self, "parts", tuple(self.parts))
        for part in self.parts:
            if not isinstance(part, WeightsRef) or part.version != self.version:
                raise ManifestMismatchError(
                    f"a part of sharded weights version {self.version} is "
                    f"{getattr(part, 'version', type(part).__name__)}, not a WeightsRef of it"
                )

    @classmethod
    def join(cls, refs: Sequence[ShardedWeightsRef]) -> ShardedWeightsRef:
        """The ref of every member's rows: ``refs`` are the members' (each holding its own
        part), in rank order. Raises :class:`ManifestMismatchError` when they are not of one
        version and one model."""
        if not refs:
            raise ManifestMismatchError("no member published a part")
        first = refs[0]
        for ref in refs[1:]:
            if (ref.version, ref.tensors) != (first.version, first.tensors):
                raise ManifestMismatchError(
                    f"the members published different versions or models ({ref.version} "
                    f"and {first.version}); publish on every member together"
                )
        return cls(first.version, first.tensors, tuple(p for r in refs for p in r.parts))

    @functools.cached_property
    def plan(self) -> BucketPlan:
        """How the whole tensors lie in a loader's buckets."""
        meta = {n: torch.empty(s, dtype=to_dtype(d), device="meta") for n, d, s in self.tensors}
        return plan_buckets(meta)

    @property
    def nbytes(self) -> int:
        return self.plan.nbytes

    def rows(self) -> dict[str, list[tuple[int, TensorSlot]]]:
        """Each tensor's pieces, ``(part, slot)`` in rank order. Raises
        :class:`ManifestMismatchError` unless every tensor's pieces are its rows, whole and
        once."""
        pieces: dict[str, list[tuple[int, TensorSlot]]] = {n: [] for n, _, _ in self.tensors}
        for i, part in enumerate(self.parts):
            for slot in part.tensors:
                if slot.name not in pieces:
                    raise ManifestMismatchError(f"part {i} publishes {slot.name}, not in the model")
                pieces[slot.name].append((i, slot))
        for name, dtype, shape in self.tensors:
            got = pieces[name]
            whole = len(got) == 1 and (got[0][1].shape, got[0][1].dtype) == (shape, dtype)
            rows = sum(s.shape[0] if s.shape else 0 for _, s in got)
            if not whole and not (
                shape
                and rows == shape[0]
                and all(s.shape[1:] == shape[1:] and s.dtype == dtype for _, s in got)
            ):
                found = [list(s.shape) for _, s in got]
                raise ManifestMismatchError(
                    f"{name} ({list(shape)}) is published as pieces {found}: not its rows, "
                    f"each once"
                )
        return pieces


#: What a publish returns and a load takes: a whole copy's ref, or a sharded publish's.
AnyWeightsRef = WeightsRef | ShardedWeightsRef
