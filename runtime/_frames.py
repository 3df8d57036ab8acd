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

from .errors import ProtocolError

__all__ = ["ALIGN", "HEADER", "FrameDecoder", "encode_frame", "padded"]

HEADER = struct.Struct("<IQ")
ALIGN = 16
_SMALL = 64 * 1024  # frames up to this size without buffers are parsed inside the shared buffer
_INITIAL = 256 * 1024
_ZEROS = bytes(ALIGN)

Frame = tuple[memoryview, memoryview]


def padded(offset: int) -> int:
    """Round ``offset`` up to the buffer alignment."""
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def encode_frame(msg: bytes, buffers: Sequence[memoryview]) -> list[bytes | memoryview]:
    """Return the pieces of one frame, ready for ``transport.writelines`` (no joining copy)."""
    if not buffers:
        return [HEADER.pack(len(msg), 0) + msg]
    parts: list[bytes | memoryview] = [b"", msg]
    offset = 0
    for buf in buffers:
        start = padded(offset)
        if start > offset:
            parts.append(_ZEROS[: start - offset])
        parts.append(buf)
        offset = start + buf.nbytes
    parts[0] = HEADER.pack(len(msg), offset)
    return parts


class FrameDecoder:
    """Turns a byte stream into ``(msg, extra)`` frames.

    ``msg`` of a small frame is a view into a shared buffer that is reused after the call that
    returned it: decode it before feeding more bytes. ``extra`` always owns its memory.
    Raises :class:`ProtocolError` for a frame over ``max_bytes``; the stream cannot be resynced
    after that and the connection must be closed.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._buf = bytearray(_INITIAL)
        self._start = 0  # first unparsed byte
        self._end = 0  # end of received bytes
        # A large frame in progress: its own memory and how much of it is filled.
        self._big: tuple[bytearray, bytearray] | None = None
        self._big_filled = 0

    # -- BufferedProtocol side -------------------------------------------------------------
    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self._big is not None:
            msg, extra = self._big
            if self._big_filled < len(msg):
                return memoryview(msg)[self._big_filled :]
            return memoryview(extra)[self._big_filled - len(msg) :]
        if len(self._buf) - self._end < _SMALL:
            self._compact()
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
            frames.extend(self.buffer_updated(n))
        return frames

    # -- internals ------------------------------------------------------------------------
    def _compact(self) -> None:
        pending = self._end - self._start
        if self._start:
            self._buf[:pending] = self._buf[self._start : self._end]
            self._start, self._end = 0, pending
        if len(self._buf) - self._end < _SMALL:
            # A new buffer rather than an in-place resize: views of the old one may still be
            # alive (the transport's, or a frame's), and bytearray refuses to resize under them.
            grown = bytearray(2 * len(self._buf))
            grown[: self._end] = self._buf[: self._end]
            self._buf = grown

    def _parse(self) -> list[Frame]:
        frames: list[Frame] = []
        buf = self._buf
        while self._end - self._start >= HEADER.size:
            msg_len, extra_len = HEADER.unpack_from(buf, self._start)
            total = msg_len + extra_len
            if total > self.max_bytes:
                raise ProtocolError(
                    f"peer sent a frame of {total} bytes, over the limit of {self.max_bytes} "
                    f"bytes (ORCHESTR_MAX_MESSAGE_BYTES)"
                )
            body = self._start + HEADER.size
            if extra_len == 0 and msg_len <= _SMALL:
                if self._end - body < msg_len:
                    break
                frames.append((memoryview(buf)[body : body + msg_len], memoryview(b"")))
                self._start = body + msg_len
                continue
            # Give this frame memory of its own and move what already arrived into it.
            msg, extra = bytearray(msg_len), bytearray(extra_len)
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
