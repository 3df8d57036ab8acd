"""A load with no copy, on the publisher's host: the model's tensors become views of the
publisher's buckets, borrowed (:meth:`orchestr.Buffer.borrow`) for as long as the model uses
them.

A borrow holds a shared lock on a bucket's bytes that the publisher respects: it takes an
exclusive claim on a slot's buckets before it rewrites them (:meth:`orchestr.Buffer.claim`),
and a slot any loader still borrows is never claimed: the publisher writes the next version
into another slot, or a new one. So a borrowed version stays as it was published until the
loader lets go of it (at its next load), and a loader killed with SIGKILL lets go with its
process.

Order: borrow every bucket, then read the slot's stamp (it cannot change while the buckets are
borrowed: the publisher writes it under its claim) and hash every piece in place (the same
checksums a read verifies), and only then point the model at the views. A load that fails
borrows nothing and changes nothing.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable
from typing import Any

import torch

from orchestr import Buffer, fabric
from orchestr.fabric import Borrowed, Claim

from ._weightplan import CHECKSUMS, BucketPlan, to_dtype
from ._weightref import WeightsRef

__all__ = [
    "WRITING",
    "Slot",
    "borrow_buckets",
    "claim_slot",
    "hash_in_place",
    "release",
    "tensors_of",
]


#: A slot's stamp while the publisher writes it.
WRITING = -1


class Slot:
    """One set of a publisher's buckets and its stamp."""

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

    def claim(self) -> list[Claim] | None:
        """Claims on every bucket, or ``None`` (holding none) while a loader borrows one."""
        held: list[Claim] = []
        for buf in self.buffers:
            got = buf.claim()
            if got is None:
                release(held)
                return None
            held.append(got)
        return held


def claim_slot(slots: list[Slot], start: int, skip: int) -> tuple[int, list[Claim] | None]:
    """The first slot from ``start`` on (round the ring, passing over ``skip``: the newest
    version's) that no loader borrows, claimed; ``(-1, None)`` when every one is in use."""
    for k in range(len(slots)):
        i = (start + k) % len(slots)
        if i != skip:
            claims = slots[i].claim()
            if claims is not None:
                return i, claims
    return -1, None


def borrow_buckets(ref: WeightsRef) -> list[Borrowed] | None:
    """Every bucket of ``ref`` borrowed, or ``None`` (and nothing borrowed) where one cannot
    be: a publisher on another host or with pinned buckets, or one rewriting that slot now.
    Raises :class:`StaleDescriptorError` for released buckets."""
    held: list[Borrowed] = []
    try:
        for b in ref.buckets:
            got = b.buffer.borrow()
            if got is None:
                release(held)
                return None
            held.append(got)
    except BaseException:
        release(held)
        raise
    return held


def tensors_of(ref: WeightsRef, borrowed: list[Borrowed]) -> list[torch.Tensor]:
    """The borrowed buckets as flat tensors of their dtypes (read-only memory: a write to one
    faults)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return [
            torch.frombuffer(x.view, dtype=to_dtype(b.dtype), count=b.numel)
            if b.numel
            else torch.empty(0, dtype=to_dtype(b.dtype))
            for b, x in zip(ref.buckets, borrowed, strict=True)
        ]


async def hash_in_place(ref: WeightsRef, borrowed: list[Borrowed]) -> list[str]:
    """Each bucket's checksum as the publisher forms it (its pieces' digests joined by
    commas), hashed where the bytes lie, pieces spread over threads (the hashes release the
    GIL)."""
    fn: Callable[[memoryview], str] = CHECKSUMS[ref.algorithm]
    jobs: list[tuple[int, memoryview]] = []
    for i, x in enumerate(borrowed):
        step = ref.piece_bytes or max(x.view.nbytes, 1)
        jobs += [(i, x.view[at : at + step]) for at in range(0, max(x.view.nbytes, 1), step)]
    digests = await asyncio.gather(*(asyncio.to_thread(fn, piece) for _, piece in jobs))
    sums: list[list[str]] = [[] for _ in borrowed]
    for (i, _), digest in zip(jobs, digests, strict=True):
        sums[i].append(digest)
    return [",".join(s) for s in sums]


def release(borrowed: list[Any]) -> None:
    for x in borrowed:
        x.release()
