"""The stream half of the transport conformance suite.

:func:`check_stream_transport` drives a registered stream backend through plain asyncio
protocols of both kinds (``data_received`` and ``BufferedProtocol``) and checks what the call path
relies on: ordering, large and empty frames, flow control both ways, close versus abort, a peer
that dies mid-transfer, and reads bounded by deadlines. Frames here are the suite's own
(``u64 length | u32 sequence | u32 crc32 | payload``), independent of the runtime's; the
protocols, connections and frames they use are in ``_streamharness``.

For backends that cross processes the dying peer is a real subprocess killed with SIGKILL; for
in-process ones (``inproc``) it is emulated with ``abort()`` and the check is reported as
``peer-killed (emulated: in-process)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence

from orchestr.tasks import TaskOwner

from ._harness import (
    HEAD,
    PROMPT,
    STEP,
    Connections,
    Frames,
    MiB,
    Plain,
    Probe,
    SmallBuffered,
    bounded,
    frames_arrive,
    or_child_exit,
    pair,
    pattern,
    send_frames,
    spawn_streamer,
    together,
    until_lost,
    within,
)
from ._transport import stream_transports

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

ORDERED_FRAMES = 2000
MAX_SMALL = 64 * 1024
LARGE = 64 * MiB
BACKPRESSURE_LIMIT = 64 * MiB
CLOSE_BYTES = 8 * MiB
ABORT_BYTES = 32 * MiB


async def _check_ordering(scheme: str, url: str) -> str:
    rng = random.Random(1)
    pool = pattern(MiB + MAX_SMALL, 2)
    ways = [[rng.randint(0, MAX_SMALL) for _ in range(ORDERED_FRAMES)] for _ in range(2)]
    async with pair(url) as (server, client, _):
        server.frames, client.frames = Frames(), Frames()
        async with within(4 * STEP, f"{ORDERED_FRAMES} frames each way"):
            await together(
                send_frames(client, ways[0], pool, 3),
                send_frames(server, ways[1], pool, 4),
                frames_arrive(server, ways[0], "client to server"),
                frames_arrive(client, ways[1], "server to client"),
            )
    return "ordering"


async def _send_large(probe: Probe, large: bytes, seq: int) -> None:
    probe.tx.writelines([HEAD.pack(len(large), seq, zlib.crc32(large)), large])
    await probe.drain()


async def _send_run(probe: Probe, sizes: Sequence[int], first: int) -> None:
    """Small and empty frames (payload bytes 0, 1, 2, ...) with empty writes between them."""
    pool = memoryview(bytes(range(256)) * 2)
    for i, size in enumerate(sizes):
        payload = pool[:size]
        probe.tx.writelines([HEAD.pack(size, first + i, zlib.crc32(payload)), payload])
        probe.tx.write(b"")
    await probe.drain()


async def _check_large(scheme: str, url: str) -> str:
    large = pattern(LARGE, 5)
    rng = random.Random(6)
    run = [0 if i % 2 == 0 else rng.randint(1, 300) for i in range(200)]
    run[50:60] = [0] * 10  # empty frames back to back

    async def client_side(client: Probe) -> None:
        await _send_large(client, large, 0)
        await _send_run(client, run, 1)

    async def server_side(server: Probe) -> None:
        await _send_run(server, run, 0)
        await _send_large(server, large, len(run))

    async with pair(url, server_kind=SmallBuffered) as (server, client, _):
        server.frames, client.frames = Frames(), Frames()
        async with within(4 * STEP, "a 64 MiB frame and a run of empty frames each way"):
            await together(
                client_side(client),
                server_side(server),
                frames_arrive(server, [LARGE, *run], "client to server"),
                frames_arrive(client, [*run, LARGE], "server to client"),
            )
    return "large-and-zero-length"


async def _check_backpressure(scheme: str, url: str) -> str:
    chunk = pattern(64 * 1024, 8)
    async with pair(url) as (server, client, _):
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
        await bounded(client.drain(), STEP, "resume_writing after the reader resumed")
        assert client.resumes >= 1, "writing resumed without resume_writing()"
        for _ in range(64):  # 4 MiB more, now honouring flow control
            await bounded(client.drain(), STEP, "resume_writing")
            client.tx.write(chunk)
            written += len(chunk)
            crc = zlib.crc32(chunk, crc)
        await bounded(server.wait_bytes(written), STEP, f"all {written} bytes to arrive")
        assert server.nbytes == written, f"{server.nbytes} bytes arrived, {written} were written"
        assert server.crc == crc, "the bytes arrived corrupted or out of order"
    return "backpressure"


async def _check_close_abort(scheme: str, url: str) -> str:
    data = pattern(ABORT_BYTES, 9)
    async with pair(url) as (server, client, _):
        for start in range(0, CLOSE_BYTES, MiB):  # flow control ignored: close must flush
            client.tx.write(data[start : start + MiB])
        client.tx.close()
        assert client.tx.is_closing(), "is_closing() is false right after close()"
        exc = await until_lost(server, "at the peer after close()", STEP)
        assert exc is None, f"close() made the peer see connection_lost({exc!r})"
        assert server.nbytes_at_loss == CLOSE_BYTES, (
            f"close() delivered {server.nbytes_at_loss} of {CLOSE_BYTES} bytes before "
            f"connection_lost"
        )
        assert server.crc == zlib.crc32(data[:CLOSE_BYTES]), "close(): the bytes arrived corrupted"
        exc = await until_lost(client, "after close()", STEP)
        assert exc is None, f"close() ended in connection_lost({exc!r})"
        client.tx.close()  # a second close is a no-op

    async with pair(url) as (server, client, _):
        server.tx.pause_reading()
        for start in range(0, ABORT_BYTES, MiB):
            client.tx.write(data[start : start + MiB])
            await asyncio.sleep(0)
        queued = client.tx.get_write_buffer_size()
        assert queued > 0, "nothing queued in the transport for abort() to drop"
        started = time.monotonic()
        client.tx.abort()
        assert client.tx.is_closing(), "is_closing() is false right after abort()"
        await until_lost(client, "after abort()")
        server.tx.resume_reading()
        await until_lost(server, "at the peer after abort()")
        took = time.monotonic() - started
        assert server.nbytes < ABORT_BYTES, (
            f"abort() with {queued} bytes queued still delivered all {ABORT_BYTES} bytes"
        )
        assert server.crc == zlib.crc32(data[: server.nbytes]), "abort(): bytes arrived corrupted"
        assert took < PROMPT, f"the peer saw connection_lost {took:.1f} s after abort()"
    return "close-vs-abort"


async def _check_peer_killed(scheme: str, url: str) -> str:
    conns = Connections(url, Plain)
    try:
        bound = await conns.start()
        if scheme in IN_PROCESS:
            server, client = await conns.connect(Plain)
            chunk = pattern(64 * 1024, 10)

            async def stream() -> None:
                while not client.lost.done():
                    client.tx.write(chunk)
                    await client.can_write.wait()
                    await asyncio.sleep(0)

            async with TaskOwner() as tasks:
                streaming = tasks.start(stream())
                try:
                    await bounded(server.wait_bytes(4 * MiB), STEP, "data from the peer")
                    client.tx.abort()
                    await until_lost(server, "after the peer died")
                finally:
                    streaming.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await streaming
            label = "peer-killed (emulated: in-process)"
        else:
            proc = await spawn_streamer(bound)
            killed = False
            try:
                server = await or_child_exit(conns.next_accepted(), proc, "the peer connecting")
                await or_child_exit(server.wait_bytes(4 * MiB), proc, "data from the peer")
                proc.send_signal(signal.SIGKILL)
                killed = True
                await until_lost(server, "after the peer was killed with SIGKILL")
            finally:
                if not killed and proc.returncode is None:
                    proc.kill()  # once only: a second signal races the child watcher's reaping
                await bounded(proc.communicate(), STEP, "the killed peer to be reaped")
            label = "peer-killed"
        # The listener outlives the dead connection.
        server2, client2 = await conns.connect(Plain)
        client2.tx.write(b"ping")
        await bounded(server2.wait_bytes(4), STEP, "data on a new connection after the kill")
        client2.tx.close()
        await until_lost(server2, "after close() on a new connection")
    finally:
        await conns.aclose()
    return label


async def _check_deadline(scheme: str, url: str) -> str:
    async with pair(url) as (server, client, _):
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
        await bounded(server.wait_bytes(18), STEP, "data after a read timed out")
        server.tx.write(b"pong")
        await bounded(client.wait_bytes(4), STEP, "a reply after a read timed out")
        client.tx.close()
        assert await until_lost(server, "at the peer after close()") is None
        assert await until_lost(client, "after close()") is None
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
    AssertionError naming the check that failed and what happened.

    Blocks on the connections and a peer process it starts. Cancel-safe: everything it
    opened is closed however it ends."""
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
