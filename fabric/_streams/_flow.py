"""What the in-host stream transports (``inproc://``, ``shm://``) share.

:class:`StreamEnd` is one end of a connection as an :class:`asyncio.Transport` whose outgoing
bytes wait in a queue of chunks until they can move. It keeps the protocol and its kind, the
read-pausing state and the write side's flow control: queued bytes count against the writer, whose
protocol gets ``pause_writing`` once they are over the high watermark (:data:`HIGH_WATER` by
default) and ``resume_writing`` once they are at the low one or below; an exception from either
goes to the loop's exception handler.

It also hands the peer's EOF to the protocol (``eof_received``), closing unless the protocol
keeps the connection half-open. A subclass says how written bytes are taken
(:meth:`StreamEnd._take`), how they start moving (:meth:`StreamEnd._kick`), what resuming
reading sets going (:meth:`StreamEnd._reading_resumed`) and what a failing ``eof_received``
tears down (:meth:`StreamEnd._eof_failed`), and provides ``close``, ``abort`` and
``write_eof``.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["HIGH_WATER", "Bytes", "ProtocolFactory", "StreamEnd"]

HIGH_WATER = 1 << 20

ProtocolFactory = Callable[[], asyncio.BaseProtocol]
Bytes = bytes | bytearray | memoryview


class StreamEnd(asyncio.Transport):
    """One end of an in-host connection: protocol bookkeeping and flow control."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        protocol: asyncio.BaseProtocol,
        extra: dict[str, Any],
    ) -> None:
        super().__init__(extra)
        self._loop = loop
        self._protocol = protocol
        self._buffered = isinstance(protocol, asyncio.BufferedProtocol)
        # outgoing bytes that have not moved yet: the head chunk starts at _offset
        self._out: collections.deque[bytes] = collections.deque()
        self._offset = 0
        self._out_size = 0
        self._high = HIGH_WATER
        self._low = HIGH_WATER // 4
        self._writing_paused = False
        self._reading_paused = False
        self._eof_told = False  # the protocol heard of the peer's EOF
        self._closing = False
        self._lost = False

    # -- what a subclass provides -----------------------------------------------------------
    def _take(self, data: Bytes) -> bool:
        """Accept written bytes; returns whether any were queued or moved."""
        raise NotImplementedError

    def _kick(self) -> None:
        """Get bytes just taken on their way to the peer."""
        raise NotImplementedError

    def _reading_resumed(self) -> None:
        """Reading was paused and now resumes: deliver what waited."""
        raise NotImplementedError

    def _eof_failed(self, exc: BaseException) -> None:
        """The protocol's ``eof_received`` raised ``exc``: report it and tear down."""
        raise NotImplementedError

    def _can_half_close(self) -> bool:
        """Whether the connection may stay open for writing after the peer's EOF."""
        return True

    # -- asyncio.BaseTransport --------------------------------------------------------------
    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol
        self._buffered = isinstance(protocol, asyncio.BufferedProtocol)

    def is_closing(self) -> bool:
        return self._closing

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
        self._reading_resumed()

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
        if self._take(data):
            self._maybe_pause()
            self._kick()

    def writelines(self, list_of_data: Iterable[Bytes]) -> None:
        took = False
        for data in list_of_data:
            took = self._take(data) or took
        if took:
            self._maybe_pause()
            self._kick()

    def can_write_eof(self) -> bool:
        return True

    # -- the peer's EOF ---------------------------------------------------------------------
    def _tell_eof(self) -> None:
        """Hand the peer's EOF to the protocol; close unless it keeps the connection half-open."""
        self._eof_told = True
        keep_open: Any = None
        eof_received = getattr(self._protocol, "eof_received", None)
        if eof_received is not None:
            try:
                keep_open = eof_received()
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._eof_failed(exc)
                return
        if not self._can_half_close() or not keep_open:
            self.close()

    # -- the outgoing queue -----------------------------------------------------------------
    def _advance(self, head: bytes, n: int) -> None:
        """``n`` more bytes of ``head``, the queue's first chunk, have moved."""
        self._offset += n
        self._out_size -= n
        if self._offset == len(head):
            self._out.popleft()
            self._offset = 0

    def _discard_out(self) -> None:
        """Forget everything queued (no resume_writing: the caller decides)."""
        self._out.clear()
        self._offset = 0
        self._out_size = 0

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

    def _report(self, message: str, exc: BaseException) -> None:
        self._loop.call_exception_handler(
            {"message": message, "exception": exc, "transport": self, "protocol": self._protocol}
        )
