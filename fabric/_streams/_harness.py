"""The harness the stream checks run on: probe protocols, connections, frames and a peer process.

A :class:`Probe` is an asyncio protocol that records what arrives, the flow-control calls it gets
and the connection's loss; :class:`Plain` takes ``data_received`` and :class:`Buffered` (and
:class:`SmallBuffered`, with an odd, small buffer) the ``BufferedProtocol`` calls.
:class:`Connections` is a listener and the connections made to it, torn down together; :func:`pair`
opens one connection. Frames are the suite's own (``u64 length | u32 sequence | u32 crc32 |
payload``, :data:`HEAD`), independent of the runtime's: :func:`send_frames` writes them and
:class:`Frames` checks them as they arrive. :func:`spawn_streamer` starts a separate process that
connects and streams until it is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
import sys
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar, cast

from orchestr.tasks import TaskOwner

from ._transport import Listener, connect_stream, listen_stream

__all__ = [
    "HEAD",
    "PROMPT",
    "STEP",
    "Buffered",
    "Connections",
    "Frames",
    "MiB",
    "Plain",
    "Probe",
    "SmallBuffered",
    "bounded",
    "frames_arrive",
    "or_child_exit",
    "pair",
    "pattern",
    "send_frames",
    "spawn_streamer",
    "together",
    "until_lost",
    "within",
]

HEAD = struct.Struct("<QII")  # payload length, sequence number, crc32 of the payload
MiB = 1 << 20
STEP = 30.0  # seconds any one step may take before the check fails
PROMPT = 5.0  # seconds for connection_lost after abort, close or a killed peer

T = TypeVar("T")


class Frames:
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


class Probe(asyncio.BaseProtocol):
    """State shared by both protocol kinds: what arrived, flow-control calls, loss."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.made: asyncio.Future[None] = loop.create_future()
        self.lost: asyncio.Future[Exception | None] = loop.create_future()
        self.nbytes = 0
        self.crc = 0
        self.frames: Frames | None = None
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


class Plain(Probe, asyncio.Protocol):
    def data_received(self, data: bytes) -> None:
        self.got(data)


class Buffered(Probe, asyncio.BufferedProtocol):
    chunk = 256 * 1024

    def __init__(self) -> None:
        super().__init__()
        self._space = bytearray(self.chunk)

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._space)

    def buffer_updated(self, nbytes: int) -> None:
        self.got(bytes(self._space[:nbytes]))


class SmallBuffered(Buffered):
    chunk = 65_521  # odd and small: frames straddle many partial fills


@contextlib.asynccontextmanager
async def within(seconds: float, what: str) -> AsyncIterator[None]:
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise AssertionError(f"{what}: still waiting after {seconds:g} s") from None


async def bounded(aw: Awaitable[T], seconds: float, what: str) -> T:
    async with within(seconds, what):
        return await aw


async def together(*coros: Coroutine[Any, Any, None]) -> None:
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


async def until_lost(probe: Probe, what: str, seconds: float = PROMPT) -> Exception | None:
    return await bounded(asyncio.shield(probe.lost), seconds, f"connection_lost {what}")


class Connections:
    """A listener and the connections made to it, torn down together."""

    def __init__(self, url: str, server_kind: type[Probe]) -> None:
        self.url = url
        self.server_kind = server_kind
        self.accepted: asyncio.Queue[Probe] = asyncio.Queue()
        self.listener: Listener | None = None
        self.probes: list[Probe] = []

    def _accept(self) -> Probe:
        probe = self.server_kind()
        self.probes.append(probe)
        self.accepted.put_nowait(probe)
        return probe

    async def start(self) -> str:
        self.listener = await bounded(listen_stream(self.url, self._accept), STEP, "listen")
        return self.listener.url

    async def next_accepted(self) -> Probe:
        server = await bounded(self.accepted.get(), STEP, "accepting a connection")
        await bounded(server.made, STEP, "connection_made on the accepting side")
        return server

    async def connect(self, client_kind: type[Probe]) -> tuple[Probe, Probe]:
        """A new connection: (accepting end, connecting end)."""
        assert self.listener is not None
        proto = await bounded(connect_stream(self.listener.url, client_kind), STEP, "connect")
        assert isinstance(proto, client_kind), f"connect returned {proto!r}, not the protocol"
        client = proto
        self.probes.append(client)
        await bounded(client.made, STEP, "connection_made on the connecting side")
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
            await bounded(self.listener.aclose(), STEP, "closing the listener")


@contextlib.asynccontextmanager
async def pair(
    url: str, server_kind: type[Probe] = Buffered, client_kind: type[Probe] = Plain
) -> AsyncIterator[tuple[Probe, Probe, Connections]]:
    conns = Connections(url, server_kind)
    try:
        await conns.start()
        server, client = await conns.connect(client_kind)
        yield server, client, conns
    finally:
        await conns.aclose()


def pattern(nbytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


async def send_frames(
    probe: Probe, sizes: Sequence[int], pool: bytes, seed: int, *, empty_writes: bool = False
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


async def frames_arrive(probe: Probe, sizes: Sequence[int], what: str) -> None:
    frames = probe.frames
    assert frames is not None
    await probe.until(lambda: frames.error is not None or len(frames.sizes) >= len(sizes), what)
    assert frames.error is None, f"{what}: {frames.error}"
    assert frames.sizes == list(sizes), f"{what}: frame sizes differ from those sent"
    assert probe.read_while_held == 0


_STREAMER = """
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


async def or_child_exit(aw: Awaitable[T], proc: asyncio.subprocess.Process, what: str) -> T:
    """``await aw``, failing with the child's stderr if it exits first."""
    async with TaskOwner() as tasks:
        task = tasks.start(aw)
        exited = tasks.start(proc.wait())
        try:
            async with within(STEP, what):
                await asyncio.wait([task, exited], return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
            finished = task.done()
            if not finished:
                task.cancel()
    if not finished:
        assert proc.stderr is not None
        err = (await proc.stderr.read()).decode(errors="replace")
        raise AssertionError(f"{what}: the peer process exited ({proc.returncode}):\n{err}")
    return task.result()


async def spawn_streamer(url: str) -> asyncio.subprocess.Process:
    """A separate Python process that connects to ``url`` and writes until the connection ends,
    honouring flow control; its stderr is piped."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _STREAMER,
        url,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
