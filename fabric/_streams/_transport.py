"""The stream-transport seam: a registry of backends chosen by URL scheme.

A backend opens connections and listeners that drive ordinary asyncio protocols, so the call
path (``orchestr._call._client``) runs unchanged over any of them. Built in: ``tcp://``,
``inproc://`` (both ends in this process, see ``_inprocstream``) and, on Linux, ``shm://``
(processes on one host, payload through shared memory, see ``_shmstream``); other data-plane
transports (``rdma://``) register here too. ``tcp://`` runs in mutual TLS once the runtime
installs it for the process (:func:`set_tls`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import ssl
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

import structlog

from ._inproc import InprocStreamTransport
from ._shm import ShmStreamTransport

__all__ = [
    "Listener",
    "StreamTls",
    "StreamTransport",
    "connect_stream",
    "listen_stream",
    "register_stream_transport",
    "set_tls",
    "split_url",
    "stream_transports",
    "tls_contexts",
]

log = structlog.get_logger("orchestr.fabric")

ProtocolFactory = Callable[[], asyncio.BaseProtocol]


class Listener(Protocol):
    @property
    def url(self) -> str: ...

    async def aclose(self) -> None:
        """Stop accepting connections; those accepted live on. Blocks until the listener is
        closed; raises nothing; idempotent and cancel-safe."""
        ...


class StreamTransport(Protocol):
    """What a stream backend provides."""

    async def connect(self, url: str, factory: ProtocolFactory) -> asyncio.BaseProtocol:
        """Open a connection to ``url``; returns the protocol once connected.

        Blocks on the connection (and the TLS handshake when TLS is set); raises ``OSError``
        (``ConnectionError`` naming a failed TLS handshake). Cancel-safe: nothing is left open."""
        ...

    async def listen(self, url: str, factory: ProtocolFactory) -> Listener:
        """Start accepting connections; the listener's ``url`` has the bound port.

        Blocks on binding; raises ``OSError`` (an address in use). Cancel-safe."""
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
    """Connect to ``url`` with the stream backend its scheme names; returns the protocol once
    connected. Blocks and raises as :meth:`StreamTransport.connect`, and
    ``ValueError`` for a scheme with no backend. Cancel-safe."""
    return await _backend(url).connect(url, factory)


async def listen_stream(url: str, factory: ProtocolFactory) -> Listener:
    """Listen at ``url`` with the stream backend its scheme names; the listener's ``url`` has
    the bound port. Blocks and raises as :meth:`StreamTransport.listen`, and
    ``ValueError`` for a scheme with no backend. Cancel-safe."""
    return await _backend(url).listen(url, factory)


class _TcpListener:
    def __init__(self, server: asyncio.base_events.Server, url: str) -> None:
        self._server = server
        self._url = url

    @property
    def url(self) -> str:
        return self._url

    async def aclose(self) -> None:
        """Stop accepting connections; those accepted live on. Blocks until the listener is
        closed; raises nothing; idempotent and cancel-safe."""
        self._server.close()
        await self._server.wait_closed()


#: Seconds a TLS handshake may take before the connection is dropped.
TLS_HANDSHAKE_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class StreamTls:
    """The TLS settings of ``tcp://`` streams: a context for each side."""

    server: ssl.SSLContext
    client: ssl.SSLContext


class _LoggedHandshake(ssl.SSLObject):
    """A server-side TLS session that logs why it refused a peer: asyncio (and uvloop) drop a
    failed handshake silently, before the protocol ever sees the connection."""

    def do_handshake(self) -> None:
        try:
            super().do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise
        except ssl.SSLError as exc:
            if self.server_side:
                log.warning(
                    "refused a data-plane connection: the TLS handshake failed",
                    error=_ssl_reason(exc),
                )
            raise


def _ssl_reason(exc: ssl.SSLError) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {exc.verify_message}"
    return str(exc.reason or exc)


def tls_contexts(cert: str, key: str, ca: str) -> StreamTls:
    """Mutual TLS: each side presents ``cert`` (with ``key``) and accepts only a peer whose
    certificate ``ca`` signed; a client also checks that the server's certificate names the
    address it dialled. Raises ``ssl.SSLError`` or ``OSError`` for unusable files."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname is on
    for context in (server, client):
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_cert_chain(cert, key)
        context.load_verify_locations(ca)
    server.sslobject_class = _LoggedHandshake
    return StreamTls(server, client)


_tls: StreamTls | None = None


def set_tls(tls: StreamTls | None) -> None:
    """Make this process's ``tcp://`` connections and listeners opened from now on use ``tls``
    (``None``: plain TCP). Ones already open keep what they had."""
    global _tls
    _tls = tls


class TcpTransport:
    """TCP with Nagle off (frames are small and latency-bound), in mutual TLS once
    :func:`set_tls` installed it."""

    async def connect(self, url: str, factory: ProtocolFactory) -> asyncio.BaseProtocol:
        """Blocks on the connection (and the TLS handshake when TLS is set); raises ``OSError``
        (``ConnectionError`` naming a failed TLS handshake). Cancel-safe: nothing is left open."""
        _, host, port = split_url(url)
        tls = _tls
        extra: dict[str, Any] = {}
        if tls is not None:
            extra = {
                "ssl": tls.client,
                "server_hostname": host,
                "ssl_handshake_timeout": TLS_HANDSHAKE_TIMEOUT_S,
            }
        try:
            transport, protocol = await asyncio.get_running_loop().create_connection(
                factory, host, port, **extra
            )
        except ssl.SSLError as exc:
            raise ConnectionError(
                f"the TLS handshake with {host}:{port} failed ({_ssl_reason(exc)}): "
                "ORCHESTR_TLS_CA must hold the CA that signed the peer's certificate, which must "
                f"name {host} in its subjectAltName, and the peer must use TLS too"
            ) from exc
        except (ConnectionResetError, ConnectionAbortedError) as exc:
            if tls is None:
                raise
            raise ConnectionError(
                f"{host}:{port} closed the connection during the TLS handshake ({exc}); does it "
                "use TLS?"
            ) from exc
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return protocol

    async def listen(self, url: str, factory: ProtocolFactory) -> Listener:
        """Blocks on binding; raises ``OSError`` (an address in use). Cancel-safe."""
        _, host, port = split_url(url)
        tls = _tls
        extra: dict[str, Any] = {}
        if tls is not None:
            extra = {"ssl": tls.server, "ssl_handshake_timeout": TLS_HANDSHAKE_TIMEOUT_S}
        server = await asyncio.get_running_loop().create_server(factory, host, port, **extra)
        bound = server.sockets[0].getsockname()[1]
        return _TcpListener(server, f"tcp://{host}:{bound}")


register_stream_transport("tcp", TcpTransport())
register_stream_transport("inproc", InprocStreamTransport())
if ShmStreamTransport.available():
    register_stream_transport("shm", ShmStreamTransport())
