"""``inproc://NAME``: a stream transport whose two ends live in one process and one event loop.

No socket and no thread: each end keeps what its protocol wrote in a queue and a callback
scheduled with ``loop.call_soon`` hands it to the peer's protocol, through ``get_buffer`` /
``buffer_updated`` for a :class:`asyncio.BufferedProtocol` and ``data_received`` otherwise, at
most :data:`DELIVERY_BUDGET` bytes per callback so one connection cannot starve the loop.

Flow control is real. Bytes count against the writer until they reach the reader's protocol; a
reader that called ``pause_reading`` (or is slower than the writer) leaves them queued, and the
writer's protocol gets ``pause_writing`` once the queue is over the high watermark (1 MiB by
default) and ``resume_writing`` when delivery takes it to the low watermark or below.

Closing follows TCP: ``close`` stops reading, delivers what was written, then the peer's protocol
sees ``eof_received`` and, unless that returns true (half-close), ``connection_lost(None)``.
``abort`` drops what is queued both ways; both protocols see ``connection_lost`` at once, the
peer's with :class:`ConnectionResetError`. Connecting to a name nobody listens on raises
:class:`ConnectionRefusedError`, as TCP does.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import itertools
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["DELIVERY_BUDGET", "HIGH_WATER", "InprocStreamTransport"]

HIGH_WATER = 1 << 20
DELIVERY_BUDGET = 1 << 20  # bytes handed to a protocol per loop callback, at most
SCHEME = "inproc://"

ProtocolFactory = Callable[[], asyncio.BaseProtocol]
Bytes = bytes | bytearray | memoryview

_names = itertools.count(1)
_listeners: dict[str, _InprocListener] = {}


def _name_of(url: str) -> str:
    if not url.startswith(SCHEME):
        raise ValueError(f"expected an address like inproc://NAME, got {url!r}")
    return url[len(SCHEME) :]


class _End(asyncio.Transport):
    """One end of an in-process connection."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        protocol: asyncio.BaseProtocol,
        sockname: str,
        peername: str,
    ) -> None:
        super().__init__({"sockname": sockname, "peername": peername, "socket": None})
        self._loop = loop
        self._protocol = protocol
        self._buffered = isinstance(protocol, asyncio.BufferedProtocol)
        self.peer: _End | None = None
        # outgoing bytes not yet in the peer's protocol: the head chunk starts at _offset
        self._out: collections.deque[bytes] = collections.deque()
        self._offset = 0
        self._out_size = 0
        self._drops = 0  # bumped whenever the queue is dropped
        self._high = HIGH_WATER
        self._low = HIGH_WATER // 4
        self._writing_paused = False
        self._reading_paused = False
        self._delivery_scheduled = False
        self._started = False
        self._eof_wanted = False  # write_eof or close: send EOF once the queue is empty
        self._eof_sent = False
        self._eof_in = False  # the peer sent EOF; tell our protocol when reading
        self._eof_told = False
        self._closing = False
        self._lost = False

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
        self._reading_paused = False
        peer = self.peer
        if peer is not None and peer._out_size:
            # Like a socket closed with unread data: what the peer still had queued for us
            # is dropped, and the peer's writer is not left paused waiting for it.
            peer._drop_queue()
        self._schedule_delivery()

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
        if self.peer is not None:
            self.peer._schedule_delivery()
        if self._eof_in and not self._eof_told:
            self._loop.call_soon(self._tell_eof_if_reading)

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
        if self._queue(data):
            self._maybe_pause()
            self._schedule_delivery()

    def writelines(self, list_of_data: Iterable[Bytes]) -> None:
        queued = False
        for data in list_of_data:
            queued = self._queue(data) or queued
        if queued:
            self._maybe_pause()
            self._schedule_delivery()

    def write_eof(self) -> None:
        if self._eof_wanted:
            return
        self._eof_wanted = True
        self._schedule_delivery()

    def can_write_eof(self) -> bool:
        return True

    def abort(self) -> None:
        if self._lost:
            return
        self._lose(None)
        peer = self.peer
        if peer is not None:
            peer._lose(ConnectionResetError(errno.ECONNRESET, "in-process peer aborted"))

    # -- internals ----------------------------------------------------------------------------
    def _queue(self, data: Bytes) -> bool:
        if self._eof_wanted and not self._closing:
            raise RuntimeError("Cannot call write() after write_eof()")
        # After close() or loss, writes are dropped, as asyncio's socket transports do.
        if self._closing or not data:
            return False
        chunk = data if type(data) is bytes else bytes(data)  # the caller may reuse its buffer
        if not chunk:
            return False
        self._out.append(chunk)
        self._out_size += len(chunk)
        return True

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

    def _drop_queue(self) -> None:
        self._drops += 1
        self._out.clear()
        self._offset = 0
        self._out_size = 0
        self._maybe_resume()

    def _report(self, message: str, exc: BaseException) -> None:
        self._loop.call_exception_handler(
            {"message": message, "exception": exc, "transport": self, "protocol": self._protocol}
        )

    def _start(self) -> None:
        self._started = True
        self._protocol.connection_made(self)

    def _schedule_delivery(self) -> None:
        if self._delivery_scheduled or self._lost or not self._started:
            return
        if not (self._out_size or (self._eof_wanted and not self._eof_sent) or self._closing):
            return
        self._delivery_scheduled = True
        self._loop.call_soon(self._deliver)

    def _deliver(self) -> None:
        """Move queued bytes (then EOF) into the peer's protocol while it reads."""
        self._delivery_scheduled = False
        peer = self.peer
        if self._lost or peer is None:
            return
        if peer._closing or peer._lost:
            self._drop_queue()  # nobody reads at the other end any more
        budget = DELIVERY_BUDGET
        while self._out and budget > 0 and peer.is_reading():
            head = self._out[0]
            drops = self._drops
            try:
                given = peer._receive(head, self._offset, budget)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                peer._fatal(exc)
                return
            if self._drops != drops:
                break  # the reader closed or aborted from inside its callback
            budget -= given
            self._offset += given
            self._out_size -= given
            if self._offset == len(head):
                self._out.popleft()
                self._offset = 0
        self._maybe_resume()
        if self._lost:
            return
        if self._out:
            if peer.is_reading():
                self._delivery_scheduled = True
                self._loop.call_soon(self._deliver)
            return  # else the peer's resume_reading reschedules us
        if self._closing:
            self._lose(None)  # everything written was delivered
        if self._eof_wanted and not self._eof_sent:
            self._eof_sent = True
            peer._peer_eof()

    def _receive(self, chunk: bytes, offset: int, budget: int) -> int:
        """Hand our protocol up to ``budget`` bytes of ``chunk`` from ``offset``; returns how
        many it took."""
        protocol = self._protocol
        want = min(len(chunk) - offset, budget)
        if not self._buffered:
            data = chunk if offset == 0 and want == len(chunk) else chunk[offset : offset + want]
            protocol.data_received(data)  # type: ignore[attr-defined]
            return want
        buffered: asyncio.BufferedProtocol = protocol  # type: ignore[assignment]
        with memoryview(buffered.get_buffer(want)) as view, view.cast("B") as target:
            n = min(target.nbytes, want)
            if n == 0:
                raise RuntimeError("get_buffer() returned an empty buffer")
            target[:n] = memoryview(chunk)[offset : offset + n]
        buffered.buffer_updated(n)
        return n

    def _peer_eof(self) -> None:
        """The peer wrote its last byte; our protocol hears of it when it reads (now, or at
        ``resume_reading``)."""
        self._eof_in = True
        self._tell_eof_if_reading()

    def _tell_eof_if_reading(self) -> None:
        if self._eof_told or self._lost or not self.is_reading():
            return
        self._eof_told = True
        keep_open: Any = None
        eof_received = getattr(self._protocol, "eof_received", None)
        if eof_received is not None:
            try:
                keep_open = eof_received()
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._fatal(exc)
                return
        if not keep_open:
            self.close()

    def _fatal(self, exc: BaseException) -> None:
        """Our protocol raised while taking data: report, then tear the connection down."""
        self._report("Fatal error: protocol failed on in-process data", exc)
        self._lose(exc if isinstance(exc, Exception) else None)
        peer = self.peer
        if peer is not None:
            peer._lose(ConnectionResetError(errno.ECONNRESET, "in-process peer failed"))

    def _lose(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        self._closing = True
        self._drop_queue()  # no resume_writing: _lost is set
        if self._started:
            self._loop.call_soon(self._protocol.connection_lost, exc)


class _InprocListener:
    def __init__(self, name: str, factory: ProtocolFactory) -> None:
        self.name = name
        self.factory = factory
        self.loop = asyncio.get_running_loop()
        self.closed = False

    @property
    def url(self) -> str:
        return SCHEME + self.name

    async def aclose(self) -> None:
        """Stop accepting; connections already made stay up."""
        if self.closed:
            return
        self.closed = True
        if _listeners.get(self.name) is self:
            del _listeners[self.name]


class InprocStreamTransport:
    """The ``inproc://`` backend (see the module docstring)."""

    async def listen(self, url: str, factory: ProtocolFactory) -> _InprocListener:
        name = _name_of(url)
        if name in ("", "0"):
            name = f"auto-{next(_names)}"
            while name in _listeners:
                name = f"auto-{next(_names)}"
        if name in _listeners:
            raise OSError(errno.EADDRINUSE, f"{SCHEME}{name} is already listened on")
        listener = _InprocListener(name, factory)
        _listeners[name] = listener
        return listener

    async def connect(self, url: str, factory: ProtocolFactory) -> asyncio.BaseProtocol:
        name = _name_of(url)
        loop = asyncio.get_running_loop()
        listener = _listeners.get(name)
        if listener is None:
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"nothing listens on {url}")
        if listener.loop is not loop:
            raise ConnectionRefusedError(
                errno.ECONNREFUSED, f"{url} listens on another event loop; inproc:// needs one"
            )
        client_proto = factory()
        server_proto = listener.factory()
        client = _End(loop, client_proto, sockname=f"{SCHEME}{name}#client", peername=url)
        server = _End(loop, server_proto, sockname=url, peername=f"{SCHEME}{name}#client")
        client.peer, server.peer = server, client
        made: asyncio.Future[None] = loop.create_future()

        def start() -> None:
            # Both protocols see connection_made before either end delivers anything.
            try:
                server._start()
                client._start()
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                server.abort()
                if not made.done():
                    made.set_exception(
                        ConnectionResetError(errno.ECONNRESET, f"connection_made failed: {exc!r}")
                    )
                return
            server._schedule_delivery()
            client._schedule_delivery()
            if not made.done():
                made.set_result(None)

        loop.call_soon(start)
        await made
        return client_proto
