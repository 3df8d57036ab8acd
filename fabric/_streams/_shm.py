"""``shm://NAME``: a stream transport between processes on one host, payload through shared memory.

Setup. The listener binds the abstract Unix socket ``@orchestr-shm.NAME`` (nothing on disk; it
goes away with the process). A connecting process creates two sealed memfd rings, one per
direction (:data:`RING_BYTES` each), and passes them in its hello with ``SCM_RIGHTS``; the
listener checks the seals and sizes, maps both and answers. Each side checks with
``SO_PEERCRED`` that the other runs as the same user. The handshake and the accept loop are in
``_shmsetup``.

Data. A writer copies bytes into its outgoing ring and a reader copies them out into its protocol
(``get_buffer`` / ``buffer_updated`` for a :class:`asyncio.BufferedProtocol`, ``data_received``
otherwise): one copy each side, no payload through the socket. What does not fit in the ring
waits in the transport and counts towards its write buffer: ``pause_writing`` above the high
watermark (1 MiB), ``resume_writing`` at the low one.

The doorbell. Ring positions are never read from shared memory: after each batch of writes the
writer sends a small record on the socket announcing them, and the reader hands space back the
same way. The kernel's socket locking orders those records against the ring copies, so there is
no fence to forget and no wakeup to lose; ``_shmring`` has the rings, the records and the full
argument.

Ending. ``close`` hands over what is queued, sends a record with the FIN flag and closes the
socket; the peer delivers the rest of the ring, then ``eof_received`` and ``connection_lost(None)``.
``write_eof`` sends FIN and keeps reading. ``abort`` closes the socket with no FIN and drops what
is queued. A socket that ends without FIN (the peer aborted, crashed or was killed with SIGKILL:
the kernel closes its socket) is ``connection_lost(ConnectionResetError)`` at once, and what the
ring still held is dropped.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import secrets
import socket
import sys

from ._flow import Bytes, ProtocolFactory
from ._shmring import RING_BYTES, RingEnd
from ._shmsetup import ShmListener, dial

__all__ = ["RING_BYTES", "ShmStreamTransport"]

DELIVERY_BUDGET = 4 << 20  # bytes handed to the protocol per callback, at most
SCHEME = "shm://"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,80}")


def _name_of(url: str) -> str:
    if not url.startswith(SCHEME):
        raise ValueError(f"expected an address like shm://NAME, got {url!r}")
    name = url[len(SCHEME) :]
    if name not in ("", "0") and not _NAME.fullmatch(name):
        raise ValueError(f"shm:// names are 1-80 of [A-Za-z0-9._-], got {url!r}")
    return name


def _address(name: str) -> str:
    return f"\0orchestr-shm.{name}"


class _ShmEnd(RingEnd):
    """One end of a shm:// connection (see the module docstring)."""

    # -- asyncio.BaseTransport --------------------------------------------------------------
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
    def _reading_resumed(self) -> None:
        self._schedule_deliver()

    # -- asyncio.WriteTransport -------------------------------------------------------------
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
        super().write(data)

    def write_eof(self) -> None:
        if self._eof_wanted:
            return
        self._eof_wanted = True
        self._send_state()

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

    def _kick(self) -> None:
        self._doorbell()

    # -- reading ----------------------------------------------------------------------------
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

    def _eof_failed(self, exc: BaseException) -> None:
        self._report("Fatal error: protocol.eof_received() failed", exc)
        self._fail(exc if isinstance(exc, Exception) else None)

    def _can_half_close(self) -> bool:
        return not self._peer_gone  # with the socket gone, nothing more can be written

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
        self._discard_out()
        self._maybe_resume()
        if self._closing:
            self._lose(None)
        else:
            self._deliver()


class ShmStreamTransport:
    """The ``shm://`` backend (see the module docstring). Linux only."""

    @staticmethod
    def available() -> bool:
        return sys.platform == "linux" and hasattr(os, "memfd_create")

    async def listen(self, url: str, factory: ProtocolFactory) -> ShmListener:
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
        return ShmListener(SCHEME + name, sock, factory, _ShmEnd)

    async def connect(self, url: str, factory: ProtocolFactory) -> asyncio.BaseProtocol:
        name = _name_of(url)
        loop = asyncio.get_running_loop()
        sock, tx, rx, pid = await dial(loop, url, _address(name))
        protocol = factory()
        extra = {"sockname": f"{url}#{os.getpid()}", "peername": url, "peer_pid": pid}
        _ShmEnd(loop, sock, tx, rx, protocol, extra).start()
        return protocol
