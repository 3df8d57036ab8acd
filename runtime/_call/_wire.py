"""The call path's wire: message kinds, frame packing, and the protocol base both ends share.

Messages (msgpack arrays):

- ``[HELLO, 0, {"nonce"}]``, ``[CHALLENGE, 0, {"nonce", "proof"}]`` and ``[AUTH, 0, {"proof",
  "process": key, "probe": [pid, fd, key]}]`` open every connection: each end proves it knows
  the cluster token without sending it (see ``_handshake``); a wrong proof closes it. The server
  answers ``[WELCOME, 0, {"process", "probe", "shm", "reason"}]`` and the caller confirms with
  ``[READY, 0, {"shm", "reason"}]`` (see ``_bulk``).
- ``[RELEASE, 0, [[fd, generation], ...]]`` hands shared-memory segments back to their owner.
- ``[CALL, call_id, actor_id, endpoint, args, kwargs]`` expects a reply.
- ``[SEND, 0, actor_id, endpoint, args, kwargs]`` expects none (``broadcast``).
- ``[OK, call_id, value]`` / ``[ERR, call_id, kind, type_name, message, traceback]``.
"""

from __future__ import annotations

import asyncio
import math
import socket
from typing import Any, cast

import structlog

from orchestr.config import Config
from orchestr.errors import MessageTooLargeError
from orchestr.fabric.lowlevel import RingEnd, StreamEnd

from . import _serde
from ._arrays import BulkSink
from ._frames import FrameDecoder, encode_frame
from ._handshake import HANDSHAKE_MAX_BYTES

__all__ = [
    "AUTH",
    "CALL",
    "CHALLENGE",
    "ERR",
    "HELLO",
    "OK",
    "READY",
    "RELEASE",
    "SEND",
    "WELCOME",
    "FramedProtocol",
    "Moved",
    "pack_frame",
    "pack_frame_sized",
    "probe_idle_peer",
    "stream_counters",
    "stream_scheme",
]

log = structlog.get_logger("orchestr.callpath")

HELLO, CALL, SEND, OK, ERR, WELCOME, READY, RELEASE, CHALLENGE, AUTH = range(10)

#: Bytes this process received on call-path streams (both ends), for metrics and tests.
traffic = {"received": 0}


class Moved:
    """What this process moved one way or the other over one transport: plain integers,
    bumped on the hot path without locks (each process's call path runs on one loop)."""

    __slots__ = ("ops", "received", "sent")

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self.ops = 0  # values (bulk); streams leave it at 0


#: Call-path stream bytes by stream scheme (``tcp``, ``shm``, ``inproc``), both ends.
streams: dict[str, Moved] = {}
#: Call values that went through shared-memory segments instead of the frame (see ``_bulk``).
bulk = Moved()


def stream_counters(scheme: str) -> Moved:
    moved = streams.get(scheme)
    if moved is None:
        moved = streams[scheme] = Moved()
    return moved


def stream_scheme(transport: asyncio.BaseTransport) -> str:
    """The stream scheme a connected transport belongs to: the in-host ends say, by their
    class; anything else is taken for a socket (``tcp``)."""
    if isinstance(transport, RingEnd):
        return "shm"
    if isinstance(transport, StreamEnd):
        return "inproc"
    return "tcp"


def _nbytes(parts: list[bytes | memoryview]) -> int:
    n = 0
    for p in parts:
        n += p.nbytes if isinstance(p, memoryview) else len(p)
    return n


def pack_frame(
    message: list[Any], limit: int, bulk: BulkSink | None = None, config: Config | None = None
) -> list[bytes | memoryview]:
    """Encode one message; see :func:`pack_frame_sized`."""
    return pack_frame_sized(message, limit, bulk, config)[0]


def pack_frame_sized(
    message: list[Any], limit: int, bulk: BulkSink | None = None, config: Config | None = None
) -> tuple[list[bytes | memoryview], int]:
    """Encode one message, and say how many bytes of it are large values kept in the frame
    (counted only with ``config``). Raises SerializationError / MessageTooLargeError at the
    caller.

    Payloads wrapped with :func:`orchestr._call._serde.lift_large` go out of band, uncopied; large
    tensors go to ``bulk`` (shared memory) when given. With ``config``, buffers (tensors,
    arrays, bytes) of at least ``inline_max_bytes`` that stay in the frame count against
    ``max_bulk_bytes`` instead of ``limit``.
    """
    msg, buffers, scratch = _serde.encode_parts(message, bulk)
    size = len(msg) + sum(b.nbytes for b in buffers)
    big = 0
    if config is not None and buffers:
        big = sum(b.nbytes for b in buffers if b.nbytes >= config.inline_max_bytes)
        if big > config.max_bulk_bytes:
            if bulk is not None:
                bulk.abandon()
            raise MessageTooLargeError(big, config.max_bulk_bytes, bulk=True)
    if size - big > limit:
        if bulk is not None:
            bulk.abandon()
        raise MessageTooLargeError(size - big, limit)
    return encode_frame(msg, buffers, scratch=scratch), big


def frame_limits(config: Config) -> tuple[int, int]:
    """The largest message and the largest buffer area a call-path frame may carry."""
    return config.max_message_bytes, config.max_message_bytes + config.max_bulk_bytes


class FramedProtocol(asyncio.BufferedProtocol):
    """Frames over one stream: reads land in a :class:`FrameDecoder`; the first frame sent in
    an event-loop turn is written at once and the rest of the turn's go out in one write at its
    end. Frames sent before the connection is made wait for it; frames
    sent after it is lost are dropped.

    Until :meth:`open_up`, the peer is unproven: it may send only small frames without
    buffers (:meth:`FrameDecoder.handshake`), parsed one at a time."""

    def __init__(self, max_bytes: int, max_extra: int | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.decoder = FrameDecoder.handshake(HANDSHAKE_MAX_BYTES)
        self.limits = (max_bytes, max_extra)
        self.transport: asyncio.Transport | None = None
        self.out: list[bytes | memoryview] = []
        self.out_bytes = 0  # in ``out``
        self.flush_scheduled = False
        self.lost = False
        #: Where this connection's bytes are counted; set for real once connected.
        self.counters = Moved()

    def send(self, parts: list[bytes | memoryview]) -> None:
        if self.lost:
            return
        if self.flush_scheduled or self.transport is None:
            self.out.extend(parts)
            self.out_bytes += _nbytes(parts)
            return
        # The first frame of a loop turn goes out at once (latency); the flush scheduled here
        # sends whatever else this turn queues in one write (throughput).
        if len(parts) == 1:
            part = parts[0]
            self.transport.write(part)
            self.counters.sent += part.nbytes if isinstance(part, memoryview) else len(part)
        else:
            self.transport.writelines(parts)
            self.counters.sent += _nbytes(parts)
        self.flush_scheduled = True
        self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.transport is None or not self.out:
            return
        out, self.out = self.out, []
        self.counters.sent += self.out_bytes
        self.out_bytes = 0
        if len(out) == 1:
            self.transport.write(out[0])
        else:
            self.transport.writelines(out)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.counters = stream_counters(stream_scheme(transport))
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.lost = True
        self.out = []
        self.out_bytes = 0

    def unsent(self) -> int:
        """Bytes sent on this connection that the peer has not taken yet: waiting in the
        transport (the peer does not read, or reads slower than we write) or in this turn's
        batch. What a caller may pile up is bounded by this (``max_unsent_bytes``)."""
        queued = self.transport.get_write_buffer_size() if self.transport is not None else 0
        return queued + self.out_bytes

    def open_up(self) -> None:
        """The peer has proven itself: accept frames up to this connection's limits."""
        self.decoder.open_up(*self.limits)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)


def probe_idle_peer(transport: asyncio.BaseTransport, config: Config) -> None:
    """Have the kernel give up a TCP connection whose peer host went silent (a link down, a
    power cut: no reset ever comes), so that the connection breaks and the calls waiting on it
    are settled, instead of each waiting for its deadline. Two cases, one budget: an idle
    connection is probed (keepalive, every ``heartbeat_interval``), and one with bytes the peer
    has not acknowledged (a call sent just before, or after, the host went silent: keepalive
    never probes such a connection, and retransmission alone gives up only after about 15
    minutes) is given up when they stay unacknowledged as long (``TCP_USER_TIMEOUT``). Both give
    up later than the head gives the node up (``heartbeat_timeout`` and two heartbeats more), so
    that by then the head can say what became of its actors. The worker's kernel answers them
    even while its actors are busy."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    interval = max(1, math.ceil(config.heartbeat_interval))
    probes = math.ceil(config.heartbeat_timeout / interval) + 2
    interval, probes = min(interval, 32767), min(probes, 127)  # the kernel's limits
    give_up_ms = 1000 * interval * (probes + 1)
    options = [
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPIDLE", None), interval),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPINTVL", None), interval),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPCNT", None), probes),
        # in milliseconds; with keepalive on, Linux also ends the probing by this bound
        (socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", None), give_up_ms),
    ]
    try:
        for level, name, value in options:
            if name is not None:  # not every platform lets the timings be set
                sock.setsockopt(level, name, value)
    except OSError as exc:
        log.warning("cannot enable keepalive on a call connection", error=str(exc))
