"""Versioned weight sync, trainer to generators, over the data plane.

The trainer's :class:`WeightPublisher` copies a model's tensors into a few flat buckets (one
dtype each, at most ``bucket_bytes``; the layout is :func:`~._weightplan.plan_buckets`),
registers each bucket once as an :class:`orchestr.Buffer` and returns a small
:class:`WeightsRef` per version. The controller passes only that ref; each generator's
:class:`WeightLoader` reads the buckets straight from the trainer's memory (one kernel copy on a
host, tcp or rdma across hosts), verifies them and copies them into its model in place. The
bytes never go through the controller, and never one tensor per call.

**Double buffering**: the publisher keeps ``slots`` (default 2) sets of buckets and writes
version *v* into the set that does not hold *v - 1*, so a generator still reading the previous
version is never disturbed by the next publish. A reader that lags further behind finds its slot
rewritten: each slot has a one-word stamp (its version; -1 while being written) that the loader
reads before and after the buckets (a seqlock), so that case is reported as
:class:`StaleWeightsError`, never loaded. It relies on the publisher's stores becoming visible
in order (true on x86); elsewhere the checksum still catches the torn read.

**Checksum**: a 64-bit XXH3 per bucket by default (the ``xxhash`` library: about 7 GB/s a
core here, against 2.2 GB/s for zlib's CRC-32, and it releases the GIL). It guards against
accidents, not adversaries (peers share a cluster token): a torn or corrupted bucket escapes it
with probability about 2**-64, and the stale read a checksum could miss (a slot rewritten with
equal bytes) is caught by the stamp. ``checksum="crc32"``, ``"sha256"`` or ``"blake2b"`` are
the others (the last two buy a cryptographic digest at several times the cost). The loader
verifies every bucket before it touches the model, so a failed load leaves it as it was.

**Pieces**: the publisher checksums each bucket in pieces of :data:`PIECE_BYTES` (a digest
each), so a loader verifies each piece right after reading it, while its bytes are still in
the cache, two pieces at a time: reading and hashing overlap and the hash rarely goes back to
memory. The publisher's buckets live in shared memory (``orchestr.fabric.empty``), which a
loader on the same host copies from a mapping at memory bandwidth.

**Loading without a second copy** (CPU models): the loader keeps two sets of buckets and the
model's tensors are views of one of them. A load reads into the other set; once every piece
and the stamp check out, each tensor is pointed at its view of the new set (``tensor.data =
view``, no bytes moved) and the old set becomes the next load's. So a load costs one read,
and the model is touched only after everything verified. The price is a second copy of the
weights in memory. GPU models (and ``double_buffer=False``) read into host buckets and copy
from them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import torch

from orchestr import Buffer, fabric
from orchestr.errors import StaleDescriptorError

from ._weightplan import (
    CHECKSUMS,
    DEFAULT_BUCKET_BYTES,
    BucketPlan,
    ChecksumMismatchError,
    StaleWeightsError,
    WeightSyncError,
    bytes_of,
    few,
    piece_digests,
    plan_buckets,
    sync_devices,
    to_dtype,
    views,
    weight_tensors,
)
from ._weightref import BucketRef, WeightsRef

__all__ = ["BucketRef", "WeightLoader", "WeightPublisher", "WeightsRef"]

#: A slot's stamp while the publisher writes it.
WRITING = -1
#: Buckets are checksummed, and loads verify them, in pieces of this many bytes.
PIECE_BYTES = 4 << 20
#: What a load hands verified tensors to instead of copying them (``WeightLoader.load``).
Apply = Callable[[list[tuple[str, torch.Tensor]]], Awaitable[None]]


class _Slot:
    def __init__(self, plan: BucketPlan, pin: bool) -> None:
        # in shared memory unless pinned for a GPU: readers on this host then copy from a
        # mapping of it, at memory bandwidth (see orchestr.fabric's shm buffers)
        self.buckets = [
            torch.empty(b.numel, dtype=to_dtype(b.dtype), pin_memory=True)
            if pin
            else fabric.empty(b.numel, dtype=to_dtype(b.dtype))
            for b in plan.buckets
        ]
        self.buffers = [Buffer(b) for b in self.buckets]
        self.stamp = torch.zeros(1, dtype=torch.int64)
        self.stamp_buffer = Buffer(self.stamp)

    def release(self) -> None:
        for buf in [*self.buffers, self.stamp_buffer]:
            buf.release()


class WeightPublisher:
    """Trainer side: publishes versions of a model's weights as registered buckets.

    ``slots`` sets of buckets are registered on the first publish and reused for every later
    version (see double buffering above); a ref stays readable until ``slots`` newer versions
    have been published (with 2: version v until v + 2). Use ``with`` or :meth:`close` to
    release the buffers.
    """

    def __init__(
        self,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        slots: int = 2,
        checksum: str = "xxh3",
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        if checksum not in CHECKSUMS:
            raise ValueError(f"unknown checksum {checksum!r}; choose one of {sorted(CHECKSUMS)}")
        self.bucket_bytes, self.algorithm = bucket_bytes, checksum
        self.version: int | None = None
        self._plan: BucketPlan | None = None
        self._slots: list[_Slot] = []
        self._n_slots = slots
        self._next = 0
        self._closed = False

    def publish(
        self, model: torch.nn.Module | Mapping[str, torch.Tensor], version: int
    ) -> WeightsRef:
        """Copy ``model``'s weights into the next slot and return the ref of ``version``.

        Blocks while it copies and checksums (about model size / memory bandwidth); run it
        between optimizer steps, not while they change the weights. Raises
        :class:`WeightSyncError` for a version not above the last one, a model whose layout
        changed, or a closed publisher. Not idempotent: each call rewrites a slot.
        """
        if self._closed:
            raise WeightSyncError("this publisher is closed; make a new one")
        if version < 0:
            raise ValueError(f"versions are non-negative integers, got {version}")
        if self.version is not None and version <= self.version:
            raise WeightSyncError(
                f"version {version} is not newer than the last published {self.version}; "
                f"versions must increase"
            )
        tensors = weight_tensors(model)
        plan = plan_buckets(tensors, self.bucket_bytes)
        if self._plan is None:
            self._plan = plan
            pin = any(t.device.type == "cuda" for t in tensors.values())
            self._slots = [_Slot(plan, pin) for _ in range(self._n_slots)]
        elif plan != self._plan:
            raise WeightSyncError(
                "the model's tensors (names, dtypes or shapes) changed since the first "
                "publish; a publisher serves one layout, make a new one for another"
            )
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        slot.stamp.fill_(WRITING)  # a reader that overlaps this write sees it
        with torch.no_grad():
            for name, view in views(plan, slot.buckets):
                src = tensors[name].detach()
                view.copy_(src, non_blocking=src.device.type == "cuda")
        sync_devices(tensors.values())
        sums = [piece_digests(bytes_of(b), self.algorithm, PIECE_BYTES) for b in slot.buckets]
        slot.stamp.fill_(version)
        self.version = version
        return WeightsRef(
            version,
            plan.tensors,
            tuple(
                BucketRef(b.dtype, b.numel, s, buf)
                for b, s, buf in zip(plan.buckets, sums, slot.buffers, strict=True)
            ),
            slot.stamp_buffer,
            self.algorithm,
            PIECE_BYTES,
        )

    def close(self) -> None:
        """Release every bucket; readers of any ref then get :class:`StaleWeightsError`.
        Idempotent."""
        self._closed = True
        for slot in self._slots:
            slot.release()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WeightLoader:
    """Generator side: loads published versions into a model, in place.

    Host buckets are allocated on the first load (pinned when the model is on a GPU) and
    reused. Reads go in pieces, each verified as it lands. With
    ``double_buffer`` (the default) a CPU model's tensors become views of the loader's
    buckets and each load reads into the set they do not view (see the module docstring).
    ``max_inflight`` is kept for compatibility (pieces are read two at a time).
    ``transport`` and ``fallback`` are passed to :meth:`orchestr.Buffer.read_into`.
    """

    def __init__(
        self,
        *,
        max_inflight: int = 4,
        transport: str | None = None,
        fallback: str | None = None,
        double_buffer: bool = True,
    ) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, got {max_inflight}")
        self.version: int | None = None
        #: Transports the last load's reads used.
        self.transports: set[str] = set()
        self._read_options: dict[str, Any] = {"transport": transport, "fallback": fallback}
        self._double = double_buffer
        self._plan: BucketPlan | None = None
        self._sets: list[list[torch.Tensor]] = []  # bucket sets: staging, or the two halves
        self._lock = asyncio.Lock()  # one load at a time: they share the host buckets

    async def forget(self) -> None:
        """Forget which version is loaded (the weights stay as they are): the next load takes
        any version, an older one or the one loaded included. Waits for a load in progress.

        Blocks on a load in progress; raises nothing; cancel-safe."""
        async with self._lock:
            self.version = None

    async def load(
        self,
        model: torch.nn.Module | Mapping[str, torch.Tensor],
        ref: WeightsRef,
        *,
        apply: Apply | None = None,
    ) -> bool:
        """Read version ``ref.version`` from the publisher and copy it into ``model``.
        With ``apply``, ``model`` is a mapping of tensors shaped like the published ones
        (meta tensors will do) and the verified tensors (views of the loader's host buckets,
        valid until the next load) are passed to ``apply`` (awaited) instead of copied: for a
        model that keeps its weights in a layout of its own, as vLLM's fuses q, k and v.

        Returns ``False`` (and moves nothing) when that version is already loaded. Blocks on
        the reads, which go straight to the publisher's memory. The model is written only after
        every bucket has arrived and verified, so a failed load leaves it untouched. Raises
        :class:`StaleWeightsError` for a version older than the loaded one or one the publisher
        has rewritten or released, :class:`ManifestMismatchError` when the manifest does not
        fit ``model``, :class:`ChecksumMismatchError` for a bucket that arrived corrupted, and
        transport errors as the data plane raises them. Cancel-safe: cancelled, it leaves the
        model as it was. Loads on one loader run one at a time.
        """
        async with self._lock:
            return await self._load(model, ref, apply)

    async def _load(
        self,
        model: torch.nn.Module | Mapping[str, torch.Tensor],
        ref: WeightsRef,
        apply: Apply | None,
    ) -> bool:
        if self.version is not None and ref.version < self.version:
            raise StaleWeightsError(
                f"weights version {ref.version} is older than version {self.version}, which "
                f"is already loaded; pass the newest ref"
            )
        if ref.version == self.version:
            return False
        if apply is None:
            tensors = weight_tensors(model)
        elif isinstance(model, torch.nn.Module):
            raise TypeError("a load with apply= takes a mapping of tensors shaped as published")
        else:
            tensors = dict(model)
        plan = ref.plan
        if plan != self._plan:
            plan.validate()
            plan.check(tensors)
            self._sets, self._plan = [], plan
        else:
            plan.check(tensors)
        if ref.algorithm not in CHECKSUMS:
            raise WeightSyncError(f"unknown checksum {ref.algorithm!r} in weights ref")
        flip = (
            apply is None and self._double and all(t.device.type == "cpu" for t in tensors.values())
        )
        target = self._target(plan, tensors, flip)
        self.transports = set()
        await self._check_stamp(ref, "before reading")
        sums = await self._read_all(ref, target)
        await self._check_stamp(ref, "while it was read")
        for i, (b, got) in enumerate(zip(ref.buckets, sums, strict=True)):
            if got != b.checksum:
                names = [t.name for t in ref.tensors if t.bucket == i]
                raise ChecksumMismatchError(
                    f"bucket {i} of weights version {ref.version} ({b.numel} {b.dtype}: "
                    f"{few(names, 3)}) arrived with {ref.algorithm} {got}, the publisher "
                    f"computed {b.checksum}; the publisher's memory was changed after publish "
                    f"or the transfer corrupted it. Nothing was loaded"
                )
        if apply is not None:
            await apply(list(views(plan, target)))
            self.version = ref.version
            return True
        with torch.no_grad():
            for name, view in views(plan, target):
                dst = tensors[name]
                if flip:
                    dst.data = view  # the new half: no bytes move
                else:
                    dst.copy_(view, non_blocking=dst.device.type == "cuda")
        sync_devices(tensors.values())
        self.version = ref.version
        return True

    def _target(
        self, plan: BucketPlan, tensors: Mapping[str, torch.Tensor], flip: bool
    ) -> list[torch.Tensor]:
        """The buckets to read into: the staging set, or the half the model does not view."""

        def new_set() -> list[torch.Tensor]:
            pin = any(t.device.type == "cuda" for t in tensors.values())
            return [
                torch.empty(b.numel, dtype=to_dtype(b.dtype), pin_memory=pin) for b in plan.buckets
            ]

        if not flip:
            if not self._sets:
                self._sets = [new_set()]
            return self._sets[0]
        viewed = {  # a half any model tensor still views is in use
            i
            for i, half in enumerate(self._sets)
            if any(view.data_ptr() == tensors[name].data_ptr() for name, view in views(plan, half))
        }
        for i, half in enumerate(self._sets):
            if i not in viewed:
                return half
        if len(self._sets) < 2:
            self._sets.append(new_set())
            return self._sets[-1]
        raise WeightSyncError(
            "the model's tensors view both of this loader's halves (some were pointed "
            "elsewhere since the last load); load with a new WeightLoader"
        )

    async def _read(self, buf: Buffer, into: Any) -> None:
        with _released_as_stale():
            self.transports.add(await buf.read_into(into, **self._read_options))

    async def _check_stamp(self, ref: WeightsRef, when: str) -> None:
        stamp = torch.zeros(1, dtype=torch.int64)
        await self._read(ref.stamp, stamp)
        found = int(stamp[0])
        if found != ref.version:
            now = "is being rewritten" if found == WRITING else f"now holds version {found}"
            raise StaleWeightsError(
                f"the publisher's slot for weights version {ref.version} {now} ({when}): this "
                f"reader lagged too far behind (the publisher keeps its last few versions). "
                f"Nothing was loaded; load the newest ref"
            )

    async def _read_all(self, ref: WeightsRef, target: list[torch.Tensor]) -> list[str]:
        """Read every bucket into ``target``, each piece of the ref's hashed as it lands
        (:meth:`orchestr.Buffer.read_pieces`); the buckets' checksums as the publisher
        forms them."""
        fn = CHECKSUMS[ref.algorithm]
        sums = []
        for b, bucket in zip(ref.buckets, target, strict=True):
            step = ref.piece_bytes or max(bucket.numel() * bucket.element_size(), 1)
            with _released_as_stale():
                scheme, digests = await b.buffer.read_pieces(bucket, step, fn, **self._read_options)
            self.transports.add(scheme)
            sums.append(",".join(digests))
        return sums


@contextlib.contextmanager
def _released_as_stale() -> Iterator[None]:
    try:
        yield
    except StaleDescriptorError as exc:
        raise StaleWeightsError(
            f"the publisher released its weight buffers ({exc}); it closed or its actor "
            f"stopped. Ask it for a new ref"
        ) from exc
