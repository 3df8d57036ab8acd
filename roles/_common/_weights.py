"""Versioned weight sync, trainer to generators, over the data plane.

The trainer's :class:`WeightPublisher` copies a model's tensors into a few flat buckets (one
dtype each, at most ``bucket_bytes``; the layout is :func:`~._weightplan.plan_buckets`) in
shared memory (``orchestr.fabric.empty``), registers each once as an :class:`orchestr.Buffer`
and returns a small :class:`WeightsRef` per version. The controller passes only that ref; each
generator's :class:`WeightLoader` takes the buckets straight from the trainer's memory: on its
host it *borrows* them and its model's tensors become views of them, no copy
(:mod:`._weightborrow`); across hosts (or for a GPU model) it reads them (tcp or rdma) and
copies. The bytes never go through the controller, and never one tensor per call.

**Slots**: the publisher keeps ``slots`` (default 2) sets of buckets and writes version *v*
into a set that holds neither *v - 1* nor a version some loader still borrows (a new set when
all are in use, up to ``max_slots``), so a generator still using or reading an earlier version
is not disturbed by the next publish. A reader that lags further behind finds its slot
rewritten: each slot has a one-word stamp (its version; -1 while being written) that the loader
reads before and after the buckets (a seqlock), so that case is :class:`StaleWeightsError`,
never loaded. It relies on the publisher's stores becoming visible in order (true on x86);
elsewhere the checksum still catches the torn read.

**Checksum**: XXH3-64 (the ``xxhash`` library: about 7 GB/s a core here, against 2.2 GB/s for
CRC-32, and it releases the GIL), in pieces of :data:`PIECE_BYTES` (a digest each), against
accidents, not adversaries (peers share a cluster token); ``"crc32"``, ``"sha256"`` or
``"blake2b"`` are the others. A loader verifies every piece, where it lies when borrowed or
right after reading it (still in the cache), before it touches the model, so a failed load
leaves the model as it was.

**Sharded publishers**: a sharded trainer's members each publish their rows of each tensor;
the controller joins their refs into a :class:`ShardedWeightsRef`. A loader reads every part
(each verified as a whole ref's buckets are) into staging buckets and lays each tensor's rows
into the whole, then loads it as a read version: no process on the trainer's side holds the
whole model, and the generator pays one copy.

**No second copy**: a borrowed load moves no bytes (it hashes them in place). A read into a
CPU model goes into the half of two sets of host buckets the model does not view, and then
points each tensor at its view of it (``tensor.data = view``). GPU models (and
``double_buffer=False``) read into host buckets and copy from them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import torch

from orchestr import Buffer
from orchestr.fabric import Borrowed, Claim

from ._weightborrow import (
    WRITING,
    Slot,
    borrow_buckets,
    claim_slot,
    hash_in_place,
    release,
    tensors_of,
)
from ._weightplan import (
    CHECKSUMS,
    DEFAULT_BUCKET_BYTES,
    BucketPlan,
    StaleWeightsError,
    WeightSyncError,
    bytes_of,
    piece_digests,
    plan_buckets,
    released_as_stale,
    sync_devices,
    to_dtype,
    views,
    weight_tensors,
)
from ._weightref import BucketRef, ShardedWeightsRef, WeightsRef

__all__ = ["BucketRef", "ShardedWeightsRef", "WeightLoader", "WeightPublisher", "WeightsRef"]

#: Buckets are checksummed, and loads verify them, in pieces of this many bytes.
PIECE_BYTES = 4 << 20
#: What a load hands verified tensors to instead of copying them (``WeightLoader.load``).
Apply = Callable[[list[tuple[str, torch.Tensor]]], Awaitable[None]]


class WeightPublisher:
    """Trainer side: publishes versions of a model's weights as registered buckets.

    ``slots`` sets of buckets are registered on the first publish and reused for later
    versions, and more while loaders borrow them (see the module docstring; each loader
    borrows one at a time, so at most one more per loader; ``max_slots`` caps them, past which
    a publish is refused). A ref stays readable until at least ``slots`` newer versions have
    been published. Use ``with`` or :meth:`close` to release the buffers.
    """

    def __init__(
        self,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        slots: int = 2,
        checksum: str = "xxh3",
        max_slots: int | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        if checksum not in CHECKSUMS:
            raise ValueError(f"unknown checksum {checksum!r}; choose one of {sorted(CHECKSUMS)}")
        self.bucket_bytes, self.algorithm = bucket_bytes, checksum
        self.version: int | None = None
        self._plan: BucketPlan | None = None
        self._slots: list[Slot] = []
        self._n_slots = slots
        self._max_slots = max_slots if max_slots is not None else 1 << 30
        if self._max_slots < slots:
            raise ValueError(f"max_slots ({max_slots}) is below slots ({slots})")
        self._pin = False
        self._next, self._newest = 0, -1
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
            self._pin = any(t.device.type == "cuda" for t in tensors.values())
            self._slots = [Slot(plan, self._pin) for _ in range(self._n_slots)]
        elif plan != self._plan:
            raise WeightSyncError(
                "the model's tensors (names, dtypes or shapes) changed since the first "
                "publish; a publisher serves one layout, make a new one for another"
            )
        slot, claims = self._claim_slot()
        try:
            slot.stamp.fill_(WRITING)  # a reader that overlaps this write sees it
            with torch.no_grad():
                for name, view in views(plan, slot.buckets):
                    src = tensors[name].detach()
                    view.copy_(src, non_blocking=src.device.type == "cuda")
            sync_devices(tensors.values())
            sums = [piece_digests(bytes_of(b), self.algorithm, PIECE_BYTES) for b in slot.buckets]
            slot.stamp.fill_(version)
        finally:
            release(claims)
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

    def _claim_slot(self) -> tuple[Slot, list[Claim]]:
        assert self._plan is not None
        i, claims = claim_slot(self._slots, self._next, self._newest if self._n_slots > 1 else -1)
        if claims is None:
            n = len(self._slots)
            if n >= self._max_slots:
                raise WeightSyncError(
                    f"every one of this publisher's {n} slots is still borrowed by a loader "
                    f"that has not loaded a newer version (max_slots={self._max_slots}); "
                    f"nothing was published. Sync the generators, or allow more slots"
                )
            self._slots.append(Slot(self._plan, self._pin))
            i, claims = n, self._slots[n].claim()
            assert claims is not None  # nobody has seen it yet
        self._next, self._newest = (i + 1) % len(self._slots), i
        return self._slots[i], claims

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

    With ``borrow`` (the default) a CPU model on the publisher's host uses the publisher's
    buckets in place; otherwise host buckets are allocated on the first load (pinned for a GPU
    model) and read into, in pieces verified as they land. With ``double_buffer`` (the
    default) a CPU model's tensors are views of the buckets (see the module docstring); a
    compiled model needs ``double_buffer=False``. ``max_inflight`` is kept for compatibility.
    ``transport`` and ``fallback`` are passed to :meth:`orchestr.Buffer.read_into`.
    """

    def __init__(
        self,
        *,
        max_inflight: int = 4,
        transport: str | None = None,
        fallback: str | None = None,
        double_buffer: bool = True,
        borrow: bool = True,
    ) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, got {max_inflight}")
        self.version: int | None = None
        #: Transports the last load's reads used.
        self.transports: set[str] = set()
        self._read_options: dict[str, Any] = {"transport": transport, "fallback": fallback}
        self._double = double_buffer
        self._borrow = borrow
        self._borrowed: list[Borrowed] = []  # the buckets the model views, when borrowed
        self._plan: BucketPlan | None = None
        self._sets: list[list[torch.Tensor]] = []  # bucket sets: staging, or the two halves
        #: A sharded ref's parts' buckets, read into before their rows are laid into a set.
        self._staging: list[tuple[BucketPlan, list[torch.Tensor]]] = []
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
        ref: WeightsRef | ShardedWeightsRef,
        *,
        apply: Apply | None = None,
    ) -> bool:
        """Load version ``ref.version`` into ``model`` (borrowed or read: see the class). A
        :class:`ShardedWeightsRef`'s parts are read (each verified) into staging buckets and
        each tensor's rows laid into the whole, then loaded as a read one is.
        With ``apply``, ``model`` maps names to tensors shaped as published (meta tensors will
        do) and the verified tensors (views valid until the next load) go to ``apply``
        (awaited) instead: for a model with a weight layout of its own (vLLM fuses q, k, v).

        Returns ``False`` (moving nothing) when that version is already loaded. Blocks on the
        reads, straight from the publisher's memory. The model is changed only once every
        bucket verified, so a failed load leaves it as it was. Raises
        :class:`StaleWeightsError` for a version older than the loaded one or one the publisher
        has rewritten or released, :class:`ManifestMismatchError` when the manifest does not
        fit ``model``, :class:`ChecksumMismatchError` for a corrupted bucket, and transport
        errors. Cancel-safe: cancelled, it leaves the model as it was. One load at a time.
        """
        async with self._lock:
            return await self._load(model, ref, apply)

    async def _load(
        self,
        model: torch.nn.Module | Mapping[str, torch.Tensor],
        ref: WeightsRef | ShardedWeightsRef,
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
        parts = ref.parts if isinstance(ref, ShardedWeightsRef) else (ref,)
        for part in parts:
            if part.algorithm not in CHECKSUMS:
                raise WeightSyncError(f"unknown checksum {part.algorithm!r} in weights ref")
        flip = (
            apply is None and self._double and all(t.device.type == "cpu" for t in tensors.values())
        )
        self.transports = set()
        borrowed = None
        if isinstance(ref, WeightsRef) and self._borrow and (flip or apply is not None):
            with released_as_stale():
                borrowed = borrow_buckets(ref)
        try:
            if isinstance(ref, ShardedWeightsRef):
                target = self._target(plan, tensors, flip)
                await self._assemble(ref, plan, target)
            elif borrowed is not None:  # the publisher's own bytes, in place (_weightborrow)
                target = tensors_of(ref, borrowed)
                await self._check_stamp(ref, "once borrowed")
                ref.verify(await hash_in_place(ref, borrowed))
                self.transports = {"shm"}  # the buckets' (the stamp's is a plain read)
            else:
                target = self._target(plan, tensors, flip)
                await self._read_verified(ref, target)
            if apply is not None:
                await apply(list(views(plan, target)))
            else:
                with torch.no_grad():
                    for name, view in views(plan, target):
                        dst = tensors[name]
                        if flip:
                            dst.data = view  # the new half, or the publisher's: no bytes move
                        else:
                            dst.copy_(view, non_blocking=dst.device.type == "cuda")
                sync_devices(tensors.values())
        except BaseException:
            release(borrowed or [])
            raise
        release(self._borrowed)  # nothing views the previous version's buckets any more
        self._borrowed = borrowed or []
        if borrowed is not None and flip:
            self._sets = []  # the halves are not needed while the publisher's bytes are used
        self.version = ref.version
        return True

    @property
    def borrowing(self) -> bool:
        """Whether the loaded version is the publisher's memory, borrowed, not a copy."""
        return bool(self._borrowed)

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

    async def _read_verified(self, ref: WeightsRef, target: list[torch.Tensor]) -> None:
        """Read ``ref``'s buckets into ``target`` between two looks at its stamp, and verify
        them."""
        await self._check_stamp(ref, "before reading")
        sums = await self._read_all(ref, target)
        await self._check_stamp(ref, "while it was read")
        ref.verify(sums)

    async def _assemble(
        self, ref: ShardedWeightsRef, plan: BucketPlan, target: list[torch.Tensor]
    ) -> None:
        """Read every part of ``ref`` into staging buckets (kept for the next load), verify
        each, and copy each tensor's rows into its whole in ``target`` (laid out by
        ``plan``)."""
        pieces = ref.rows()
        plans = [part.plan for part in ref.parts]
        for p in plans:
            p.validate()
        if [p for p, _ in self._staging] != plans:
            self._staging = [
                (p, [torch.empty(b.numel, dtype=to_dtype(b.dtype)) for b in p.buckets])
                for p in plans
            ]
        for part, (_, staging) in zip(ref.parts, self._staging, strict=True):
            await self._read_verified(part, staging)
        with torch.no_grad():
            for name, whole in views(plan, target):
                at = 0
                for i, slot in pieces[name]:
                    bucket = self._staging[i][1][slot.bucket]
                    piece = bucket[slot.offset : slot.offset + slot.numel].view(slot.shape)
                    if piece.shape == whole.shape:
                        whole.copy_(piece)
                    else:
                        whole[at : at + piece.shape[0]].copy_(piece)
                        at += piece.shape[0]

    async def _read(self, buf: Buffer, into: Any) -> None:
        with released_as_stale():
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
            with released_as_stale():
                scheme, digests = await b.buffer.read_pieces(bucket, step, fn, **self._read_options)
            self.transports.add(scheme)
            sums.append(",".join(digests))
        return sums
