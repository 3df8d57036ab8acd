"""The call path's framing over the in-host streams: many small frames, large out-of-band
parts, a reply, and frames that wrap the shm ring."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import pytest

from orchestr._call._frames import encode_frame
from orchestr._call._wire import FramedProtocol
from orchestr.fabric import connect_stream, listen_stream, stream_transports

P = TypeVar("P", bound=asyncio.BaseProtocol)

needs_shm = pytest.mark.skipif("shm" not in stream_transports(), reason="shm:// is Linux only")


def _collect(make: Callable[[], P]) -> tuple[Callable[[], P], list[P]]:
    """A protocol factory for a listener, and the list of the protocols it made."""
    made: list[P] = []

    def factory() -> P:
        made.append(make())
        return made[-1]

    return factory, made


class Framed(FramedProtocol):
    """The call path's protocol, recording the frames it decodes."""

    def __init__(self) -> None:
        super().__init__(max_bytes=1 << 30)
        self.open_up()  # the framing as it is once a handshake is done
        self.frames: list[tuple[bytes, bytes]] = []
        self.gone = self.loop.create_future()

    def buffer_updated(self, nbytes: int) -> None:
        for msg, extra in self.decoder.buffer_updated(nbytes):
            self.frames.append((bytes(msg), bytes(extra)))

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.gone.set_result(exc)


async def test_inproc_carries_the_call_path_framing() -> None:
    accept, servers = _collect(Framed)
    listener = await listen_stream("inproc://", accept)
    client = await connect_stream(listener.url, Framed)
    assert isinstance(client, Framed)
    big = bytes(range(256)) * (20 << 12)  # 5 MiB of out-of-band bytes
    for i in range(100):
        client.send(encode_frame(f"m{i}".encode(), []))
    client.send(encode_frame(b"big", [memoryview(big)]))
    server = servers[0]
    for _ in range(200):
        if len(server.frames) == 101:
            break
        await asyncio.sleep(0)
    assert [m for m, _ in server.frames[:100]] == [f"m{i}".encode() for i in range(100)]
    assert server.frames[100] == (b"big", big)
    assert client.transport is not None and server.transport is not None
    server.send(encode_frame(b"reply", []))
    for _ in range(20):
        await asyncio.sleep(0)
    assert client.frames == [(b"reply", b"")]
    client.transport.close()
    assert await asyncio.wait_for(server.gone, 5) is None
    assert await asyncio.wait_for(client.gone, 5) is None
    await listener.aclose()


@needs_shm
async def test_shm_carries_the_call_path_framing_across_the_ring_wrap() -> None:
    accept, servers = _collect(Framed)
    listener = await listen_stream("shm://", accept)
    client = await connect_stream(listener.url, Framed)
    assert isinstance(client, Framed)
    big = bytes(range(256)) * (12 << 12)  # 3 MiB: several frames wrap the 8 MiB ring
    for i in range(8):
        client.send(encode_frame(f"m{i}".encode(), [memoryview(big)]))
        client.send(encode_frame(b"small", []))
    for _ in range(500):
        if servers and len(servers[0].frames) == 16:
            break
        await asyncio.sleep(0.01)
    server = servers[0]
    assert len(server.frames) == 16
    for i in range(8):
        assert server.frames[2 * i] == (f"m{i}".encode(), big)
        assert server.frames[2 * i + 1] == (b"small", b"")
    assert client.transport is not None
    client.transport.close()
    assert await asyncio.wait_for(server.gone, 5) is None
    assert await asyncio.wait_for(client.gone, 5) is None
    await listener.aclose()
