"""Anonymous shared memory (memfd) that peers on this host open through ``/proc/PID/fd/FD``.

Nothing is named in ``/dev/shm``: the kernel frees a segment when its owner has closed it and the
last peer has unmapped it, so a process killed with SIGKILL leaves nothing behind. Segment names
(shown in ``/proc/PID/maps``) are ``orchestr.PID.N``. Every segment starts with a header page
holding a magic number and a random key; a peer checks both before it trusts the mapping, so a
forged ``(pid, fd)`` pointing at some other file of the owner is refused.
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
import struct

from orchestr.errors import DescriptorError, StaleDescriptorError

__all__ = ["HEADER", "Segment", "open_peer"]

HEADER = 4096
MAGIC = b"ORCHSEG1"
_HEAD = struct.Struct("<8sQQQ")  # magic, key, generation, capacity
_ids = itertools.count(1)
PREFIX = "orchestr."


class Segment:
    """A memfd of ``capacity`` bytes after the header page, mapped here read-write."""

    def __init__(self, capacity: int, *, populate: bool = False) -> None:
        self.capacity = capacity
        self.name = f"{PREFIX}{os.getpid()}.{next(_ids)}"
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, HEADER + capacity)
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            self.mm = mmap.mmap(self.fd, HEADER + capacity, flags=flags)
        except BaseException:
            os.close(self.fd)
            raise
        self.key = secrets.randbits(63) | 1
        self.generation = 0
        _HEAD.pack_into(self.mm, 0, MAGIC, self.key, 0, capacity)
        self.data = memoryview(self.mm)[HEADER:]

    def bump(self) -> int:
        """Start a new generation: descriptors of earlier ones become stale."""
        self.generation += 1
        _HEAD.pack_into(self.mm, 0, MAGIC, self.key, self.generation, self.capacity)
        return self.generation

    def close(self) -> None:
        """Unmap and close here; peers that still map it keep the memory until they unmap."""
        if self.fd < 0:
            return
        _HEAD.pack_into(self.mm, 0, MAGIC, 0, 0, 0)  # peers' later opens see a dead key
        self.data.release()
        try:
            self.mm.close()
        except BufferError:
            pass  # a local tensor still views it: the mapping goes when that tensor does
        os.close(self.fd)
        self.fd = -1


def open_peer(pid: int, fd: int, key: int, *, writable: bool = True) -> mmap.mmap:
    """Map the segment ``fd`` of process ``pid`` after checking it is an orchestr segment that
    process made, with ``key``. Raises StaleDescriptorError when it is gone, DescriptorError
    when it is not such a segment."""
    if not (type(pid) is int and type(fd) is int and pid > 0 and fd >= 0):
        raise DescriptorError(f"malformed segment location: process {pid!r}, fd {fd!r}")
    path = f"/proc/{pid}/fd/{fd}"
    try:
        target = os.readlink(path)
    except OSError:
        raise StaleDescriptorError(
            f"shared memory of process {pid} (fd {fd}) is gone: released, or the process exited"
        ) from None
    if not target.startswith(f"/memfd:{PREFIX}{pid}."):
        raise DescriptorError(
            f"fd {fd} of process {pid} is not an orchestr segment that process made ({target})"
        )
    try:
        peer_fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except OSError as exc:
        raise StaleDescriptorError(f"cannot open shared memory of process {pid}: {exc}") from exc
    try:
        size = os.fstat(peer_fd).st_size
        if size < HEADER:
            raise DescriptorError(f"segment {target} of process {pid} is too small")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(peer_fd, size, flags=mmap.MAP_SHARED, prot=prot)
    finally:
        os.close(peer_fd)
    magic, seg_key, _, capacity = _HEAD.unpack_from(mm, 0)
    if magic != MAGIC or seg_key != key or HEADER + capacity > size:
        mm.close()
        raise StaleDescriptorError(
            f"segment {target} of process {pid} does not carry the descriptor's key "
            f"(released and reused, or a forged descriptor)"
        )
    return mm


def generation_of(mm: mmap.mmap) -> tuple[int, int]:
    """``(key, generation)`` as the owner last wrote them."""
    _, key, generation, _ = _HEAD.unpack_from(mm, 0)
    return key, generation
