"""The sans-IO core of weight sync: which tensors move, how they lie in flat buckets, and
the checksums that prove a bucket arrived whole.

:func:`plan_buckets` sorts a model's tensors by name, groups them by dtype (in dtype-name
order) and packs each group greedily into buckets of at most ``bucket_bytes``; a tensor larger
than that gets a bucket of its own. The manifest (one :class:`TensorSlot` per tensor: name,
dtype, shape, bucket, offset in elements) travels with every version, and
:meth:`BucketPlan.check` compares it with the receiving model. No I/O here: the publisher and
loader in :mod:`._weights` do the transfers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import NamedTuple

import torch
import xxhash

from orchestr.errors import OrchestrError, StaleDescriptorError

__all__ = [
    "CHECKSUMS",
    "DEFAULT_BUCKET_BYTES",
    "BucketPlan",
    "BucketSpec",
    "ChecksumMismatchError",
    "ManifestMismatchError",
    "StaleWeightsError",
    "TensorSlot",
    "WeightSyncError",
    "bytes_of",
    "checksum",
    "dtype_name",
    "few",
    "piece_digests",
    "plan_buckets",
    "released_as_stale",
    "sync_devices",
    "to_dtype",
    "views",
    "weight_tensors",
    "weights_digest",
]

DEFAULT_BUCKET_BYTES = 64 << 20
CHECKSUMS: dict[str, Callable[[memoryview], str]] = {
    "xxh3": lambda v: xxhash.xxh3_64_hexdigest(v),
    "crc32": lambda v: f"{zlib.crc32(v):08x}",
    "sha256": lambda v: hashlib.sha256(v).hexdigest(),
    "blake2b": lambda v: hashlib.blake2b(v, digest_size=16).hexdigest(),
}


def piece_digests(data: memoryview, algorithm: str, piece_bytes: int) -> str:
    """The digests of ``data``'s pieces of ``piece_bytes`` (0: one for all of it), in order,
    joined by commas: a bucket's checksum in a :class:`~._weights.WeightsRef`."""
    fn = CHECKSUMS[algorithm]
    step = piece_bytes or max(data.nbytes, 1)
    return ",".join(fn(data[at : at + step]) for at in range(0, max(data.nbytes, 1), step))


class WeightSyncError(OrchestrError):
    """A weight sync could not be done; the message says why and what to do."""


class ManifestMismatchError(WeightSyncError, ValueError):
    """A manifest does not fit the model (names, dtypes, shapes) or is malformed."""


class ChecksumMismatchError(WeightSyncError):
    """A bucket read back does not match the checksum the publisher computed."""


class StaleWeightsError(WeightSyncError):
    """The version is older than the one loaded, or its buckets were rewritten or released."""


class TensorSlot(NamedTuple):
    """Where one tensor lies: bucket index and offset in elements of the bucket's dtype."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class BucketSpec(NamedTuple):
    dtype: str
    numel: int


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ManifestMismatchError(f"unknown torch dtype {name!r} in a weights manifest")
    return dtype


def _itemsize(name: str) -> int:
    return to_dtype(name).itemsize


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """The layout of a model's tensors in flat buckets (sans-IO)."""

    tensors: tuple[TensorSlot, ...]
    buckets: tuple[BucketSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.numel * _itemsize(b.dtype) for b in self.buckets)

    def validate(self) -> None:
        """Check the plan is self-consistent: every tensor inside its bucket, in its dtype, no
        overlaps. Raises :class:`ManifestMismatchError`."""
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ManifestMismatchError("a weights manifest names a tensor twice")
        for b in self.buckets:
            to_dtype(b.dtype)
        ends: dict[int, list[tuple[int, int, str]]] = {}
        for t in self.tensors:
            if not 0 <= t.bucket < len(self.buckets):
                raise ManifestMismatchError(f"{t.name}: bucket {t.bucket} does not exist")
            b = self.buckets[t.bucket]
            if t.dtype != b.dtype:
                raise ManifestMismatchError(
                    f"{t.name}: dtype {t.dtype} placed in a {b.dtype} bucket"
                )
            if t.offset < 0 or t.offset + t.numel > b.numel or any(d < 0 for d in t.shape):
                raise ManifestMismatchError(
                    f"{t.name}: elements [{t.offset}, +{t.numel}) lie outside bucket "
                    f"{t.bucket} of {b.numel}"
                )
            ends.setdefault(t.bucket, []).append((t.offset, t.offset + t.numel, t.name))
        for spans in ends.values():
            spans.sort()
            for (_, end, a), (start, _, b_) in itertools.pairwise(spans):
                if start < end:
                    raise ManifestMismatchError(f"{a} and {b_} overlap in a weights manifest")

    def check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Check a model's tensors against this manifest: same names, dtypes and shapes.

        Raises :class:`ManifestMismatchError` naming what differs."""
        want = {t.name: t for t in self.tensors}
        missing, extra = sorted(want.keys() - tensors.keys()), sorted(tensors.keys() - want)
        if missing or extra:
            raise ManifestMismatchError(
                f"the model does not match the weights manifest: missing from the model "
                f"{few(missing)}, not in the manifest {few(extra)}; both sides must build "
                f"the same architecture"
            )
        for name, t in tensors.items():
            slot = want[name]
            if dtype_name(t.dtype) != slot.dtype:
                raise ManifestMismatchError(
                    f"{name}: the model holds {dtype_name(t.dtype)}, the publisher sends "
                    f"{slot.dtype}; cast the model (or publish) so the dtypes agree"
                )
            if tuple(t.shape) != slot.shape:
                raise ManifestMismatchError(
                    f"{name}: the model's shape is {list(t.shape)}, the publisher's "
                    f"{list(slot.shape)}"
                )


def few(names: list[str], n: int = 5) -> str:
    if not names:
        return "nothing"
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def weight_tensors(
    model: torch.nn.Module | Mapping[str, torch.Tensor], *, meta: bool = False
) -> dict[str, torch.Tensor]:
    """The tensors a sync moves: a module's ``state_dict`` (parameters and persistent buffers)
    with tied tensors once, under their first name; or a mapping as given. ``meta``: meta
    tensors are taken too (shapes only: what a sync would move)."""
    items = model.state_dict(keep_vars=True) if isinstance(model, torch.nn.Module) else model
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in items.items():
        if not isinstance(t, torch.Tensor):
            raise WeightSyncError(f"{name} is a {type(t).__name__}, not a tensor; it cannot sync")
        if t.layout != torch.strided or (t.is_meta and not meta):
            raise WeightSyncError(f"{name} is a {t.layout} or meta tensor; only dense ones sync")
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def plan_buckets(
    tensors: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> BucketPlan:
    """Group ``tensors`` by dtype (in dtype-name order), each group by tensor name, into flat
    buckets of at most ``bucket_bytes``. Deterministic: equal inputs give equal plans."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    by_dtype: dict[str, list[str]] = {}
    for name in sorted(tensors):
        by_dtype.setdefault(dtype_name(tensors[name].dtype), []).append(name)
    slots: list[TensorSlot] = []
    buckets: list[BucketSpec] = []
    for dtype in sorted(by_dtype):
        limit = max(1, bucket_bytes // _itemsize(dtype))
        used = -1  # no open bucket
        for name in by_dtype[dtype]:
            n = tensors[name].numel()
            if used < 0 or (used + n > limit and used > 0):
                buckets.append(BucketSpec(dtype, 0))
                used = 0
            slots.append(
                TensorSlot(name, dtype, tuple(tensors[name].shape), len(buckets) - 1, used)
            )
            used += n
            buckets[-1] = BucketSpec(dtype, used)
    return BucketPlan(tuple(slots), tuple(buckets))


def views(plan: BucketPlan, buckets: list[torch.Tensor]) -> Iterable[tuple[str, torch.Tensor]]:
    """Each tensor's name and its view of ``buckets`` (laid out by ``plan``)."""
    for t in plan.tensors:
        yield t.name, buckets[t.bucket][t.offset : t.offset + t.numel].view(t.shape)


def sync_devices(tensors: Iterable[torch.Tensor]) -> None:
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.synchronize(device)


def bytes_of(t: torch.Tensor) -> memoryview:
    return t.detach().reshape(-1).view(torch.uint8).numpy().data


def checksum(data: torch.Tensor | bytes | memoryview, algorithm: str = "crc32") -> str:
    """The checksum of a contiguous CPU tensor's raw bytes (or of bytes), as hex."""
    fn = CHECKSUMS.get(algorithm)
    if fn is None:
        raise ValueError(f"unknown checksum {algorithm!r}; choose one of {sorted(CHECKSUMS)}")
    return fn(bytes_of(data) if isinstance(data, torch.Tensor) else memoryview(data))


def weights_digest(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> str:
    """A SHA-256 over every synced tensor's name, dtype, shape and bytes: equal digests mean
    bitwise-equal weights. For checks and tests; it copies each tensor to the host."""
    h = hashlib.sha256()
    for name, t in sorted(weight_tensors(model).items()):
        h.update(f"{name}|{dtype_name(t.dtype)}|{list(t.shape)}|".encode())
        h.update(bytes_of(t.detach().cpu().contiguous()))
    return h.hexdigest()


@contextlib.contextmanager
def released_as_stale() -> Iterator[None]:
    """:class:`StaleDescriptorError` from a publisher's buffers as :class:`StaleWeightsError`."""
    try:
        yield
    except StaleDescriptorError as exc:
        raise StaleWeightsError(
            f"the publisher released its weight buffers ({exc}); it closed or its actor "
            f"stopped. Ask it for a new ref"
        ) from exc
