"""``shm://NAME``: a stream transport between processes on one host, payload through shared memory.

Setup. The listener binds the abstract Unix socket ``@orchestr-shm.NAME`` (nothing on disk; it
goes away with the process). A connecting process creates two sealed memfd rings, one per
direction (:data:`RING_BYTES` each), and passes them in its hello with ``SCM_RIGHTS``; the
listener checks the seals and sizes, maps both and answers. Each side checks with
``SO_PEERCRED`` that the other runs as the same user.

Data. A writer copies bytes into its outgoing ring and a reader copies them out into its protocol
(``get_buffer`` / ``buffer_updated`` for a :class:`asyncio.BufferedProtocol`, ``data_received``
otherwise): one copy each side, no payload through the socket. What does not fit in the ring
waits in the transport and counts towards its write buffer: ``pause_writing`` above the high
watermark (1 MiB), ``resume_writing`` at the low one.

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

Ending. ``close`` hands over what is queued, sends a record with the FIN flag and closes the
socket; the peer delivers the rest of the ring, then ``eof_received`` and ``connection_lost(None)``.
``write_eof`` sends FIN and keeps reading. ``abort`` closes the socket with no FIN and drops what
is queued. A socket that ends without FIN (the peer aborted, crashed or was killed with SIGKILL:
the kernel closes its socket) is ``connection_lost(ConnectionResetError)`` at once, and what the
ring still held is dropped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import mmap
import os
import re
import secrets
import socket
import struct
import sys
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["RING_BYTES", "ShmStreamTransport"]

RING_BYTES = 8 << 20
HIGH_WATER = 1 << 20
DELIVERY_BUDGET = 4 << 20  # bytes handed to the protocol per callback, at most
MAX_RING = 1 << 30
HANDSHAKE_TIMEOUT = 10.0
SCHEME = "shm://"
MAGIC = b"ORCSHMS1"
HELLO = struct.Struct("<8sQQ")  # magic, capacity of the client->server ring, of server->client
ACK = struct.Struct("<8sQ")  # magic, server pid
RECORD = struct.Struct("<QQQ")  # written to my ring, consumed of yours, flags
FIN = 1
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_NAME = re.compile(r"[A-Za-z0-9._-]{1,80}")

ProtocolFactory = Callable[[], asyncio.BaseProtocol]
Bytes = bytes | bytearray | memoryview


def _name_of(url: str) -> str:
    if not url.startswith(SCHEME):
        raise ValueError(f"expected an address like shm://NAME, got {url!r}")
    name = url[len(SCHEME) :]
    if name not in ("", "0") and not _NAME.fullmatch(name):
        raise ValueError(f"shm:// names are 1-80 of [A-Za-z0-9._-], got {url!r}")
    return name


def _address(name: str) -> str:
    return f"\0orchestr-shm.{name}"


def _peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end; refuses another user."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    if uid != os.getuid():
        raise PermissionError(f"shm:// peer (pid {pid}) runs as uid {uid}, not {os.getuid()}")
    return pid, uid


class _Ring:
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


class _ShmEnd(asyncio.Transport):
    """One end of a shm:// connection (see the module docstring)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        tx: _Ring,
        rx: _Ring,
        protocol: asyncio.BaseProtocol,
        extra: dict[str, Any],
    ) -> None:
        super().__init__({**extra, "socket": None})
        self._loop = loop
        self._sock: socket.socket | None = sock
        self._fd = sock.fileno()
        self._tx, self._rx = tx, rx
        self._protocol = protocol
        self._buffered = isinstance(protocol, asyncio.BufferedProtocol)
        # outgoing: bytes waiting for ring space (the head chunk from _offset), ring positions
        self._out: collections.deque[bytes] = collections.deque()
        self._offset = 0
        self._out_size = 0
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
        self._eof_told = False
        self._closing = False
        self._lost = False
        self._reading_paused = False
        self._writing_paused = False
        self._flush_scheduled = False
        self._deliver_scheduled = False
        self._high = HIGH_WATER
        self._low = HIGH_WATER // 4

    def _start(self) -> None:
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

    # -- asyncio.BaseTransport --------------------------------------------------------------
    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol
        self._buffered = isinstance(protocol, asyncio.BufferedProtocol)

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._eof_wanted = True
        self._discard_incoming()
        if self._peer_gone:
            self._lose(None)
        else:
            self._send_state()

    def abort(self) -> None:
        self._lose(None)

    # -- asyncio.ReadTransport --------------------------------------------------------------
    def is_reading(self) -> bool:
        return not (self._reading_paused or self._closing)

    def pause_reading(self) -> None:
        if self._closing or self._reading_paused:
            return
        self._reading_paused = True

    def resume_reading(self) -> None:
        if self._closing or not self._reading_paused:
            return
        self._reading_paused = False
        self._schedule_deliver()

    # -- asyncio.WriteTransport -------------------------------------------------------------
    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = HIGH_WATER if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low
        self._maybe_pause()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def get_write_buffer_size(self) -> int:
        return self._out_size

    def write(self, data: Bytes) -> None:
        if type(data) is bytes and not (self._out or self._closing or self._eof_wanted):
            # the common case, kept short: bytes that fit before the ring wraps
            n = len(data)
            start = self._tx_head % self._tx.capacity
            free = self._tx.capacity - (self._tx_head - self._peer_tail)
            if 0 < n <= free and start + n <= self._tx.capacity and not self._peer_gone:
                self._tx.mm[start : start + n] = data
                self._tx_head += n
                self._doorbell()
                return
        if self._take(data):
            self._maybe_pause()
            self._doorbell()

    def writelines(self, list_of_data: Iterable[Bytes]) -> None:
        took = False
        for data in list_of_data:
            took = self._take(data) or took
        if took:
            self._maybe_pause()
            self._doorbell()

    def write_eof(self) -> None:
        if self._eof_wanted:
            return
        self._eof_wanted = True
        self._send_state()

    def can_write_eof(self) -> bool:
        return True

    # -- writing ----------------------------------------------------------------------------
    def _take(self, data: Bytes) -> bool:
        if self._eof_wanted and not self._closing:
            raise RuntimeError("Cannot call write() after write_eof()")
        if self._closing or self._peer_gone or not data:
            return False  # after close() or loss writes are dropped, as asyncio's are
        with memoryview(data) as raw:
            view = raw.cast("B") if raw.c_contiguous else memoryview(raw.tobytes())
            with view:
                if not view.nbytes:
                    return False
                queued = bool(self._out)
                n = 0 if queued else self._push(view)
                if n == view.nbytes:
                    return True
                if type(data) is bytes:
                    self._out.append(data)  # immutable: queued as is, from offset n
                    if not queued:
                        self._offset = n
                else:
                    self._out.append(view[n:].tobytes())  # the caller may reuse its buffer
                self._out_size += view.nbytes - n
        return True

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
            self._offset += n
            self._out_size -= n
            if self._offset == len(head):
                self._out.popleft()
                self._offset = 0
        self._maybe_resume()

    def _maybe_pause(self) -> None:
        if self._writing_paused or self._out_size <= self._high or self._lost:
            return
        self._writing_paused = True
        try:
            self._protocol.pause_writing()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._report("protocol.pause_writing() failed", exc)

    def _maybe_resume(self) -> None:
        if not self._writing_paused or self._out_size > self._low or self._lost:
            return
        self._writing_paused = False
        try:
            self._protocol.resume_writing()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._report("protocol.resume_writing() failed", exc)

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

    # -- reading ----------------------------------------------------------------------------
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

    def _schedule_deliver(self) -> None:
        if not self._deliver_scheduled and not self._lost:
            self._deliver_scheduled = True
            self._loop.call_soon(self._deliver_later)

    def _deliver_later(self) -> None:
        self._deliver_scheduled = False
        self._deliver()

    def _discard_incoming(self) -> None:
        if self._rx_tail != self._rx_head:
            self._rx_tail = self._rx_head
            self._credit_due = True
            self._schedule_flush()

    def _deliver(self) -> None:
        """Hand announced ring bytes to the protocol while it reads, then EOF if it came."""
        if self._lost:
            return
        if self._closing:
            self._discard_incoming()
            return
        budget = DELIVERY_BUDGET
        while self._rx_tail < self._rx_head and budget > 0 and self.is_reading():
            try:
                budget -= self._receive(min(self._rx_head - self._rx_tail, budget))
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._report("Fatal error: protocol failed on shm:// data", exc)
                self._fail(exc if isinstance(exc, Exception) else None)
                return
            if self._lost:
                return
        if self._closing:
            self._discard_incoming()
            return
        owed = self._rx_tail - self._rx_credited
        cap = self._rx.capacity
        if owed and (owed >= cap // 4 or self._rx_head - self._rx_credited > cap // 2):
            self._credit_due = True  # a quarter consumed, or the writer may be short of space
            self._schedule_flush()
        if self._rx_tail < self._rx_head:
            if self.is_reading():
                self._schedule_deliver()
            return  # else resume_reading schedules the rest
        if self._fin_in and not self._eof_told and self.is_reading():
            self._tell_eof()
        elif self._peer_gone and self._fin_in and self._eof_told:
            self._lose(None)

    def _receive(self, limit: int) -> int:
        """Copy one piece (up to the ring's wrap) into the protocol; returns its size."""
        ring = self._rx
        pos = self._rx_tail % ring.capacity
        n = min(limit, ring.capacity - pos)
        protocol = self._protocol
        if not self._buffered:
            data = ring.mm[pos : pos + n]
            self._rx_tail += n
            protocol.data_received(data)  # type: ignore[attr-defined]
            return n
        buffered: asyncio.BufferedProtocol = protocol  # type: ignore[assignment]
        with memoryview(buffered.get_buffer(n)) as space, space.cast("B") as target:
            n = min(n, target.nbytes)
            if not n:
                raise RuntimeError("get_buffer() returned an empty buffer")
            with ring.view[pos : pos + n] as piece:
                target[:n] = piece
        self._rx_tail += n
        buffered.buffer_updated(n)
        return n

    def _tell_eof(self) -> None:
        self._eof_told = True
        keep_open: Any = None
        eof_received = getattr(self._protocol, "eof_received", None)
        if eof_received is not None:
            try:
                keep_open = eof_received()
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._report("Fatal error: protocol.eof_received() failed", exc)
                self._fail(exc if isinstance(exc, Exception) else None)
                return
        if self._peer_gone or not keep_open:
            self.close()

    def _socket_ended(self) -> None:
        self._peer_gone = True
        self._loop.remove_reader(self._fd)
        if self._ctl_out:
            self._ctl_out = b""
            self._loop.remove_writer(self._fd)
        if self._lost:
            return
        if not self._fin_in:
            self._lose(
                ConnectionResetError(
                    errno.ECONNRESET, "the shm:// peer went away without closing (aborted or died)"
                )
            )
            return
        # A clean end: nobody reads what we still had queued; the ring's rest is still ours.
        self._out.clear()
        self._offset = self._out_size = 0
        self._maybe_resume()
        if self._closing:
            self._lose(None)
        else:
            self._deliver()

    # -- teardown ---------------------------------------------------------------------------
    def _report(self, message: str, exc: BaseException) -> None:
        self._loop.call_exception_handler(
            {"message": message, "exception": exc, "transport": self, "protocol": self._protocol}
        )

    def _fail(self, exc: Exception | None) -> None:
        self._lose(exc)

    def _lose(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = self._closing = True
        self._out.clear()
        self._offset = self._out_size = 0
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


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(sock.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_writer(sock.fileno())


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        more = await loop.sock_recv(sock, n - len(got))
        if not more:
            break
        got += more
    return got


class _ShmListener:
    def __init__(self, name: str, sock: socket.socket, factory: ProtocolFactory) -> None:
        self._name = name
        self._sock = sock
        self._factory = factory
        self._loop = asyncio.get_running_loop()
        self._handshakes: set[asyncio.Task[None]] = set()
        self._serving = self._loop.create_task(self._serve())

    @property
    def url(self) -> str:
        return SCHEME + self._name

    async def aclose(self) -> None:
        """Stop accepting; connections already made stay up."""
        if self._sock.fileno() < 0:
            return
        tasks = [self._serving, *self._handshakes]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._sock.close()

    async def _serve(self) -> None:
        while True:
            try:
                conn, _ = await self._loop.sock_accept(self._sock)
            except OSError as exc:  # out of descriptors and the like: keep listening
                self._loop.call_exception_handler(
                    {"message": f"shm:// accept failed on {self.url}", "exception": exc}
                )
                await asyncio.sleep(0.1)
                continue
            task = self._loop.create_task(self._handshake(conn))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        fds: list[int] = []
        rings: list[_Ring] = []
        try:
            pid, _ = _peer_credentials(conn)
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                while True:
                    try:
                        msg, fds, _, _ = socket.recv_fds(
                            conn, HELLO.size, 2, socket.MSG_CMSG_CLOEXEC
                        )
                        break
                    except (BlockingIOError, InterruptedError):
                        await _readable(self._loop, conn)
            if len(msg) != HELLO.size or len(fds) != 2:
                raise ConnectionRefusedError(errno.ECONNREFUSED, "not an shm:// hello")
            magic, to_us, to_them = HELLO.unpack(msg)
            if magic != MAGIC:
                raise ConnectionRefusedError(errno.ECONNREFUSED, "not an shm:// hello")
            _Ring.check_fd(fds[0], to_us)
            _Ring.check_fd(fds[1], to_them)
            rings = [_Ring(fds[0], to_us), _Ring(fds[1], to_them)]
            conn.send(ACK.pack(MAGIC, os.getpid()))  # the first bytes on the socket: they fit
        except BaseException as exc:
            conn.close()
            for ring in rings:
                ring.close()
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            for fd in fds:
                os.close(fd)
        try:
            protocol = self._factory()
        except Exception as exc:
            self._loop.call_exception_handler(
                {"message": f"shm:// protocol factory failed on {self.url}", "exception": exc}
            )
            conn.close()
            for ring in rings:
                ring.close()
            return
        end = _ShmEnd(
            self._loop,
            conn,
            tx=rings[1],
            rx=rings[0],
            protocol=protocol,
            extra={"sockname": self.url, "peername": f"{self.url}#{pid}", "peer_pid": pid},
        )
        end._start()


class ShmStreamTransport:
    """The ``shm://`` backend (see the module docstring). Linux only."""

    @staticmethod
    def available() -> bool:
        return sys.platform == "linux" and hasattr(os, "memfd_create")

    async def listen(self, url: str, factory: ProtocolFactory) -> _ShmListener:
        name = _name_of(url)
        if name in ("", "0"):
            name = f"{os.getpid()}.{secrets.token_hex(6)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                sock.bind(_address(name))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise OSError(
                        errno.EADDRINUSE, f"{SCHEME}{name} is already listened on"
                    ) from None
                raise
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return _ShmListener(name, sock, factory)

    async def connect(self, url: str, factory: ProtocolFactory) -> asyncio.BaseProtocol:
        name = _name_of(url)
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        rings: list[_Ring] = []
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                try:
                    await loop.sock_connect(sock, _address(name))
                except (ConnectionRefusedError, FileNotFoundError):
                    raise ConnectionRefusedError(
                        errno.ECONNREFUSED, f"nothing listens on {url}"
                    ) from None
                pid, _ = _peer_credentials(sock)
                fds = [_Ring.create_fd(RING_BYTES, "up"), _Ring.create_fd(RING_BYTES, "down")]
                try:
                    rings = [_Ring(fds[0], RING_BYTES), _Ring(fds[1], RING_BYTES)]
                    hello = HELLO.pack(MAGIC, RING_BYTES, RING_BYTES)
                    while True:
                        try:
                            socket.send_fds(sock, [hello], fds)
                            break
                        except (BlockingIOError, InterruptedError):
                            await _writable(loop, sock)
                finally:
                    for fd in fds:
                        os.close(fd)
                ack = await _recv_exact(loop, sock, ACK.size)
            if len(ack) != ACK.size or ack[: len(MAGIC)] != MAGIC:
                raise ConnectionRefusedError(errno.ECONNREFUSED, f"{url} refused the connection")
        except BaseException:
            sock.close()
            for ring in rings:
                ring.close()
            raise
        protocol = factory()
        end = _ShmEnd(
            loop,
            sock,
            tx=rings[0],
            rx=rings[1],
            protocol=protocol,
            extra={"sockname": f"{url}#{os.getpid()}", "peername": url, "peer_pid": pid},
        )
        end._start()
        return protocol
