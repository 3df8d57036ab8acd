"""Shared-memory segments for bulk values on the actor-call path (same host).

The sender leases a segment from its :class:`SegmentPool`, copies the tensor in once, and sends
a descriptor ``(pid, fd, key, generation, offset, nbytes)`` in the call frame. The receiver maps
the segment (once: :class:`PeerSegments` caches mappings, so a reused segment costs no page
faults) and hands the actor a tensor that *is* the shared memory: no copy on the receiving side.
When that tensor is garbage collected the receiver sends a release back, and the segment returns
to the sender's pool. A tensor allocated with :meth:`SegmentPool.empty` already lives in a
segment and is sent with no copy at all.

Leases held by a peer that exits are reclaimed when the peer's pid is gone.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import ctypes
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from orchestr.errors import DescriptorError, StaleDescriptorError

from ._borrow import borrowed
from ._memfd import HEADER, Segment, generation_of, open_peer
from ._shm import address_of

__all__ = ["PeerSegments", "SegmentPool", "copy", "empty", "pool", "receive_pool"]

_MIN_CAPACITY = 1 << 20
#: Copies at least this large are split across threads (memory bandwidth, not one core).
PARALLEL_COPY = 256 << 20
_copiers: concurrent.futures.ThreadPoolExecutor | None = None


def copy(dst: int, src: int, nbytes: int) -> None:
    """``memmove`` between addresses; large copies run on up to four cores at once."""
    global _copiers
    ways = min(4, os.cpu_count() or 1) if nbytes >= PARALLEL_COPY else 1
    if ways == 1:
        ctypes.memmove(dst, src, nbytes)
        return
    if _copiers is None:
        _copiers = concurrent.futures.ThreadPoolExecutor(ways, thread_name_prefix="orchestr-copy")
    step = -(-nbytes // ways) + 4095 & ~4095
    futures = [
        _copiers.submit(ctypes.memmove, dst + at, src + at, min(step, nbytes - at))
        for at in range(step, nbytes, step)
    ]
    ctypes.memmove(dst, src, min(step, nbytes))  # this thread takes the first part
    for f in futures:
        f.result()


def _capacity(nbytes: int) -> int:
    """Segment sizes: powers of two up to 64 MiB, then multiples of 64 MiB."""
    if nbytes <= 64 << 20:
        return max(_MIN_CAPACITY, 1 << (nbytes - 1).bit_length())
    step = 64 << 20
    return -(-nbytes // step) * step


class _Slot:
    __slots__ = ("base", "holders", "segment")

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.base = address_of(segment.data)
        #: Outstanding holders: peers that were sent a descriptor, and a local ``empty`` tensor.
        self.holders = 0


class SegmentPool:
    """The segments this process lends to peers. Thread-safe."""

    def __init__(self, idle_bytes: int = 2 << 30) -> None:
        self.idle_bytes = idle_bytes
        self._lock = threading.Lock()
        self._by_fd: dict[int, _Slot] = {}
        self._free: list[_Slot] = []
        self._bases: list[tuple[int, int]] = []  # (base address, fd), sorted
        #: pid -> [(fd, generation)] leased to peers whose connection is gone
        self._orphans: dict[int, list[tuple[int, int]]] = {}
        #: Releases from finalizers, applied at the next locked operation: a finalizer may run
        #: inside garbage collection while this thread holds the lock.
        self._later: collections.deque[tuple[int, int]] = collections.deque()
        self._pid = os.getpid()

    def _enter(self) -> None:
        """Under the lock: forget the parent's segments after a fork, apply queued releases."""
        if self._pid != os.getpid():  # a forked child must not lend its parent's segments
            self._by_fd, self._free, self._bases, self._orphans = {}, [], [], {}
            self._later.clear()
            self._pid = os.getpid()
        while self._later:
            self._release(*self._later.popleft())

    def lease(self, nbytes: int) -> tuple[Segment, int]:
        """A segment with room for ``nbytes``, held once; returns it and its new generation.

        Raises OSError when the system refuses more shared memory (memory, file descriptors).
        """
        with self._lock:
            self._enter()
            self._reap_orphans()
            while True:
                best = None
                for i, slot in enumerate(self._free):
                    if slot.segment.capacity >= nbytes and (
                        best is None or slot.segment.capacity < self._free[best].segment.capacity
                    ):
                        best = i
                if best is None or not borrowed(self._free[best].segment):
                    break
                # a peer still uses some of it in place (orchestr.Buffer.borrow): it is theirs
                # until they let go, and the kernel frees it then
                self._drop(self._free.pop(best))
            if best is not None:
                slot = self._free.pop(best)
            else:
                slot = _Slot(Segment(_capacity(nbytes), populate=True))
                self._by_fd[slot.segment.fd] = slot
                bisect.insort(self._bases, (slot.base, slot.segment.fd))
            slot.holders = 1
            return slot.segment, slot.segment.bump()

    def hold(self, fd: int, generation: int) -> bool:
        """One more holder of a segment that is lent out under ``generation`` (its descriptor
        is being sent again); ``False``, changing nothing, when it no longer is."""
        with self._lock:
            self._enter()
            slot = self._by_fd.get(fd)
            if slot is None or slot.holders <= 0 or slot.segment.generation != generation:
                return False
            slot.holders += 1
            return True

    def release(self, fd: int, generation: int) -> None:
        """A holder is done. Releases for an older generation are ignored."""
        with self._lock:
            self._enter()
            self._release(fd, generation)

    def release_later(self, fd: int, generation: int) -> None:
        """:meth:`release` for finalizers: takes no lock, applied by the next operation."""
        self._later.append((fd, generation))

    def _release(self, fd: int, generation: int) -> None:
        slot = self._by_fd.get(fd)
        if slot is None or slot.segment.generation != generation or slot.holders <= 0:
            return
        slot.holders -= 1
        if slot.holders == 0:
            self._free.append(slot)
            self._trim()

    def orphan(self, pid: int, leases: list[tuple[int, int]]) -> None:
        """``pid``'s connection is gone while it held ``leases``: reclaim them once it exits."""
        if leases:
            with self._lock:
                self._enter()
                self._orphans.setdefault(pid, []).extend(leases)
                self._reap_orphans()

    def _reap_orphans(self) -> None:
        for pid in [p for p in self._orphans if not os.path.exists(f"/proc/{p}")]:
            for fd, generation in self._orphans.pop(pid):
                slot = self._by_fd.get(fd)
                if slot is not None and slot.segment.generation == generation and slot.holders:
                    slot.holders -= 1
                    if slot.holders == 0:
                        self._free.append(slot)

    def _trim(self) -> None:
        """Close the longest-idle segments beyond ``idle_bytes``."""
        idle = sum(s.segment.capacity for s in self._free)
        while idle > self.idle_bytes and self._free:
            slot = self._free.pop(0)
            idle -= slot.segment.capacity
            self._drop(slot)

    def _drop(self, slot: _Slot) -> None:
        del self._by_fd[slot.segment.fd]
        self._bases.remove((slot.base, slot.segment.fd))
        slot.segment.close()

    def find(self, address: int, nbytes: int) -> tuple[Segment, int] | None:
        """The held segment containing ``[address, address+nbytes)`` and the offset in it."""
        with self._lock:
            self._enter()
            i = bisect.bisect_right(self._bases, (address, 1 << 62)) - 1
            if i < 0:
                return None
            base, fd = self._bases[i]
            slot = self._by_fd[fd]
            if slot.holders and address + nbytes <= base + slot.segment.capacity:
                return slot.segment, address - base
            return None

    def empty(self, nbytes: int) -> tuple[memoryview, Callable[[], None]]:
        """Memory in a segment for a local tensor; call the returned function when it dies."""
        segment, generation = self.lease(nbytes)
        return segment.data[:nbytes], lambda: self.release_later(segment.fd, generation)

    def lent_bytes(self) -> int:
        """Capacity of the segments held by someone now."""
        with self._lock:
            self._enter()
            return sum(s.segment.capacity for s in self._by_fd.values() if s.holders)

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._enter()
            return {
                "segments": len(self._by_fd),
                "bytes": sum(s.segment.capacity for s in self._by_fd.values()),
                "idle_bytes": sum(s.segment.capacity for s in self._free),
                "held": sum(1 for s in self._by_fd.values() if s.holders),
            }

    def close(self) -> None:
        """Close every segment (process shutdown); peers keep what they still map."""
        with self._lock:
            self._later.clear()
            for slot in list(self._by_fd.values()):
                self._drop(slot)
            self._free.clear()
            self._orphans.clear()


class PeerSegments:
    """Mappings of other processes' segments, cached so a reused segment costs nothing."""

    def __init__(self, max_bytes: int = 4 << 30) -> None:
        self.max_bytes = max_bytes
        self._maps: dict[tuple[int, int, int], mmap.mmap] = {}

    def view(
        self,
        pid: int,
        fd: int,
        key: int,
        generation: int,
        offset: int,
        nbytes: int,
        on_release: Callable[[], None],
    ) -> Any:
        """A numpy uint8 array over the peer's bytes; ``on_release`` runs when it is freed."""
        import numpy as np

        mm = self._maps.get((pid, fd, key))
        if mm is None:
            mm = open_peer(pid, fd, key)
            self._evict(len(mm))
            self._maps[(pid, fd, key)] = mm
        if generation_of(mm) != (key, generation):
            self._maps.pop((pid, fd, key), None)
            raise StaleDescriptorError(
                f"segment {fd} of process {pid} moved on from generation {generation} before it "
                f"was read (its owner released it)"
            )
        if offset < 0 or nbytes < 0 or HEADER + offset + nbytes > len(mm):
            raise DescriptorError(
                f"[{offset}, +{nbytes}) lies outside segment {fd} of process {pid}"
            )
        array = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=HEADER + offset)
        weakref.finalize(array, on_release)
        return array

    def _evict(self, incoming: int) -> None:
        total = sum(len(m) for m in self._maps.values()) + incoming
        for k in list(self._maps):
            if total <= self.max_bytes:
                break
            total -= len(self._maps.pop(k))  # live views keep their mapping until they go

    def forget(self, pid: int) -> None:
        """Drop cached mappings of ``pid`` (its connection closed)."""
        for k in [k for k in self._maps if k[0] == pid]:
            del self._maps[k]


def _forget_copiers() -> None:
    global _copiers
    _copiers = None  # its threads did not survive the fork


os.register_at_fork(after_in_child=_forget_copiers)

pool = SegmentPool()
peers = PeerSegments()
#: Memory for large frames arriving over a stream; never lent to peers (see ``_frames``).
receive_pool = SegmentPool(idle_bytes=2 << 30)


def empty(shape: int | tuple[int, ...] | list[int], dtype: Any = None) -> Any:
    """An uninitialised CPU tensor in shared memory.

    Sending it (or a contiguous slice of it) to an actor on this host copies nothing: the
    receiver gets a tensor over the same memory. So the sender must not change it until the
    receiver is done, as with any one-sided transfer. The memory returns to the pool when the
    tensor and every tensor received from it are gone.
    """
    import numpy as np
    import torch

    dtype = torch.float32 if dtype is None else dtype
    dims = [shape] if isinstance(shape, int) else list(shape)
    nbytes = torch.empty((), dtype=dtype).element_size()
    for d in dims:
        nbytes *= d
    if nbytes == 0:
        return torch.empty(dims, dtype=dtype)
    view, done = pool.empty(nbytes)
    array = np.frombuffer(view, dtype=np.uint8, count=nbytes)
    weakref.finalize(array, done)
    return torch.from_numpy(array).view(dtype).reshape(dims)
