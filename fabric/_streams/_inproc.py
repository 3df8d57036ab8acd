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
import errno
import itertools

from ._flow import HIGH_WATER, Bytes, ProtocolFactory, StreamEnd

__all__ = ["DELIVERY_BUDGET", "HIGH_WATER", "InprocStreamTransport"]

DELIVERY_BUDGET = 1 << 20  # bytes handed to a protocol per loop callback, at most
SCHEME = "inproc://"

_names = itertools.count(1)
_listeners: dict[str, _InprocListener] = {}


def _name_of(url: str) -> str:
    if not url.startswith(SCHEME):
        raise ValueError(f"expected an address like inproc://NAME, got {url!r}")
    return url[len(SCHEME) :]


class _End(StreamEnd):
    """One end of an in-process connection; its queue holds bytes not yet in the peer's
    protocol."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        protocol: asyncio.BaseProtocol,
        sockname: str,
        peername: str,
    ) -> None:
        super().__init__(
            loop, protocol, {"sockname": sockname, "peername": peername, "socket": None}
        )
        self.peer: _End | None = None
        self._drops = 0  # bumped whenever the queue is dropped
        self._delivery_scheduled = False
        self._started = False
        self._eof_wanted = False  # write_eof or close: send EOF once the queue is empty
        self._eof_sent = False
        self._eof_in = False  # the peer sent EOF; tell our protocol when reading

    # -- asyncio.BaseTransport --------------------------------------------------------------
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
    def _reading_resumed(self) -> None:
        if self.peer is not None:
            self.peer._schedule_delivery()
        if self._eof_in and not self._eof_told:
            self._loop.call_soon(self._tell_eof_if_reading)

    # -- asyncio.WriteTransport -------------------------------------------------------------
    def write_eof(self) -> None:
        if self._eof_wanted:
            return
        self._eof_wanted = True
        self._schedule_delivery()

    def abort(self) -> None:
        if self._lost:
            return
        self._lose(None)
        peer = self.peer
        if peer is not None:
            peer._lose(ConnectionResetError(errno.ECONNRESET, "in-process peer aborted"))

    # -- internals ----------------------------------------------------------------------------
    def _take(self, data: Bytes) -> bool:
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

    def _kick(self) -> None:
        self._schedule_delivery()

    def _drop_queue(self) -> None:
        self._drops += 1
        self._discard_out()
        self._maybe_resume()

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
            self._advance(head, given)
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
        self._tell_eof()

    def _eof_failed(self, exc: BaseException) -> None:
        self._fatal(exc)

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
