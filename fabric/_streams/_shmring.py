"""The rings of a ``shm://`` connection and the doorbell that announces what is in them.

Each direction has a :class:`Ring`: a sealed memfd both processes map, positions in it being
absolute byte counts. :class:`RingEnd` is the part of a connection's end that copies written
bytes into its outgoing ring, reads the peer's records and keeps the peer informed.

The doorbell, and why it is correct. Ring positions are never read from shared memory. After each
batch of writes (the first write of an event-loop turn at once, the rest of the turn together at
its end) the writer sends a 24-byte record on the socket: ``(bytes written so far, bytes consumed
so far of the other ring, flags)``. The reader reads only up to positions announced that way, and
hands space back the same way (a credit) once it has consumed a quarter of the ring, or when the
writer may be short of space (more than half the ring outstanding). Because positions travel in
the socket, the kernel's socket locking orders them against the ring copies: the bytes a record
announces were stored before the ``send`` and are loaded after the ``recv``, on any CPU, without
fences, and a writer never reuses space before the reader's credit says it finished copying. There
is no "sleeping" flag to race on (the Dekker pattern, which x86 store-load reordering breaks),
hence no lost wakeup: every change a peer may wait on is a record, and an event loop waiting on
the socket wakes for it. The price is one small ``send`` per write batch and a rare credit.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import mmap
import os
import socket
import struct
from typing import Any

from ._flow import StreamEnd

__all__ = ["FIN", "MAX_RING", "RECORD", "RING_BYTES", "Ring", "RingEnd"]

RING_BYTES = 8 << 20
MAX_RING = 1 << 30
RECORD = struct.Struct("<QQQ")  # written to my ring, consumed of yours, flags
FIN = 1


class Ring:
    """One direction's shared memory, mapped here; positions are absolute byte counts."""

    def __init__(self, fd: int, capacity: int) -> None:
        self.capacity = capacity
        self.mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED)
        self.view = memoryview(self.mm)

    @staticmethod
    def create_fd(capacity: int, label: str) -> int:
        """A memfd of ``capacity`` bytes that can no longer shrink or grow (sealed)."""
        import fcntl  # here, not at the top: the module imports on every platform

        fd = os.memfd_create(
            f"orchestr-shmstream.{os.getpid()}.{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        )
        try:
            os.ftruncate(fd, capacity)
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def check_fd(fd: int, capacity: int) -> None:
        """Refuse a ring the peer could shrink under us (a SIGBUS here) or of the wrong size."""
        if not 4096 <= capacity <= MAX_RING:
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"bad shm ring size {capacity}")
        import fcntl

        fixed = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fixed != fixed:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "shm ring is not sealed")
        if os.fstat(fd).st_size != capacity:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "shm ring has the wrong size")

    def put(self, pos: int, data: memoryview) -> None:
        start = pos % self.capacity
        first = min(data.nbytes, self.capacity - start)
        self.view[start : start + first] = data[:first]
        if first < data.nbytes:
            self.view[: data.nbytes - first] = data[first:]

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):  # a view still alive: unmapped when it goes
            self.mm.close()


class RingEnd(StreamEnd):
    """The ring side of a shm:// end: positions, records both ways, teardown.

    A subclass hands announced bytes to the protocol (:meth:`_deliver`) and says what the socket
    ending means (:meth:`_socket_ended`)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        tx: Ring,
        rx: Ring,
        protocol: asyncio.BaseProtocol,
        extra: dict[str, Any],
    ) -> None:
        super().__init__(loop, protocol, {**extra, "socket": None})
        self._sock: socket.socket | None = sock
        self._fd = sock.fileno()
        self._tx, self._rx = tx, rx
        # outgoing ring positions (the queue holds bytes waiting for ring space)
        self._tx_head = 0  # written into the ring
        self._tx_announced = 0  # ... and told to the peer
        self._peer_tail = 0  # the peer's credit: it consumed this much
        # incoming ring positions
        self._rx_head = 0  # announced by the peer
        self._rx_tail = 0  # consumed here
        self._rx_credited = 0  # ... and told to the peer
        self._credit_due = False
        # the socket's control records
        self._ctl_in = bytearray()
        self._ctl_out = b""  # unsent rest of a record (the socket was full)
        self._ctl_dirty = False  # a record is owed once the socket drains
        self._send_broken = False
        self._peer_gone = False  # the socket ended
        self._fin_in = False
        self._fin_sent = False
        self._eof_wanted = False
        self._flush_scheduled = False
        self._deliver_scheduled = False

    def start(self) -> None:
        """Tell the protocol it is connected, then watch the socket for the peer's records."""
        try:
            self._protocol.connection_made(self)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._report("protocol.connection_made() failed", exc)
            self._lose(exc if isinstance(exc, Exception) else None)
            return
        if not self._lost:
            self._loop.add_reader(self._fd, self._on_readable)

    def _deliver(self) -> None:
        """The peer announced more bytes (or FIN): pass them on."""
        raise NotImplementedError

    def _socket_ended(self) -> None:
        """The peer's socket closed (with or without FIN)."""
        raise NotImplementedError

    # -- writing into the ring --------------------------------------------------------------
    def _push(self, view: memoryview) -> int:
        """Copy what fits of ``view`` into the ring; returns the bytes copied."""
        free = self._tx.capacity - (self._tx_head - self._peer_tail)
        n = min(free, view.nbytes)
        if n:
            with view[:n] as part:
                self._tx.put(self._tx_head, part)
            self._tx_head += n
        return n

    def _pump(self) -> None:
        """Move queued bytes into ring space the peer handed back."""
        while self._out:
            head = self._out[0]
            with memoryview(head) as whole, whole[self._offset :] as rest:
                n = self._push(rest)
            if not n:
                break
            self._advance(head, n)
        self._maybe_resume()

    # -- the doorbell -----------------------------------------------------------------------
    def _doorbell(self) -> None:
        """The first write batch of a loop turn is announced at once, the rest at its end."""
        if self._flush_scheduled:
            return
        self._send_state()
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and not self._lost:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._lost:
            self._send_state()

    def _send_state(self, force: bool = False) -> None:
        """Send a record if the peer has something to learn from one."""
        if self._lost or self._peer_gone or self._send_broken:
            return
        if self._eof_wanted and not self._fin_sent and not self._out:
            self._fin_sent = force = True
        if not (force or self._credit_due or self._tx_head != self._tx_announced):
            return
        if self._ctl_out:
            self._ctl_dirty = True  # the socket is full: send the newest state when it drains
            return
        record = RECORD.pack(self._tx_head, self._rx_tail, FIN if self._fin_sent else 0)
        self._tx_announced = self._tx_head
        self._rx_credited = self._rx_tail
        self._credit_due = False
        assert self._sock is not None
        try:
            sent = self._sock.send(record)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._send_failed()
            return
        if sent < len(record):
            self._ctl_out = record[sent:]
            self._loop.add_writer(self._fd, self._on_writable)
            return
        self._after_record()

    def _on_writable(self) -> None:
        assert self._sock is not None
        try:
            sent = self._sock.send(self._ctl_out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._send_failed()
            return
        self._ctl_out = self._ctl_out[sent:]
        if self._ctl_out:
            return
        self._loop.remove_writer(self._fd)
        if self._ctl_dirty:
            self._ctl_dirty = False
            self._send_state(force=True)
        else:
            self._after_record()

    def _after_record(self) -> None:
        if self._closing and self._fin_sent and not self._out:
            self._lose(None)  # everything was handed over; the peer reads the ring on its own

    def _send_failed(self) -> None:
        """The peer closed its socket: how it ended (FIN or not) is for the read side to say."""
        self._send_broken = True
        self._ctl_out = b""
        self._loop.remove_writer(self._fd)
        if self._closing:
            self._lose(None)

    # -- the peer's records -----------------------------------------------------------------
    def _on_readable(self) -> None:
        assert self._sock is not None
        try:
            data = self._sock.recv(64 * 1024)
        except (BlockingIOError, InterruptedError):
            return
        except (ConnectionResetError, BrokenPipeError):
            data = b""  # the peer closed with records of ours unread; what it sent came first
        except OSError as exc:
            self._fail(exc)
            return
        if not data:
            self._socket_ended()
            return
        # each record is the whole state: the newest one says it all
        if not self._ctl_in and len(data) == RECORD.size:
            head, tail, flags = RECORD.unpack(data)
        else:
            self._ctl_in += data
            count = len(self._ctl_in) // RECORD.size
            if not count:
                return
            head, tail, flags = RECORD.unpack_from(self._ctl_in, (count - 1) * RECORD.size)
            del self._ctl_in[: count * RECORD.size]
        if (
            head < self._rx_head
            or head - self._rx_tail > self._rx.capacity
            or not self._peer_tail <= tail <= self._tx_head
            or (self._fin_in and head != self._rx_head)
        ):
            self._fail(ConnectionResetError(errno.ECONNRESET, "shm peer sent an impossible state"))
            return
        self._rx_head = head
        if flags & FIN:
            self._fin_in = True
        if tail != self._peer_tail:
            self._peer_tail = tail
            if self._out:
                self._pump()
                self._schedule_flush()
        self._deliver()

    # -- teardown ---------------------------------------------------------------------------
    def _fail(self, exc: Exception | None) -> None:
        self._lose(exc)

    def _lose(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = self._closing = True
        self._discard_out()
        sock, self._sock = self._sock, None
        if sock is not None:
            self._loop.remove_reader(self._fd)
            self._loop.remove_writer(self._fd)
            sock.close()
        self._loop.call_soon(self._connection_lost, exc)

    def _connection_lost(self, exc: Exception | None) -> None:
        try:
            self._protocol.connection_lost(exc)
        finally:
            self._tx.close()
            self._rx.close()
