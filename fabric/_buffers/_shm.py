"""``shm://`` one-sided buffers between processes on one host.

The owner publishes each registered region (address, length, key) in a table that lives in a
memfd segment (:mod:`._memfd`). A peer maps the table read-only, checks the descriptor against
the owner's entry (key and bounds come from the owner, never from the descriptor), and moves the
bytes with one kernel copy between the two address spaces (``process_vm_readv`` /
``process_vm_writev``); no socket, no staging buffer, and the owner takes no part. After the copy
the peer checks the entry again, so a region released during a transfer is reported as stale.
Any CPU memory can be registered, so a tensor is registered where it lies.

A region that lies in one of the owner's shared-memory segments (a tensor from
``orchestr.fabric.empty``) is read faster: its entry also names the segment (fd, key, offset,
written by the owner), and a reader maps that segment read-only (checked as the call path
checks it, the mapping kept for later reads) and copies with ``memmove``, at memory bandwidth
instead of ``process_vm_readv``'s. Writes always use ``process_vm_writev``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import mmap
import os
import struct
import threading
from collections.abc import Callable
from typing import Any

from orchestr.errors import DescriptorError, StaleDescriptorError, TransportError
from orchestr.fabric import _local

from ._memfd import HEADER, Segment, generation_of, open_peer
from ._transport import Descriptor, OneSided, Region, count

__all__ = ["ShmBuffers"]

#: key, address, length, region id << 2 | scoped << 1 | writable; and for a region in one of
#: the owner's segments, that segment's fd + 1 (0: none), key and the region's offset in it
_ENTRY = struct.Struct("<QQQQQQQ")
_WRITABLE, _SCOPED = 1, 2
TABLE_SLOTS = 1 << 16
#: Transfers at least this large run in a thread, off the event loop.
THREAD_BYTES = 256 * 1024


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


# The process's own symbols, libc's among them: ``ctypes.util.find_library("c")`` runs
# ``ldconfig -p`` in a child process, a cost every worker paid at start-up.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_writev.restype = ctypes.c_ssize_t
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF)


def address_of(view: memoryview) -> int:
    """The address of a contiguous buffer (read-only ones too)."""
    import numpy as np

    if view.nbytes == 0:
        return 0
    if not view.readonly:  # the cheaper way, for writable memory
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _vm_copy(write: bool, pid: int, local: int, remote: int, nbytes: int) -> None:
    fn = _libc.process_vm_writev if write else _libc.process_vm_readv
    done = 0
    while done < nbytes:
        lvec = _IoVec(local + done, nbytes - done)
        rvec = _IoVec(remote + done, nbytes - done)
        n = fn(pid, ctypes.byref(lvec), 1, ctypes.byref(rvec), 1, 0)
        if n < 0:
            err = ctypes.get_errno()
            if err in (errno.ESRCH, errno.EFAULT):
                raise StaleDescriptorError(
                    f"the memory of process {pid} is gone ({os.strerror(err)}): released, or "
                    f"the process exited"
                )
            raise TransportError(
                f"cross-process copy with process {pid} failed: {os.strerror(err)}"
            )
        if n == 0:
            raise StaleDescriptorError(f"the memory of process {pid} could not be reached")
        done += n


class _Table:
    """This process's published region table."""

    def __init__(self) -> None:
        self.segment = Segment(TABLE_SLOTS * _ENTRY.size)
        self.free = list(range(TABLE_SLOTS - 1, -1, -1))
        self.lock = threading.Lock()

    def put(self, region: Region) -> int:
        with self.lock:
            if not self.free:
                raise TransportError(f"more than {TABLE_SLOTS} shm buffers registered at once")
            slot = self.free.pop()
        addr = address_of(region.mem)
        flags = region.id << 2 | (0 if region.mem.readonly else _WRITABLE)
        flags |= 0 if region.scope is None else _SCOPED
        from ._segments import pool  # (it imports this module)

        found = pool.find(addr, region.mem.nbytes) if region.mem.nbytes else None
        seg = (found[0].fd + 1, found[0].key, found[1]) if found else (0, 0, 0)
        _ENTRY.pack_into(
            self.segment.data, slot * _ENTRY.size, region.key, addr, region.mem.nbytes, flags, *seg
        )
        return slot

    def clear(self, slot: int) -> None:
        _ENTRY.pack_into(self.segment.data, slot * _ENTRY.size, 0, 0, 0, 0, 0, 0, 0)
        with self.lock:
            self.free.append(slot)


class ShmBuffers(OneSided):
    """The ``shm`` buffer backend. A scoped region's spans are checked here, by the reader,
    from its descriptor (the owner's table says only that the region is scoped): a reader on
    the owner's host, running as the same user, can reach the owner's memory anyway
    (``process_vm_readv``, its memfds), so the user is the boundary."""

    scheme = "shm"
    scoped = "reader"

    def __init__(self) -> None:
        self._table: _Table | None = None
        self._table_pid = 0
        self._peers: dict[tuple[int, int, int], mmap.mmap] = {}
        #: owners' segments mapped read-only, by (pid, fd, key): the mapping and its address
        self._segments: dict[tuple[int, int, int], tuple[mmap.mmap, Any]] = {}
        self._mapped_bytes = 0  # read from such mappings, not by a kernel copy
        self._probed: str | bool | None = False

    def probe(self) -> str | None:
        if self._probed is False:
            self._probed = self._check()
        return self._probed  # type: ignore[return-value]

    def _check(self) -> str | None:
        if not hasattr(os, "memfd_create"):
            return "this platform has no memfd_create"
        try:
            src = bytearray(b"probe")
            dst = bytearray(5)
            _vm_copy(
                False, os.getpid(), address_of(memoryview(dst)), address_of(memoryview(src)), 5
            )
        except (OSError, TransportError) as exc:
            return f"cross-process memory access is not permitted here: {exc}"
        return None if dst == src else "cross-process copy returned wrong bytes"

    def details(self) -> dict[str, Any]:
        """For :func:`orchestr.fabric.transport_report`: owners' segments mapped here and
        the bytes read from them."""
        return {"mapped_segments": len(self._segments), "mapped_bytes_read": self._mapped_bytes}

    def reaches(self, owner: str) -> bool:
        return _local.host_of(owner) == _local.host_id()

    def _my_table(self) -> _Table:
        if self._table is None or self._table_pid != os.getpid():
            self._table = _Table()
            self._table_pid = os.getpid()
            # under Yama ptrace_scope=1 peers may read us only if we say so
            _libc.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)
        return self._table

    def export(self, region: Region) -> tuple[Any, ...]:
        table = self._my_table()
        slot = table.put(region)
        return (os.getpid(), table.segment.fd, table.segment.key, slot)

    def unexport(self, region: Region) -> None:
        where = region.exports.get(self.scheme)
        if where is not None and self._table is not None:
            self._table.clear(where[3])

    # -- peer side -----------------------------------------------------------------------------
    def _entry(self, desc: Descriptor, write: bool) -> tuple[int, int, tuple[int, int, int]]:
        """``(pid, remote address, (segment fd + 1, key, offset))`` after checking ``desc``
        against its owner's table."""
        try:
            pid, fd, table_key, slot = desc.where
        except ValueError:
            raise DescriptorError(f"malformed shm descriptor {desc.where!r}") from None
        if not all(isinstance(v, int) for v in (pid, fd, table_key, slot)) or not (
            0 <= slot < TABLE_SLOTS
        ):
            raise DescriptorError(f"malformed shm descriptor {desc.where!r}")
        if pid != _local.pid_of(desc.owner):
            raise DescriptorError("shm descriptor names a process other than its owner")
        table = self._peers.get((pid, fd, table_key))
        if table is None:
            for k in [k for k in self._peers if not os.path.exists(f"/proc/{k[0]}")]:
                self._peers.pop(k).close()
            table = open_peer(pid, fd, table_key, writable=False)
            self._peers[(pid, fd, table_key)] = table
        key, addr, length, flags, *seg = _ENTRY.unpack_from(table, HEADER + slot * _ENTRY.size)
        if key != desc.key or flags >> 2 != desc.region:
            raise StaleDescriptorError(
                f"buffer region {desc.region} of {desc.owner} was released (or the descriptor "
                f"is forged)"
            )
        if length != desc.length:
            raise DescriptorError(
                f"descriptor says {desc.length} bytes; the owner registered {length}"
            )
        if write and not flags & _WRITABLE:
            raise DescriptorError(f"buffer region {desc.region} of {desc.owner} is read-only")
        if flags & _SCOPED and desc.scope is None:
            raise DescriptorError(
                f"buffer region {desc.region} of {desc.owner} grants some spans only; this "
                f"descriptor claims all of it (forged)"
            )
        return pid, addr, (seg[0], seg[1], seg[2])

    def _mapped(self, pid: int, seg: tuple[int, int, int], offset: int, nbytes: int) -> int:
        """The address, in a read-only mapping here, of ``nbytes`` at ``offset`` of the
        owner's region in its segment ``seg``."""
        fd, key, start = seg[0] - 1, seg[1], seg[2]
        entry = self._segments.get((pid, fd, key))
        if entry is None:
            import numpy as np

            self._forget_dead_segments()
            mm = open_peer(pid, fd, key, writable=False)
            entry = self._segments[(pid, fd, key)] = (mm, np.frombuffer(mm, dtype=np.uint8))
        mm, array = entry
        if HEADER + start + offset + nbytes > len(mm):
            raise DescriptorError(f"[{offset}, +{nbytes}) lies outside segment {fd} of {pid}")
        return int(array.ctypes.data) + HEADER + start + offset

    def _forget_dead_segments(self) -> None:
        """Unmap segments their owners closed (the header's key is cleared then) or whose
        owner is gone, so a mapping never keeps freed memory alive for long."""
        for k, (mm, _) in list(self._segments.items()):
            if not os.path.exists(f"/proc/{k[0]}") or generation_of(mm)[0] != k[2]:
                del self._segments[k]
                with contextlib.suppress(BufferError):
                    mm.close()

    def _still_live(self, desc: Descriptor) -> None:
        pid, fd, table_key, slot = desc.where
        table = self._peers[(pid, fd, table_key)]
        if _ENTRY.unpack_from(table, HEADER + slot * _ENTRY.size)[0] != desc.key:
            raise StaleDescriptorError(
                f"buffer region {desc.region} of {desc.owner} was released during the transfer"
            )

    async def move(self, write: bool, desc: Descriptor, offset: int, local: memoryview) -> None:
        desc.check_span(offset, local.nbytes)
        pid, addr, seg = self._entry(desc, write)
        if local.nbytes:
            if seg[0] and not write:  # in a segment of the owner's: copy from a mapping
                src = self._mapped(pid, seg, offset, local.nbytes)
                self._mapped_bytes += local.nbytes
                copy: Any = ctypes.memmove
                args: tuple[Any, ...] = (address_of(local), src, local.nbytes)
            else:
                copy, args = _vm_copy, (write, pid, address_of(local), addr + offset, local.nbytes)
            if local.nbytes >= THREAD_BYTES:
                await asyncio.to_thread(copy, *args)
            else:
                copy(*args)
        self._still_live(desc)

    async def read_pieces(
        self,
        desc: Descriptor,
        offset: int,
        dst: memoryview,
        piece: int,
        fn: Callable[[memoryview], Any],
    ) -> list[Any]:
        """From a region in one of the owner's segments: the pieces copied and passed to
        ``fn`` by two threads at once, each piece right after its copy (its bytes still in the
        cache), off the event loop in one hop. Otherwise piece by piece."""
        desc.check_span(offset, dst.nbytes)
        pid, _, seg = self._entry(desc, False)
        if not seg[0] or dst.nbytes < THREAD_BYTES:
            return await super().read_pieces(desc, offset, dst, piece, fn)
        if dst.readonly or piece < 1:
            raise ValueError("read_pieces needs a writable destination and a positive piece")
        src, local = self._mapped(pid, seg, offset, dst.nbytes), address_of(dst)
        self._mapped_bytes += dst.nbytes

        def one(at: int) -> Any:
            n = min(piece, dst.nbytes - at)
            ctypes.memmove(local + at, src + at, n)
            return fn(dst[at : at + n])

        def run() -> list[Any]:
            return list(_piece_workers().map(one, range(0, dst.nbytes, piece)))

        out = await asyncio.to_thread(run)
        self._still_live(desc)
        count(self.scheme, read=dst.nbytes)
        return out

    async def read_addresses(self, desc: Descriptor, spans: list[tuple[int, int, int]]) -> None:
        """Several reads of one region, each ``(offset, local address, nbytes)`` into memory
        of this process the caller vouches for (:meth:`_move_spans`)."""
        await self._move_spans(False, desc, spans)

    async def write_addresses(self, desc: Descriptor, spans: list[tuple[int, int, int]]) -> None:
        """Several writes into one region, each ``(offset, local address, nbytes)`` from
        memory of this process the caller vouches for (:meth:`_move_spans`)."""
        await self._move_spans(True, desc, spans)

    async def _move_spans(
        self, write: bool, desc: Descriptor, spans: list[tuple[int, int, int]]
    ) -> None:
        """:meth:`move` for several spans of one region: every span is checked first, then all
        are copied in one hop off the event loop (one thread: a second gains nothing on these
        hosts), reads from one of the owner's segments by ``memmove`` from its mapping, the
        rest by kernel copies."""
        for offset, _, nbytes in spans:
            desc.check_span(offset, nbytes)
        pid, addr, seg = self._entry(desc, write)
        total = sum(n for _, _, n in spans)
        copies: list[tuple[Any, tuple[Any, ...]]]
        if seg[0] and not write:
            base = self._mapped(pid, seg, 0, desc.length)  # every span was checked within it
            copies = [(ctypes.memmove, (local, base + o, n)) for o, local, n in spans if n]
            self._mapped_bytes += total
        else:
            copies = [(_vm_copy, (write, pid, local, addr + o, n)) for o, local, n in spans if n]

        def copy_all() -> None:
            for copy, args in copies:
                copy(*args)

        if total >= THREAD_BYTES:
            await asyncio.to_thread(copy_all)
        else:
            copy_all()
        self._still_live(desc)
        count(self.scheme, **({"written": total} if write else {"read": total}))


_workers: concurrent.futures.ThreadPoolExecutor | None = None


def _piece_workers() -> concurrent.futures.ThreadPoolExecutor:
    global _workers
    if _workers is None:
        _workers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="orchestr-shm")
    return _workers


def _forget_workers() -> None:
    global _workers
    _workers = None  # its threads did not survive the fork


os.register_at_fork(after_in_child=_forget_workers)
