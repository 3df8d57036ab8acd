"""Sans-IO framing for the call path.

A frame is ``u32 msg_len | u64 extra_len | msg | extra``: ``msg`` is one msgpack value and
``extra`` holds the out-of-band buffers (tensor and array bytes) that ``msg`` points into by
offset. Buffers start on 16-byte boundaries of ``extra`` so typed views are aligned.

:class:`FrameDecoder` works with ``asyncio.BufferedProtocol``: the transport reads straight into
the memory :meth:`FrameDecoder.get_buffer` hands out. A frame that carries buffers gets memory of
its own, so the kernel writes the bulk bytes where the decoded tensors will live: no copy after
the socket read.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from orchestr.errors import ProtocolError

__all__ = ["ALIGN", "HEADER", "SCRATCH", "FrameDecoder", "encode_frame", "padded"]

HEADER = struct.Struct("<IQ")
#: Top bit of ``extra_len``: the buffers are only copied out while decoding (large ``bytes``),
#: so the frame may be parsed in the shared receive buffer like one without buffers.
SCRATCH = 1 << 63
ALIGN = 16
_JOIN_BELOW = 4096  # smaller messages are joined to their header: one piece beats a copy
_MIN_READ = 64 * 1024  # free space offered to each socket read, at least
_INITIAL = 256 * 1024
_ZEROS = bytes(ALIGN)
_EMPTY = memoryview(b"")
#: Frames with at least this many bytes of buffers land in reused, pre-faulted memory.
POOLED_EXTRA = 1 << 20


def _receive_memory(nbytes: int) -> memoryview | bytearray:
    """Memory for a large frame's buffers: a segment of the receive pool, which goes back to
    the pool when the last tensor viewing it is freed. First-touch page faults cost several
    times the copy itself, so fresh memory per frame would halve what a socket delivers."""
    if nbytes < POOLED_EXTRA:
        return bytearray(nbytes)
    import weakref

    import numpy as np

    from orchestr.fabric.lowlevel import receive_pool

    view, done = receive_pool.empty(nbytes)
    array = np.frombuffer(view, dtype=np.uint8, count=nbytes)
    weakref.finalize(array, done)
    return array.data


Frame = tuple[memoryview, memoryview]


def padded(offset: int) -> int:
    """Round ``offset`` up to the buffer alignment."""
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def encode_frame(
    msg: bytes, buffers: Sequence[memoryview], *, scratch: bool = False
) -> list[bytes | memoryview]:
    """Return the pieces of one frame, ready for ``transport.writelines`` (no joining copy).

    ``scratch`` says the receiver will copy every buffer out while decoding (see SCRATCH)."""
    if not buffers:
        if len(msg) < _JOIN_BELOW:
            return [HEADER.pack(len(msg), 0) + msg]
        return [HEADER.pack(len(msg), 0), msg]
    parts: list[bytes | memoryview] = [b"", msg]
    offset = 0
    for buf in buffers:
        start = padded(offset)
        if start > offset:
            parts.append(_ZEROS[: start - offset])
        parts.append(buf)
        offset = start + buf.nbytes
    parts[0] = HEADER.pack(len(msg), offset | (SCRATCH if scratch else 0))
    return parts


class FrameDecoder:
    """Turns a byte stream into ``(msg, extra)`` frames.

    A frame without buffers, or with scratch buffers, is parsed where it landed in a shared
    receive buffer, so one socket read can deliver many frames: its ``msg`` and its read-only
    ``extra`` are views that later reads overwrite, to be decoded before more bytes are fed
    (decoding copies out of them). Otherwise ``extra`` is writable and owns its memory.
    Raises :class:`ProtocolError` for a frame over ``max_bytes``; the stream cannot be resynced
    after that and the connection must be closed.
    """

    def __init__(
        self, max_bytes: int, max_extra: int | None = None, *, initial: int = _INITIAL
    ) -> None:
        self.max_bytes = max_bytes
        #: The largest buffer area; by default the frame as a whole is held to ``max_bytes``.
        self.max_extra = max_extra
        #: One frame per parse, the rest kept until :meth:`more` (see :meth:`handshake`).
        self._single = False
        self._min_read = _MIN_READ
        self._buf = bytearray(initial)
        self._start = 0  # first unparsed byte
        self._end = 0  # end of received bytes
        # A large frame in progress: its own memory and how much of it is filled.
        self._big: tuple[bytearray, memoryview | bytearray] | None = None
        self._big_filled = 0
        self._need = 0  # bytes from _start that the frame being received needs in all

    @classmethod
    def handshake(cls, max_bytes: int) -> FrameDecoder:
        """A decoder for a connection whose peer has not authenticated: frames of at most
        ``max_bytes`` with no buffers (anything larger raises before a byte of it is kept),
        a receive buffer of a few KiB, and one frame at a time, so that what arrives behind
        the handshake is parsed under the limits in force once it is done (:meth:`open_up`).
        """
        read = max(max_bytes + HEADER.size, 1024)
        dec = cls(max_bytes, 0, initial=read)
        dec._single = True
        dec._min_read = read
        return dec

    def open_up(self, max_bytes: int, max_extra: int | None) -> None:
        """The peer has authenticated: accept frames up to the connection's real limits."""
        self.max_bytes, self.max_extra = max_bytes, max_extra
        self._single = False
        self._min_read = _MIN_READ

    @property
    def single(self) -> bool:
        """Whether this decoder returns one frame at a time (a handshake in progress)."""
        return self._single

    def more(self) -> list[Frame]:
        """Frames that arrived behind the last one a one-at-a-time decoder returned."""
        return self._parse()

    # -- BufferedProtocol side -------------------------------------------------------------
    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self._big is not None:
            msg, extra = self._big
            if self._big_filled < len(msg):
                return memoryview(msg)[self._big_filled :]
            return memoryview(extra)[self._big_filled - len(msg) :]
        want = max(self._need - (self._end - self._start), self._min_read)
        if len(self._buf) - self._end < want:
            self._make_room(want)
        return memoryview(self._buf)[self._end :]

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        if self._big is not None:
            self._big_filled += nbytes
            msg, extra = self._big
            if self._big_filled < len(msg) + len(extra):
                return []
            self._big = None
            return [(memoryview(msg), memoryview(extra)), *self._parse()]
        self._end += nbytes
        return self._parse()

    def feed(self, data: bytes) -> list[Frame]:
        """Push bytes that arrived some other way (tests, non-buffered transports)."""
        frames: list[Frame] = []
        view = memoryview(data)
        while view.nbytes:
            target = self.get_buffer(view.nbytes)
            n = min(target.nbytes, view.nbytes)
            target[:n] = view[:n]
            view = view[n:]
            # later reads reuse the shared buffer: keep copies of what this one delivered
            frames.extend(
                (memoryview(bytes(m)), memoryview(bytes(e)).toreadonly() if e.readonly else e)
                for m, e in self.buffer_updated(n)
            )
        return frames

    # -- internals ------------------------------------------------------------------------
    def _make_room(self, want: int) -> None:
        """Move unparsed bytes to the front, or into a bigger buffer, to leave ``want`` free."""
        pending = self._end - self._start
        if pending + want <= len(self._buf):
            self._buf[:pending] = self._buf[self._start : self._end]
        else:
            # A new buffer rather than an in-place resize: views of the old one may still be
            # alive (the transport's, or a frame's), and bytearray refuses to resize under them.
            grown = bytearray(max(2 * len(self._buf), pending + want))
            grown[:pending] = self._buf[self._start : self._end]
            self._buf = grown
        self._start, self._end = 0, pending

    def _parse(self) -> list[Frame]:
        frames: list[Frame] = []
        buf = self._buf
        self._need = HEADER.size
        while self._end - self._start >= HEADER.size:
            msg_len, extra_len = HEADER.unpack_from(buf, self._start)
            scratch = extra_len & SCRATCH
            extra_len &= ~SCRATCH
            total = msg_len + extra_len
            if self.max_extra is None:
                if total > self.max_bytes:
                    raise ProtocolError(
                        f"peer sent a frame of {total} bytes, over the limit of "
                        f"{self.max_bytes} bytes (ORCHESTR_MAX_MESSAGE_BYTES)"
                    )
            elif msg_len > self.max_bytes or extra_len > self.max_extra:
                raise ProtocolError(
                    f"peer sent a frame with a {msg_len}-byte message and {extra_len} bytes of "
                    f"buffers, over the limits of {self.max_bytes} (ORCHESTR_MAX_MESSAGE_BYTES) "
                    f"and {self.max_extra} bytes (ORCHESTR_MAX_MESSAGE_BYTES plus "
                    f"ORCHESTR_MAX_BULK_BYTES)"
                )
            body = self._start + HEADER.size
            if extra_len == 0 or scratch:
                if self._end - body < total:
                    self._need = HEADER.size + total
                    break
                view = memoryview(buf)
                borrowed = view[body + msg_len : body + total].toreadonly() if extra_len else _EMPTY
                frames.append((view[body : body + msg_len], borrowed))
                self._start = body + total
                if self._single:
                    break
                continue
            # Give this frame memory of its own and move what already arrived into it.
            msg, extra = bytearray(msg_len), _receive_memory(extra_len)
            have = min(self._end - body, total)
            from_msg = min(have, msg_len)
            msg[:from_msg] = buf[body : body + from_msg]
            if have > msg_len:
                extra[: have - msg_len] = buf[body + msg_len : body + have]
            self._start = body + have
            if have == total:
                frames.append((memoryview(msg), memoryview(extra)))
                continue
            self._big, self._big_filled = (msg, extra), have
            break
        if self._start == self._end:
            self._start = self._end = 0
        return frames
