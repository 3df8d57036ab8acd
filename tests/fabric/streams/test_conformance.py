from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from orchestr.fabric import connect_stream, listen_stream, stream_transports
from orchestr.fabric._streams._conformance import CHECKS, DEFAULT_URLS, check_stream_transport
from orchestr.fabric._streams._inproc import InprocStreamTransport

P = TypeVar("P", bound=asyncio.BaseProtocol)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("scheme", stream_transports())
async def test_stream_transport_conformance(scheme: str) -> None:
    if scheme not in DEFAULT_URLS:
        pytest.skip(f"{scheme}:// needs a listen URL the suite cannot make on this machine")
    passed = await check_stream_transport(scheme)
    for name in CHECKS:
        assert any(p == name or p.startswith(f"{name} (") for p in passed), (name, passed)
    if scheme == "inproc":
        assert "peer-killed (emulated: in-process)" in passed


def test_builtin_schemes_registered() -> None:
    assert {"tcp", "inproc"} <= set(stream_transports())


async def test_check_rejects_unknown_scheme() -> None:
    with pytest.raises(ValueError, match="no stream transport"):
        await check_stream_transport("nope")


# -- inproc:// edge cases -------------------------------------------------------------------


class Recorder(asyncio.Protocol):
    def __init__(self, *, keep_open: bool = False) -> None:
        self.transport: asyncio.Transport | None = None
        self.data = bytearray()
        self.events: list[Any] = []
        self.keep_open = keep_open
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.events.append("made")

    def data_received(self, data: bytes) -> None:
        self.data += data

    def eof_received(self) -> bool:
        self.events.append("eof")
        return self.keep_open

    def connection_lost(self, exc: Exception | None) -> None:
        self.events.append(("lost", exc))
        self.lost.set_result(exc)

    @property
    def tx(self) -> asyncio.Transport:
        assert self.transport is not None
        return self.transport


def _collect(make: Callable[[], P]) -> tuple[Callable[[], P], list[P]]:
    """A protocol factory and the list of the protocols it made."""
    made: list[P] = []

    def factory() -> P:
        made.append(make())
        return made[-1]

    return factory, made


async def _pair(
    url: str = "inproc://", **server_kwargs: Any
) -> tuple[Recorder, Recorder, Any, list[Recorder]]:
    accept, servers = _collect(lambda: Recorder(**server_kwargs))
    listener = await listen_stream(url, accept)
    client = await connect_stream(listener.url, Recorder)
    assert isinstance(client, Recorder)
    await asyncio.sleep(0)
    return servers[0], client, listener, servers


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_inproc_unknown_name_refused() -> None:
    with pytest.raises(ConnectionRefusedError) as info:
        await connect_stream("inproc://nobody-listens-here", Recorder)
    assert isinstance(info.value, OSError)
    assert info.value.errno == errno.ECONNREFUSED


async def test_inproc_bad_url() -> None:
    with pytest.raises(ValueError, match="inproc://NAME"):
        await InprocStreamTransport().connect("tcp://x:1", Recorder)


async def test_inproc_listener_names() -> None:
    first = await listen_stream("inproc://", Recorder)
    zero = await listen_stream("inproc://0", Recorder)
    named = await listen_stream("inproc://conformance-named", Recorder)
    try:
        assert first.url.startswith("inproc://") and first.url != "inproc://"
        assert zero.url.startswith("inproc://") and zero.url not in ("inproc://0", first.url)
        assert named.url == "inproc://conformance-named"
        with pytest.raises(OSError) as info:
            await listen_stream("inproc://conformance-named", Recorder)
        assert info.value.errno == errno.EADDRINUSE
    finally:
        for listener in (first, zero, named):
            await listener.aclose()


async def test_inproc_listener_aclose() -> None:
    server, client, listener, _ = await _pair()
    await listener.aclose()
    await listener.aclose()  # idempotent
    with pytest.raises(ConnectionRefusedError):
        await connect_stream(listener.url, Recorder)
    # a connection made before aclose stays up
    client.tx.write(b"still here")
    await _settle()
    assert server.data == b"still here"
    # and the name can be listened on again
    again = await listen_stream(listener.url, Recorder)
    assert again.url == listener.url
    await again.aclose()
    client.tx.close()
    await asyncio.wait_for(server.lost, 5)


async def test_inproc_double_close_idempotent() -> None:
    server, client, listener, _ = await _pair()
    client.tx.write(b"x" * 1000)
    client.tx.close()
    client.tx.close()
    assert client.tx.is_closing()
    assert await asyncio.wait_for(server.lost, 5) is None
    assert await asyncio.wait_for(client.lost, 5) is None
    client.tx.close()
    client.tx.abort()
    server.tx.close()
    await _settle()
    assert server.data == b"x" * 1000
    assert server.events == ["made", "eof", ("lost", None)]
    assert client.events == ["made", ("lost", None)]
    await listener.aclose()


async def test_inproc_write_after_close_ignored_after_eof_raises() -> None:
    server, client, listener, _ = await _pair()
    client.tx.write(b"before")
    client.tx.close()
    client.tx.write(b"after")  # dropped, as asyncio's socket transports do
    client.tx.writelines([b"after", b"too"])
    await asyncio.wait_for(server.lost, 5)
    assert server.data == b"before"

    server2, client2, listener2, _ = await _pair()
    client2.tx.write_eof()
    with pytest.raises(RuntimeError, match="write_eof"):
        client2.tx.write(b"more")
    assert await asyncio.wait_for(server2.lost, 5) is None
    await asyncio.wait_for(client2.lost, 5)
    client2.tx.abort()
    client2.tx.write(b"after abort")  # ignored
    await listener.aclose()
    await listener2.aclose()


async def test_inproc_half_close() -> None:
    server, client, listener, _ = await _pair(keep_open=True)
    client.tx.write(b"request")
    client.tx.write_eof()
    await _settle()
    assert server.events == ["made", "eof"]
    assert not server.tx.is_closing()
    server.tx.write(b"reply")
    server.tx.close()
    assert await asyncio.wait_for(client.lost, 5) is None
    assert await asyncio.wait_for(server.lost, 5) is None
    assert server.data == b"request"
    assert client.data == b"reply"
    assert client.events == ["made", "eof", ("lost", None)]
    await listener.aclose()


async def test_inproc_abort_resets_peer() -> None:
    server, client, listener, _ = await _pair()
    server.tx.pause_reading()
    client.tx.write(b"y" * (3 << 20))
    assert client.tx.get_write_buffer_size() == 3 << 20
    client.tx.abort()
    assert client.tx.get_write_buffer_size() == 0
    assert await asyncio.wait_for(client.lost, 5) is None
    exc = await asyncio.wait_for(server.lost, 5)
    assert isinstance(exc, ConnectionResetError)
    assert server.data == b""
    await listener.aclose()


async def test_inproc_eof_waits_for_resume_reading() -> None:
    server, client, listener, _ = await _pair()
    server.tx.pause_reading()
    assert not server.tx.is_reading()
    client.tx.write(b"abc")
    client.tx.close()
    await _settle()
    assert server.data == b"" and server.events == ["made"]
    server.tx.resume_reading()
    assert await asyncio.wait_for(server.lost, 5) is None
    assert server.data == b"abc"
    assert server.events == ["made", "eof", ("lost", None)]
    await listener.aclose()


async def test_inproc_flow_control_and_limits() -> None:
    class Flow(Recorder):
        def pause_writing(self) -> None:
            self.events.append("pause")

        def resume_writing(self) -> None:
            self.events.append("resume")

    accept, servers = _collect(Recorder)
    listener = await listen_stream("inproc://", accept)
    client = await connect_stream(listener.url, Flow)
    assert isinstance(client, Flow)
    assert client.tx.get_write_buffer_limits() == (256 << 10, 1 << 20)
    client.tx.set_write_buffer_limits(high=1000)
    assert client.tx.get_write_buffer_limits() == (250, 1000)
    await asyncio.sleep(0)
    servers[0].tx.pause_reading()
    client.tx.write(b"z" * 1000)
    assert client.events == ["made"]
    client.tx.write(b"z")
    assert client.events == ["made", "pause"]
    servers[0].tx.resume_reading()
    await _settle()
    assert client.events == ["made", "pause", "resume"]
    assert client.tx.get_write_buffer_size() == 0
    assert servers[0].data == b"z" * 1001
    client.tx.abort()
    await listener.aclose()


async def test_inproc_extra_info() -> None:
    server, client, listener, _ = await _pair("inproc://extra-info")
    assert server.tx.get_extra_info("sockname") == "inproc://extra-info"
    assert client.tx.get_extra_info("peername") == "inproc://extra-info"
    assert client.tx.get_extra_info("socket") is None
    assert client.tx.get_extra_info("missing", 7) == 7
    client.tx.abort()
    await listener.aclose()


async def test_inproc_protocol_error_tears_down() -> None:
    errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))

    class Broken(Recorder):
        def data_received(self, data: bytes) -> None:
            raise ValueError("broken protocol")

    accept, servers = _collect(Broken)
    listener = await listen_stream("inproc://", accept)
    client = await connect_stream(listener.url, Recorder)
    assert isinstance(client, Recorder)
    client.tx.write(b"boom")
    assert isinstance(await asyncio.wait_for(servers[0].lost, 5), ValueError)
    assert isinstance(await asyncio.wait_for(client.lost, 5), ConnectionResetError)
    assert [type(ctx["exception"]) for ctx in errors] == [ValueError]
    await listener.aclose()


async def test_inproc_other_event_loop_refused() -> None:
    listener = await listen_stream("inproc://", Recorder)

    async def from_another_loop() -> None:
        await connect_stream(listener.url, Recorder)

    with pytest.raises(ConnectionRefusedError, match="another event loop"):
        await asyncio.to_thread(asyncio.run, from_another_loop())
    await listener.aclose()


@pytest.mark.parametrize("how", ["close", "abort"])
async def test_inproc_reader_ends_connection_inside_callback(how: str) -> None:
    class Quitter(Recorder):
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            getattr(self.tx, how)()

    accept, servers = _collect(Quitter)
    listener = await listen_stream("inproc://", accept)
    client = await connect_stream(listener.url, Recorder)
    assert isinstance(client, Recorder)
    client.tx.writelines([b"first", b"second", b"third"])
    await asyncio.wait_for(servers[0].lost, 5)
    await asyncio.wait_for(client.lost, 5)
    assert servers[0].data == b"first"
    assert client.tx.get_write_buffer_size() == 0
    await listener.aclose()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("scheme", [s for s in stream_transports() if s in DEFAULT_URLS])
def test_stream_transport_conformance_on_uvloop(scheme: str) -> None:
    uvloop = pytest.importorskip("uvloop")
    passed = uvloop.run(check_stream_transport(scheme))
    assert [p.partition(" (")[0] for p in passed] == list(CHECKS)


# -- shm:// edge cases ----------------------------------------------------------------------

needs_shm = pytest.mark.skipif("shm" not in stream_transports(), reason="shm:// is Linux only")


@needs_shm
async def test_shm_unknown_name_refused() -> None:
    with pytest.raises(ConnectionRefusedError):
        await connect_stream("shm://nobody-listens-here", Recorder)


@needs_shm
async def test_shm_bad_names() -> None:
    with pytest.raises(ValueError, match="shm://"):
        await connect_stream("shm://no/slashes", Recorder)


@needs_shm
async def test_shm_listener_names_and_aclose() -> None:
    named = await listen_stream("shm://conformance-shm-named", Recorder)
    generated = await listen_stream("shm://", Recorder)
    assert named.url == "shm://conformance-shm-named"
    assert generated.url.startswith("shm://") and generated.url != "shm://"
    with pytest.raises(OSError) as info:
        await listen_stream(named.url, Recorder)
    assert info.value.errno == errno.EADDRINUSE
    await generated.aclose()
    await generated.aclose()  # idempotent
    with pytest.raises(ConnectionRefusedError):
        await connect_stream(generated.url, Recorder)
    await named.aclose()


@needs_shm
async def test_shm_connection_outlives_listener_and_half_closes() -> None:
    server, client, listener, _ = await _pair("shm://", keep_open=True)
    assert isinstance(client.tx.get_extra_info("peer_pid"), int)
    await listener.aclose()
    client.tx.write(b"request")
    client.tx.write_eof()
    for _ in range(100):
        if "eof" in server.events:
            break
        await asyncio.sleep(0.01)
    assert server.events == ["made", "eof"] and server.data == b"request"
    server.tx.write(b"reply")
    server.tx.close()
    assert await asyncio.wait_for(client.lost, 5) is None
    assert await asyncio.wait_for(server.lost, 5) is None
    assert client.data == b"reply"
    assert client.events == ["made", "eof", ("lost", None)]


@needs_shm
async def test_shm_garbage_hello_does_not_stop_the_listener() -> None:
    import socket

    from orchestr.fabric._streams._shm import _address

    accept, servers = _collect(Recorder)
    listener = await listen_stream("shm://", accept)
    name = listener.url.removeprefix("shm://")
    loop = asyncio.get_running_loop()
    for junk in (b"", b"hello, no descriptors" + bytes(100)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.setblocking(False)
            await loop.sock_connect(sock, _address(name))
            if junk:
                await loop.sock_sendall(sock, junk)
            else:
                sock.shutdown(socket.SHUT_WR)
            try:  # refused: closed without an answer
                assert await asyncio.wait_for(loop.sock_recv(sock, 100), 5) == b""
            except ConnectionResetError:
                pass
    assert servers == []
    client = await connect_stream(listener.url, Recorder)
    assert isinstance(client, Recorder)
    client.tx.write(b"fine")
    for _ in range(100):
        if servers and servers[0].data == b"fine":
            break
        await asyncio.sleep(0.01)
    assert servers[0].data == b"fine"
    client.tx.abort()
    assert isinstance(await asyncio.wait_for(servers[0].lost, 5), ConnectionResetError)
    await listener.aclose()
