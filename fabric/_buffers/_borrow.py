"""Borrowing a buffer's memory in place, on the owner's host, with a lease the owner respects.

A reader on the owner's host may use a region that lies in one of the owner's shared-memory
segments (a tensor from ``orchestr.fabric.empty``) where it is, with no copy: it maps the
segment read-only (the mapping the ``shm`` backend keeps for reads, so a reused region costs no
page faults) and holds a shared lock on the region's bytes of the segment file while it uses
them. The owner takes an exclusive lock on the same bytes before it changes them
(:func:`claim`); that fails while anyone borrows them, and a borrow fails while the owner holds
its claim.

The locks are Linux open-file-description locks (``F_OFD_SETLK``) on the segment's memfd: the
borrower opens the segment file anew (``/proc/PID/fd/FD``), so its lock belongs to that open
and conflicts with the owner's and other borrowers' (also within one process), and the kernel
drops it when that file is closed, so a borrower killed with SIGKILL never holds a region (a
child it forked without exec shares the open, and the borrow lasts until that child exits).
A segment the owner freed while a peer borrows part of it is not lent out again
(``SegmentPool.lease`` drops it; the kernel frees it when the last borrower unmaps it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
from typing import TYPE_CHECKING

from . import _scope
from ._memfd import _HEAD, HEADER, MAGIC, Segment
from ._scope import Scope

if TYPE_CHECKING:
    from ._shm import ShmBuffers
    from ._transport import Descriptor, Region

__all__ = ["Borrowed", "Claim", "borrow", "borrowed", "claim"]

_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux x86-64 and aarch64


def _lock(fd: int, kind: int, start: int, length: int) -> bool:
    """Set (or with ``F_UNLCK`` drop) an OFD lock on ``[start, start + length)`` of ``fd``
    without waiting; ``False`` when another open of the file holds a conflicting one."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):  # held by another open
            return False
        raise
    return True


class Borrowed:
    """A region of another process's memory, used in place while this borrow is held.

    ``view`` is a read-only memoryview of the region's bytes. They stay as the owner last
    wrote them until :meth:`release` (the owner cannot :func:`claim` them meanwhile), and
    that includes after the owner released the buffer or exited. Release it (or use ``with``)
    as soon as its bytes are no longer used; a dropped borrow is released when collected.

    Of a scoped buffer, ``view`` covers the whole registration but only the spans were
    granted (and are held): :attr:`spans`, :meth:`reaches`."""

    def __init__(self, view: memoryview, fd: int, scope: Scope | None = None) -> None:
        self.view = view
        self._fd = fd
        self._scope = scope

    @property
    def spans(self) -> list[tuple[int, int]] | None:
        """The ``(offset, nbytes)`` spans of :attr:`view` granted, ``None`` for all of it."""
        if self._scope is None:
            return None
        return [(a, b - a) for a, b in _scope.pairs(self._scope)]

    def reaches(self, offset: int, nbytes: int) -> bool:
        """Whether ``[offset, offset + nbytes)`` of :attr:`view` was granted."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.view.nbytes:
            return False
        return self._scope is None or _scope.covers(self._scope, offset, nbytes)

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Give the region back to its owner. Idempotent."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # the lock goes with the open

    def __enter__(self) -> Borrowed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()


class Claim:
    """The owner's exclusive hold on a region (:func:`claim`): nobody borrows it meanwhile."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self._at: tuple[int, int, int] | None = (fd, start, length) if length else None

    def release(self) -> None:
        """Let borrowers in again. Idempotent."""
        at, self._at = self._at, None
        if at is not None:
            with contextlib.suppress(OSError):  # the segment was closed meanwhile
                _lock(at[0], fcntl.F_UNLCK, at[1], at[2])

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def borrow(shm: ShmBuffers, desc: Descriptor) -> Borrowed | None:
    """Borrow the region ``desc`` names; ``None`` when it is not in one of its owner's
    segments or the owner holds a claim on it. Raises :class:`StaleDescriptorError` for a
    released region or one whose owner is gone."""
    pid, _, seg = shm._entry(desc, False)
    if not seg[0]:
        return None
    fd, key, start = seg[0] - 1, seg[1], seg[2]
    try:
        mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        shm._still_live(desc)  # a released region says so
        raise
    try:
        magic, seg_key, _, _ = _HEAD.unpack(os.pread(mine, _HEAD.size, 0))
        if magic != MAGIC or seg_key != key:  # the fd now names another file: released
            shm._still_live(desc)
            os.close(mine)
            return None
        # a scoped grant holds the bytes from its first span to its last
        lo, hi = (0, desc.length) if desc.scope is None else _scope.bounds(desc.scope)
        if hi > lo and not _lock(mine, fcntl.F_RDLCK, HEADER + start + lo, hi - lo):
            os.close(mine)  # the owner is changing it
            return None
        shm._still_live(desc)  # locked: a region still live now stays so while borrowed
        address = shm._mapped(pid, seg, 0, desc.length)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(mine)
        raise
    # a view of the kept read-only mapping (it stays mapped while the view lives, even once
    # the cache lets it go)
    mm, array = shm._segments[(pid, fd, key)]
    at = address - int(array.ctypes.data)
    return Borrowed(memoryview(mm)[at : at + desc.length].toreadonly(), mine, desc.scope)


def claim(region: Region) -> Claim | None:
    """The owner's exclusive hold on ``region`` before it changes it; ``None`` while anyone
    borrows it. A region not in a shared segment cannot be borrowed: its claim holds nothing."""
    from ._segments import pool  # (it imports the shm module)

    found = pool.find(_region_address(region), region.mem.nbytes) if region.mem.nbytes else None
    if found is None:
        return Claim(-1, 0, 0)
    segment, start = found
    if not _lock(segment.fd, fcntl.F_WRLCK, HEADER + start, region.mem.nbytes):
        return None
    return Claim(segment.fd, HEADER + start, region.mem.nbytes)


def borrowed(segment: Segment) -> bool:
    """Whether a peer borrows any of ``segment`` now."""
    whole = HEADER + segment.capacity
    if not _lock(segment.fd, fcntl.F_WRLCK, HEADER, whole - HEADER):
        return True
    _lock(segment.fd, fcntl.F_UNLCK, HEADER, whole - HEADER)
    return False


def _region_address(region: Region) -> int:
    from ._shm import address_of

    return address_of(region.mem)
