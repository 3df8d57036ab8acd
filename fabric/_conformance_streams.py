"""The stream half of the transport conformance suite.

:func:`check_stream_transport` drives a registered stream backend through plain asyncio
protocols of both kinds (``data_received`` and ``BufferedProtocol``) and checks what the call path
relies on: ordering, large and empty frames, flow control both ways, close versus abort, a peer
that dies mid-transfer, and reads bounded by deadlines. Frames here are the suite's own
(``u64 length | u32 sequence | u32 crc32 | payload``), independent of the runtime's.

For backends that cross processes the dying peer is a real subprocess killed with SIGKILL; for
in-process ones (``inproc``) it is emulated with ``abort()`` and the check is reported as
``peer-killed (emulated: in-process)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import struct
import sys
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar, cast

from ._streams import Listener, connect_stream, listen_stream, stream_transports

__all__ = ["CHECKS", "DEFAULT_URLS", "IN_PROCESS", "check_stream_transport"]

#: Names of the checks, in the order they run; a passed check's reported name starts with its
#: entry here (``peer-killed`` may carry a note).
CHECKS = (
    "ordering",
    "large-and-zero-length",
    "backpressure",
    "close-vs-abort",
    "peer-killed",
    "deadline-expiry",
)
#: Where each known scheme listens when no URL is given.
DEFAULT_URLS = {"tcp": "tcp://127.0.0.1:0", "inproc": "inproc://", "shm": "shm://"}
#: Schemes whose two ends share one process (a killed peer can only be emulated).
IN_PROCESS = frozenset({"inproc"})

HEAD = struct.Struct("<QII")  # payload length, sequence number, crc32 of the payload
MiB = 1 << 20
ORDERED_FRAMES = 2000
MAX_SMALL = 64 * 1024
LARGE = 64 * MiB
BACKPRESSURE_LIMIT = 64 * MiB
CLOSE_BYTES = 8 * MiB
ABORT_BYTES = 32 * MiB
STEP = 30.0  # seconds any one step may take before the check fails
PROMPT = 5.0  # seconds for connection_lost after abort, close or a killed peer

T = TypeVar("T")


class _Frames:
    """Parses the suite's frames and checks them as they complete."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.sizes: list[int] = []
        self.error: str | None = None

    def feed(self, data: bytes | memoryview) -> None:
        self._buf += data
        buf, pos = self._buf, 0
        while len(buf) - pos >= HEAD.size:
            size, seq, crc = HEAD.unpack_from(buf, pos)
            end = pos + HEAD.size + size
            if len(buf) < end:
                break
            if self.error is None:
                with memoryview(buf) as view, view[pos + HEAD.size : end] as payload:
                    got = zlib.crc32(payload)
                if seq != len(self.sizes):
                    self.error = f"frame {len(self.sizes)} arrived with sequence number {seq}"
                elif got != crc:
                    self.error = f"frame {seq} ({size} bytes) arrived corrupted (crc32 mismatch)"
            self.sizes.append(size)
            pos = end
        if pos:
            del buf[:pos]


class _Probe(asyncio.BaseProtocol):
    """State shared by both protocol kinds: what arrived, flow-control calls, loss."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.made: asyncio.Future[None] = loop.create_future()
        self.lost: asyncio.Future[Exception | None] = loop.create_future()
        self.nbytes = 0
        self.crc = 0
        self.frames: _Frames | None = None
        self.eof = False
        self.pauses = 0
        self.resumes = 0
        self.can_write = asyncio.Event()
        self.can_write.set()
        self.hold_reads = False  # set while this end has called pause_reading
        self.read_while_held = 0
        self.nbytes_at_loss = -1
        self._changed = asyncio.Event()

    @property
    def tx(self) -> asyncio.Transport:
        assert self.transport is not None, "no transport: connection_made was never called"
        return self.transport

    # -- protocol callbacks shared by both kinds --------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        if not self.made.done():
            self.made.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.nbytes_at_loss = self.nbytes
        if not self.lost.done():
            self.lost.set_result(exc)
        self.can_write.set()
        self._changed.set()

    def pause_writing(self) -> None:
        self.pauses += 1
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.resumes += 1
        self.can_write.set()

    def eof_received(self) -> bool | None:
        self.eof = True
        self._changed.set()
        return None

    def got(self, data: bytes | memoryview) -> None:
        if self.hold_reads:
            self.read_while_held += len(data)
        self.nbytes += len(data)
        if self.frames is not None:
            self.frames.feed(data)
        else:
            self.crc = zlib.crc32(data, self.crc)
        self._changed.set()

    # -- waiting --------------------------------------------------------------------------
    async def until(self, ready: Callable[[], bool], what: str) -> None:
        """Wait for ``ready()``; fails if the connection is lost first."""
        while not ready():
            if self.lost.done():
                raise AssertionError(
                    f"connection lost ({self.lost.result()!r}) while waiting for {what} "
                    f"({self.nbytes} bytes had arrived)"
                )
            self._changed.clear()
            await self._changed.wait()

    async def wait_bytes(self, n: int) -> None:
        await self.until(lambda: self.nbytes >= n, f"{n} bytes")

    async def drain(self) -> None:
        await self.can_write.wait()
        if self.lost.done():
            raise AssertionError(f"connection lost ({self.lost.result()!r}) while writing")


class _Plain(_Probe, asyncio.Protocol):
    def data_received(self, data: bytes) -> None:
        self.got(data)


class _Buffered(_Probe, asyncio.BufferedProtocol):
    chunk = 256 * 1024

    def __init__(self) -> None:
        super().__init__()
        self._space = bytearray(self.chunk)

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._space)

    def buffer_updated(self, nbytes: int) -> None:
        self.got(bytes(self._space[:nbytes]))


class _SmallBuffered(_Buffered):
    chunk = 65_521  # odd and small: frames straddle many partial fills


@contextlib.asynccontextmanager
async def _within(seconds: float, what: str) -> AsyncIterator[None]:
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise AssertionError(f"{what}: still waiting after {seconds:g} s") from None


async def _bounded(aw: Awaitable[T], seconds: float, what: str) -> T:
    async with _within(seconds, what):
        return await aw


async def _together(*coros: Coroutine[Any, Any, None]) -> None:
    """Run ``coros`` concurrently; the first failure cancels the rest and is raised as is."""
    try:
        async with asyncio.TaskGroup() as group:
            for coro in coros:
                group.create_task(coro)
    except BaseExceptionGroup as failed:
        first: BaseException = failed
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None


async def _lost(probe: _Probe, what: str, seconds: float = PROMPT) -> Exception | None:
    return await _bounded(asyncio.shield(probe.lost), seconds, f"connection_lost {what}")


class _Connections:
    """A listener and the connections made to it, torn down together."""

    def __init__(self, url: str, server_kind: type[_Probe]) -> None:
        self.url = url
        self.server_kind = server_kind
        self.accepted: asyncio.Queue[_Probe] = asyncio.Queue()
        self.listener: Listener | None = None
        self.probes: list[_Probe] = []

    def _accept(self) -> _Probe:
        probe = self.server_kind()
        self.probes.append(probe)
        self.accepted.put_nowait(probe)
        return probe

    async def start(self) -> str:
        self.listener = await _bounded(listen_stream(self.url, self._accept), STEP, "listen")
        return self.listener.url

    async def next_accepted(self) -> _Probe:
        server = await _bounded(self.accepted.get(), STEP, "accepting a connection")
        await _bounded(server.made, STEP, "connection_made on the accepting side")
        return server

    async def connect(self, client_kind: type[_Probe]) -> tuple[_Probe, _Probe]:
        """A new connection: (accepting end, connecting end)."""
        assert self.listener is not None
        proto = await _bounded(connect_stream(self.listener.url, client_kind), STEP, "connect")
        assert isinstance(proto, client_kind), f"connect returned {proto!r}, not the protocol"
        client = proto
        self.probes.append(client)
        await _bounded(client.made, STEP, "connection_made on the connecting side")
        return await self.next_accepted(), client

    async def aclose(self) -> None:
        for probe in self.probes:
            if probe.transport is not None and not probe.lost.done():
                probe.transport.abort()
        for probe in self.probes:
            if probe.transport is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(PROMPT):
                        await asyncio.shield(probe.lost)
        if self.listener is not None:
            await _bounded(self.listener.aclose(), STEP, "closing the listener")


@contextlib.asynccontextmanager
async def _pair(
    url: str, server_kind: type[_Probe] = _Buffered, client_kind: type[_Probe] = _Plain
) -> AsyncIterator[tuple[_Probe, _Probe, _Connections]]:
    conns = _Connections(url, server_kind)
    try:
        await conns.start()
        server, client = await conns.connect(client_kind)
        yield server, client, conns
    finally:
        await conns.aclose()


def _pattern(nbytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


async def _send_frames(
    probe: _Probe, sizes: Sequence[int], pool: bytes, seed: int, *, empty_writes: bool = False
) -> None:
    """Write one frame per size (payloads cut from ``pool``), in three write styles, honouring
    pause_writing."""
    rng = random.Random(seed)
    view = memoryview(pool)
    tx = probe.tx
    for seq, size in enumerate(sizes):
        start = rng.randrange(len(pool) - size + 1)
        payload = view[start : start + size]
        header = HEAD.pack(size, seq, zlib.crc32(payload))
        style = seq % 3
        if style == 0:
            tx.write(header + payload.tobytes())
        elif style == 1:
            tx.writelines([header, payload])
        else:
            tx.write(header)
            tx.write(payload)
        if empty_writes:
            tx.write(b"")
            tx.writelines([])
        if not probe.can_write.is_set():
            await probe.drain()
        elif seq % 64 == 63:
            await asyncio.sleep(0)


async def _frames_arrive(probe: _Probe, sizes: Sequence[int], what: str) -> None:
    frames = probe.frames
    assert frames is not None
    await probe.until(lambda: frames.error is not None or len(frames.sizes) >= len(sizes), what)
    assert frames.error is None, f"{what}: {frames.error}"
    assert frames.sizes == list(sizes), f"{what}: frame sizes differ from those sent"
    assert probe.read_while_held == 0


# -- the checks ------------------------------------------------------------------------------


async def _check_ordering(scheme: str, url: str) -> str:
    rng = random.Random(1)
    pool = _pattern(MiB + MAX_SMALL, 2)
    ways = [[rng.randint(0, MAX_SMALL) for _ in range(ORDERED_FRAMES)] for _ in range(2)]
    async with _pair(url) as (server, client, _):
        server.frames, client.frames = _Frames(), _Frames()
        async with _within(4 * STEP, f"{ORDERED_FRAMES} frames each way"):
            await _together(
                _send_frames(client, ways[0], pool, 3),
                _send_frames(server, ways[1], pool, 4),
                _frames_arrive(server, ways[0], "client to server"),
                _frames_arrive(client, ways[1], "server to client"),
            )
    return "ordering"


async def _send_large(probe: _Probe, large: bytes, seq: int) -> None:
    probe.tx.writelines([HEAD.pack(len(large), seq, zlib.crc32(large)), large])
    await probe.drain()


async def _send_run(probe: _Probe, sizes: Sequence[int], first: int) -> None:
    """Small and empty frames (payload bytes 0, 1, 2, ...) with empty writes between them."""
    pool = memoryview(bytes(range(256)) * 2)
    for i, size in enumerate(sizes):
        payload = pool[:size]
        probe.tx.writelines([HEAD.pack(size, first + i, zlib.crc32(payload)), payload])
        probe.tx.write(b"")
    await probe.drain()


async def _check_large(scheme: str, url: str) -> str:
    large = _pattern(LARGE, 5)
    rng = random.Random(6)
    run = [0 if i % 2 == 0 else rng.randint(1, 300) for i in range(200)]
    run[50:60] = [0] * 10  # empty frames back to back

    async def client_side(client: _Probe) -> None:
        await _send_large(client, large, 0)
        await _send_run(client, run, 1)

    async def server_side(server: _Probe) -> None:
        await _send_run(server, run, 0)
        await _send_large(server, large, len(run))

    async with _pair(url, server_kind=_SmallBuffered) as (server, client, _):
        server.frames, client.frames = _Frames(), _Frames()
        async with _within(4 * STEP, "a 64 MiB frame and a run of empty frames each way"):
            await _together(
                client_side(client),
                server_side(server),
                _frames_arrive(server, [LARGE, *run], "client to server"),
                _frames_arrive(client, [*run, LARGE], "server to client"),
            )
    return "large-and-zero-length"


async def _check_backpressure(scheme: str, url: str) -> str:
    chunk = _pattern(64 * 1024, 8)
    async with _pair(url) as (server, client, _):
        server.tx.pause_reading()
        server.hold_reads = True
        written = crc = 0
        while not client.pauses:
            assert written < BACKPRESSURE_LIMIT, (
                f"no pause_writing after {written} bytes written to a peer that paused reading "
                f"({client.tx.get_write_buffer_size()} bytes held by the transport)"
            )
            client.tx.write(chunk)
            written += len(chunk)
            crc = zlib.crc32(chunk, crc)
            if written % (16 * len(chunk)) == 0:
                await asyncio.sleep(0)
        held = client.tx.get_write_buffer_size()
        assert held > 0, "pause_writing came with get_write_buffer_size() == 0"
        await asyncio.sleep(0.1)  # data must not be delivered while the reader is paused
        assert server.read_while_held == 0, (
            f"{server.read_while_held} bytes delivered after pause_reading()"
        )
        server.hold_reads = False
        server.tx.resume_reading()
        await _bounded(client.drain(), STEP, "resume_writing after the reader resumed")
        assert client.resumes >= 1, "writing resumed without resume_writing()"
        for _ in range(64):  # 4 MiB more, now honouring flow control
            await _bounded(client.drain(), STEP, "resume_writing")
            client.tx.write(chunk)
            written += len(chunk)
            crc = zlib.crc32(chunk, crc)
        await _bounded(server.wait_bytes(written), STEP, f"all {written} bytes to arrive")
        assert server.nbytes == written, f"{server.nbytes} bytes arrived, {written} were written"
        assert server.crc == crc, "the bytes arrived corrupted or out of order"
    return "backpressure"


async def _check_close_abort(scheme: str, url: str) -> str:
    data = _pattern(ABORT_BYTES, 9)
    async with _pair(url) as (server, client, _):
        for start in range(0, CLOSE_BYTES, MiB):  # flow control ignored: close must flush
            client.tx.write(data[start : start + MiB])
        client.tx.close()
        assert client.tx.is_closing(), "is_closing() is false right after close()"
        exc = await _lost(server, "at the peer after close()", STEP)
        assert exc is None, f"close() made the peer see connection_lost({exc!r})"
        assert server.nbytes_at_loss == CLOSE_BYTES, (
            f"close() delivered {server.nbytes_at_loss} of {CLOSE_BYTES} bytes before "
            f"connection_lost"
        )
        assert server.crc == zlib.crc32(data[:CLOSE_BYTES]), "close(): the bytes arrived corrupted"
        exc = await _lost(client, "after close()", STEP)
        assert exc is None, f"close() ended in connection_lost({exc!r})"
        client.tx.close()  # a second close is a no-op

    async with _pair(url) as (server, client, _):
        server.tx.pause_reading()
        for start in range(0, ABORT_BYTES, MiB):
            client.tx.write(data[start : start + MiB])
            await asyncio.sleep(0)
        queued = client.tx.get_write_buffer_size()
        assert queued > 0, "nothing queued in the transport for abort() to drop"
        started = time.monotonic()
        client.tx.abort()
        assert client.tx.is_closing(), "is_closing() is false right after abort()"
        await _lost(client, "after abort()")
        server.tx.resume_reading()
        await _lost(server, "at the peer after abort()")
        took = time.monotonic() - started
        assert server.nbytes < ABORT_BYTES, (
            f"abort() with {queued} bytes queued still delivered all {ABORT_BYTES} bytes"
        )
        assert server.crc == zlib.crc32(data[: server.nbytes]), "abort(): bytes arrived corrupted"
        assert took < PROMPT, f"the peer saw connection_lost {took:.1f} s after abort()"
    return "close-vs-abort"


_KILLED_PEER = """
import asyncio, sys
from orchestr.fabric import connect_stream

class Streamer(asyncio.Protocol):
    def __init__(self):
        self.ok = asyncio.Event()
        self.ok.set()
        self.gone = asyncio.Event()
    def connection_made(self, transport):
        self.transport = transport
    def pause_writing(self):
        self.ok.clear()
    def resume_writing(self):
        self.ok.set()
    def connection_lost(self, exc):
        self.gone.set()
        self.ok.set()

async def main():
    peer = await connect_stream(sys.argv[1], Streamer)
    chunk = bytes(range(256)) * 256
    while not peer.gone.is_set():
        peer.transport.write(chunk)
        await peer.ok.wait()
        await asyncio.sleep(0)

asyncio.run(main())
"""


async def _or_child_exit(aw: Awaitable[T], proc: asyncio.subprocess.Process, what: str) -> T:
    """``await aw``, failing with the child's stderr if it exits first."""
    task = asyncio.ensure_future(aw)
    exited = asyncio.ensure_future(proc.wait())
    try:
        async with _within(STEP, what):
            await asyncio.wait([task, exited], return_when=asyncio.FIRST_COMPLETED)
    finally:
        exited.cancel()
        if not task.done():
            task.cancel()
    if not task.done():
        assert proc.stderr is not None
        err = (await proc.stderr.read()).decode(errors="replace")
        raise AssertionError(f"{what}: the peer process exited ({proc.returncode}):\n{err}")
    return task.result()


async def _check_peer_killed(scheme: str, url: str) -> str:
    conns = _Connections(url, _Plain)
    try:
        bound = await conns.start()
        if scheme in IN_PROCESS:
            server, client = await conns.connect(_Plain)
            chunk = _pattern(64 * 1024, 10)

            async def stream() -> None:
                while not client.lost.done():
                    client.tx.write(chunk)
                    await client.can_write.wait()
                    await asyncio.sleep(0)

            streaming = asyncio.ensure_future(stream())
            try:
                await _bounded(server.wait_bytes(4 * MiB), STEP, "data from the peer")
                client.tx.abort()
                await _lost(server, "after the peer died")
            finally:
                streaming.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await streaming
            label = "peer-killed (emulated: in-process)"
        else:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                _KILLED_PEER,
                bound,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            killed = False
            try:
                server = await _or_child_exit(conns.next_accepted(), proc, "the peer connecting")
                await _or_child_exit(server.wait_bytes(4 * MiB), proc, "data from the peer")
                proc.send_signal(signal.SIGKILL)
                killed = True
                await _lost(server, "after the peer was killed with SIGKILL")
            finally:
                if not killed and proc.returncode is None:
                    proc.kill()  # once only: a second signal races the child watcher's reaping
                await _bounded(proc.communicate(), STEP, "the killed peer to be reaped")
            label = "peer-killed"
        # The listener outlives the dead connection.
        server2, client2 = await conns.connect(_Plain)
        client2.tx.write(b"ping")
        await _bounded(server2.wait_bytes(4), STEP, "data on a new connection after the kill")
        client2.tx.close()
        await _lost(server2, "after close() on a new connection")
    finally:
        await conns.aclose()
    return label


async def _check_deadline(scheme: str, url: str) -> str:
    async with _pair(url) as (server, client, _):
        started = time.monotonic()
        try:
            async with asyncio.timeout(0.2):
                await server.wait_bytes(1)
        except TimeoutError:
            pass
        else:
            raise AssertionError("a read completed although the peer sent nothing")
        took = time.monotonic() - started
        assert took < 2.0, f"a 0.2 s deadline fired after {took:.1f} s"
        assert not server.tx.is_closing(), "the deadline closed the connection"
        client.tx.write(b"after the deadline")
        await _bounded(server.wait_bytes(18), STEP, "data after a read timed out")
        server.tx.write(b"pong")
        await _bounded(client.wait_bytes(4), STEP, "a reply after a read timed out")
        client.tx.close()
        assert await _lost(server, "at the peer after close()") is None
        assert await _lost(client, "after close()") is None
    return "deadline-expiry"


_CHECKS: tuple[tuple[str, Callable[[str, str], Awaitable[str]]], ...] = (
    ("ordering", _check_ordering),
    ("large-and-zero-length", _check_large),
    ("backpressure", _check_backpressure),
    ("close-vs-abort", _check_close_abort),
    ("peer-killed", _check_peer_killed),
    ("deadline-expiry", _check_deadline),
)


async def check_stream_transport(scheme: str, *, url: str | None = None) -> list[str]:
    """Run every stream check against the backend registered for ``scheme``, listening on
    ``url`` (default: :data:`DEFAULT_URLS`). Returns the names of the checks passed; raises
    AssertionError naming the check that failed and what happened."""
    if scheme not in stream_transports():
        raise ValueError(f"no stream transport registered for {scheme!r}")
    if url is None:
        try:
            url = DEFAULT_URLS[scheme]
        except KeyError:
            raise ValueError(f"no default URL for {scheme!r}: pass url=") from None
    passed: list[str] = []
    for name, check in _CHECKS:
        try:
            passed.append(await check(scheme, url))
        except AssertionError as exc:
            raise AssertionError(f"{scheme}:// {name}: {exc}") from exc
        except Exception as exc:
            raise AssertionError(f"{scheme}:// {name}: {type(exc).__name__}: {exc}") from exc
    return passed
