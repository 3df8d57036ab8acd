"""The stream-transport seam: a registry of backends chosen by URL scheme.

A backend opens connections and listeners that drive ordinary asyncio protocols, so the call
path (``orchestr._callpath``) runs unchanged over any of them. Built in: ``tcp://``,
``inproc://`` (both ends in this process, see ``_inprocstream``) and, on Linux, ``shm://``
(processes on one host, payload through shared memory, see ``_shmstream``); other data-plane
transports (``rdma://``) register here too.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Protocol
from urllib.parse import urlsplit

from ._inprocstream import InprocStreamTransport
from ._shmstream import ShmStreamTransport

__all__ = [
    "Listener",
    "StreamTransport",
    "connect_stream",
    "listen_stream",
    "register_stream_transport",
    "split_url",
    "stream_transports",
]

ProtocolFactory = Callable[[], asyncio.BaseProtocol]


class Listener(Protocol):
    @property
    def url(self) -> str: ...

    async def aclose(self) -> None: ...


class StreamTransport(Protocol):
    """What a stream backend provides."""

    async def connect(self, url: str, factory: ProtocolFactory) -> asyncio.BaseProtocol:
        """Open a connection to ``url``; returns the protocol once connected."""
        ...

    async def listen(self, url: str, factory: ProtocolFactory) -> Listener:
        """Start accepting connections; the listener's ``url`` has the bound port."""
        ...


_registry: dict[str, StreamTransport] = {}


def register_stream_transport(scheme: str, transport: StreamTransport) -> None:
    """Make ``scheme://`` URLs use ``transport``. A later registration replaces an earlier one."""
    _registry[scheme] = transport


def stream_transports() -> list[str]:
    return sorted(_registry)


def split_url(url: str) -> tuple[str, str, int]:
    """``scheme://host:port`` -> parts; raises ValueError with the URL for anything else."""
    parts = urlsplit(url)
    if not parts.scheme or parts.hostname is None or parts.port is None:
        raise ValueError(f"expected an address like tcp://127.0.0.1:5000, got {url!r}")
    return parts.scheme, parts.hostname, parts.port


def _backend(url: str) -> StreamTransport:
    scheme = url.partition("://")[0]
    try:
        return _registry[scheme]
    except KeyError:
        raise ValueError(
            f"no stream transport for {scheme!r} in {url!r}; known: {', '.join(stream_transports())}"
        ) from None


async def connect_stream(url: str, factory: ProtocolFactory) -> asyncio.BaseProtocol:
    return await _backend(url).connect(url, factory)


async def listen_stream(url: str, factory: ProtocolFactory) -> Listener:
    return await _backend(url).listen(url, factory)


class _TcpListener:
    def __init__(self, server: asyncio.base_events.Server, url: str) -> None:
        self._server = server
        self._url = url

    @property
    def url(self) -> str:
        return self._url

    async def aclose(self) -> None:
        self._server.close()
        await self._server.wait_closed()


class TcpTransport:
    """Plain TCP with Nagle off: frames are small and latency-bound."""

    async def connect(self, url: str, factory: ProtocolFactory) -> asyncio.BaseProtocol:
        _, host, port = split_url(url)
        transport, protocol = await asyncio.get_running_loop().create_connection(
            factory, host, port
        )
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return protocol

    async def listen(self, url: str, factory: ProtocolFactory) -> Listener:
        _, host, port = split_url(url)
        server = await asyncio.get_running_loop().create_server(factory, host, port)
        bound = server.sockets[0].getsockname()[1]
        return _TcpListener(server, f"tcp://{host}:{bound}")


register_stream_transport("tcp", TcpTransport())
register_stream_transport("inproc", InprocStreamTransport())
if ShmStreamTransport.available():
    register_stream_transport("shm", ShmStreamTransport())
