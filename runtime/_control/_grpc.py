"""Control-plane plumbing: token-checked grpc.aio servers and clients, and the one place where
gRPC errors become orchestr errors (and back)."""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
import structlog

from orchestr import errors
from orchestr._log import Throttled
from orchestr.config import Config
from orchestr.errors import (
    AuthenticationError,
    ControlPlaneError,
    MessageTooLargeError,
    OrchestrError,
)

from . import _signing, _tls

__all__ = ["ControlChannel", "abort_with", "add_port", "make_server"]

log = structlog.get_logger("orchestr.grpc")

_ERROR_KEY = "orchestr-error"


def _options(config: Config) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # A peer that went away (a head restarting) is tried again at least every second,
        # not after gRPC's default backoff of up to two minutes.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def _server_options(config: Config) -> list[tuple[str, Any]]:
    """Limits for whoever connects, before they have shown anything. The receive window is
    held to 256 KiB per stream (no bandwidth probing to grow it): gRPC then buffers that much of
    a request body it has not been asked for, not the whole 64 MiB an unsigned request may
    announce (measured: three 40 MiB requests with a bad token cost the head 250 MB before)."""
    return [
        *_options(config),
        ("grpc.http2.lookahead_bytes", 256 * 1024),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.max_concurrent_streams", 128),
        ("grpc.max_allowed_incoming_connections", config.max_connections),
        ("grpc.server_handshake_timeout_ms", int(config.handshake_timeout * 1000)),
        ("grpc.max_connection_idle_ms", 300_000),
        ("grpc.max_metadata_size", 16 * 1024),
        # one process per port: a second head (or anything else) cannot bind it beside us
        ("grpc.so_reuseport", 0),
    ]


_REFUSAL = "; pass the token the cluster printed at start (ORCHESTR_TOKEN)"


class _SignatureInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Checks each request's signature (:mod:`._signing`): the metadata before the body is
    read, then the body against the digest it signed."""

    def __init__(self, token: str) -> None:
        self._verifier = _signing.Verifier(token.encode())
        self._refused = Throttled(log, "refused a control-plane request")

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        method = details.method
        presented = None
        for key, value in details.invocation_metadata or ():
            if key == _signing.HEADER:
                presented = value if isinstance(value, str) else value.decode("latin-1")
        try:
            digest = self._verifier.check_header(method, presented, time.time())
        except _signing.WrongInstanceError as exc:
            # a caller with the token that has not yet heard of (or from) this instance:
            # the usual first request, not worth a warning
            return _denial(str(exc), self._verifier.instance)
        except AuthenticationError as exc:
            self._refused(method=method, reason=str(exc))
            return _denial(str(exc) + _REFUSAL, self._verifier.instance)
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler  # no method of ours streams requests
        return _checking_body(handler, digest, method)


def _denial(reason: str, instance: str) -> Any:
    async def deny(requests: Any, context: grpc.aio.ServicerContext) -> None:
        # a request-streaming handler that never reads: the body the caller announced is
        # not taken in (its metadata was enough to refuse it)
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            reason,
            trailing_metadata=((_signing.INSTANCE, instance),),
        )

    return grpc.stream_unary_rpc_method_handler(deny)


def _checking_body(handler: Any, digest: str, method: str) -> Any:
    """``handler`` taking the raw body, which must hash to ``digest``, then decoding it."""
    decode = handler.request_deserializer or (lambda body: body)

    async def admit(body: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            _signing.Verifier.check_body(digest, body)
        except AuthenticationError as exc:
            log.warning("refused a control-plane request", method=method, reason=str(exc))
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        return decode(body)

    if handler.unary_unary is not None:
        behaviour = handler.unary_unary

        async def unary(body: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await behaviour(await admit(body, context), context)

        return grpc.unary_unary_rpc_method_handler(
            unary, response_serializer=handler.response_serializer
        )
    streaming = handler.unary_stream

    async def stream(body: bytes, context: grpc.aio.ServicerContext) -> Any:
        result = streaming(await admit(body, context), context)
        if inspect.isasyncgen(result):
            async for item in result:
                yield item
        else:
            await result

    return grpc.unary_stream_rpc_method_handler(
        stream, response_serializer=handler.response_serializer
    )


def make_server(token: str, config: Config) -> grpc.aio.Server:
    """A grpc.aio server that takes only requests signed with the cluster token, with limits
    on connections, streams, handshakes and idle time."""
    return grpc.aio.server(
        interceptors=[_SignatureInterceptor(token)], options=_server_options(config)
    )


def add_port(server: grpc.aio.Server, address: str, config: Config) -> int:
    """Listen on ``address`` (``host:port``, port 0 for any); returns the bound port. With
    ``config.tls`` only clients presenting a certificate the cluster CA signed get through.

    gRPC core refuses failed handshakes without calling Python; it logs each one
    (``Handshake failed with error ...``) to this process's stderr, which the daemons keep
    in their log files."""
    if config.tls:
        return int(server.add_secure_port(address, _tls.server_credentials(config)))
    return int(server.add_insecure_port(address))


_CODES: dict[type[OrchestrError], grpc.StatusCode] = {
    errors.PlacementError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.SpawnError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.SerializationError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
}


async def abort_with(context: grpc.aio.ServicerContext, exc: OrchestrError) -> NoReturn:
    """End an RPC with ``exc`` so the client re-raises the same orchestr error type."""
    code = next((c for t, c in _CODES.items() if isinstance(exc, t)), grpc.StatusCode.INTERNAL)
    context.set_trailing_metadata(((_ERROR_KEY, type(exc).__name__),))
    await context.abort(code, str(exc))
    raise AssertionError("unreachable")  # abort raises


def _translate(
    exc: grpc.aio.AioRpcError, target: str, method: str, tls: bool = False
) -> OrchestrError:
    code = exc.code()
    details = exc.details() or ""
    name = dict(exc.trailing_metadata() or ()).get(_ERROR_KEY)
    cls = getattr(errors, name, None) if isinstance(name, str) else None
    if isinstance(cls, type) and issubclass(cls, OrchestrError) and cls is not MessageTooLargeError:
        return cls(details)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(f"{target} refused {method}: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "message larger than max" in details.lower():
        return ControlPlaneError(
            f"{method} to {target}: {details}; the limit is set by ORCHESTR_MAX_MESSAGE_BYTES"
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        why = _tls.refusal(details, target.rpartition(":")[0], tls)
        if why is not None:
            return AuthenticationError(f"{method} to {target}: {why}")
        return ControlPlaneError(f"cannot reach {target} for {method}: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ControlPlaneError(f"{method} to {target} timed out")
    return ControlPlaneError(f"{method} to {target} failed with {code.name}: {details}")


class ControlChannel:
    """A channel to one control-plane service that signs every request with the token (never
    sending it: :mod:`._signing`), over mutual TLS when the config sets ``tls_*``."""

    def __init__(self, address: str, token: str, config: Config) -> None:
        self.address = address
        self._tls = config.tls
        if config.tls:
            credentials = _tls.channel_credentials(config)
            channel = grpc.aio.secure_channel(address, credentials, options=_options(config))
        else:
            channel = grpc.aio.insecure_channel(address, options=_options(config))
        self._channel = channel
        self._signing = _SigningChannel(channel, token.encode())

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Extra metadata for calls made on a stub directly (streaming methods): none, since
        the stub's channel signs every request itself."""
        return ()

    def stub(self, stub_cls: Callable[[Any], Any]) -> Any:
        """A generated stub whose every method signs its request."""
        return stub_cls(self._signing)

    async def rpc(self, method: Any, request: Any, *, timeout: float | None = 30.0) -> Any:  # noqa: ASYNC109 (passed to grpc as its deadline)
        """Call a stub method; raises the orchestr error matching the failure."""
        name = getattr(method, "_method", b"?")
        try:
            return await method(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            method_name = name.decode() if isinstance(name, bytes) else str(name)
            raise self.translate(exc, method_name) from exc

    def translate(self, exc: grpc.aio.AioRpcError, method: str) -> OrchestrError:
        """The orchestr error for a failed call on this channel, for callers of streaming
        methods (``rpc`` does this itself); raise it ``from exc``."""
        return _translate(exc, self.address, method, self._tls)

    async def aclose(self) -> None:
        await self._channel.close()


class _SigningChannel:
    """What generated stubs are built on: their methods serialize the request themselves,
    sign those very bytes for the server instance last heard of, and hand them to gRPC as they
    are (so the body hashed is the body sent). A request refused as meant for another
    instance (the first one, or the first after the server restarted) is signed again for the
    instance the refusal names and sent once more: it was refused before its body was read."""

    def __init__(self, channel: grpc.aio.Channel, token: bytes) -> None:
        self._channel = channel
        self.token = token
        self.instance = ""

    def sign(
        self, method: str, body: bytes, extra: Any = (), instance: str | None = None
    ) -> tuple[tuple[str, str], ...]:
        instance = self.instance if instance is None else instance
        signature = _signing.sign(self.token, method, body, instance, time.time())
        return (*(extra or ()), (_signing.HEADER, signature))

    def learn(self, exc: grpc.aio.AioRpcError, signed_for: str) -> bool:
        """Whether ``exc`` refused a request signed for ``signed_for`` as meant for another
        instance (the one it names is taken up)."""
        if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
            return False
        instance = dict(exc.trailing_metadata() or ()).get(_signing.INSTANCE)
        if not isinstance(instance, str) or instance == signed_for:
            return False
        self.instance = instance
        return True

    def unary_unary(
        self, method: str, request_serializer: Any, response_deserializer: Any, **_: Any
    ) -> _Unary:
        inner = self._channel.unary_unary(method, response_deserializer=response_deserializer)
        return _Unary(self, inner, method, request_serializer)

    def unary_stream(
        self, method: str, request_serializer: Any, response_deserializer: Any, **_: Any
    ) -> _Streaming:
        inner = self._channel.unary_stream(method, response_deserializer=response_deserializer)
        return _Streaming(self, inner, method, request_serializer)


class _Unary:
    __slots__ = ("_channel", "_inner", "_method", "_serialize")

    def __init__(self, channel: _SigningChannel, inner: Any, method: str, serialize: Any) -> None:
        self._channel = channel
        self._inner = inner
        self._method = method
        self._serialize = serialize

    async def __call__(self, request: Any, *, metadata: Any = (), **kwargs: Any) -> Any:
        body = self._serialize(request)
        channel, method = self._channel, self._method
        instance = channel.instance
        try:
            signed = channel.sign(method, body, metadata, instance)
            return await self._inner(body, metadata=signed, **kwargs)
        except grpc.aio.AioRpcError as exc:
            if not channel.learn(exc, instance):
                raise
        return await self._inner(body, metadata=channel.sign(method, body, metadata), **kwargs)


class _Streaming(_Unary):
    def __call__(self, request: Any, *, metadata: Any = (), **kwargs: Any) -> _Stream:  # type: ignore[override]
        body = self._serialize(request)
        return _Stream(self._channel, self._inner, self._method, body, metadata, kwargs)


class _Stream:
    """A response stream (``wait_for_connection``, ``async for``, ``cancel``, as gRPC's) that
    is opened again, signed for the right instance, if the first try is refused for it."""

    def __init__(
        self,
        channel: _SigningChannel,
        inner: Any,
        method: str,
        body: bytes,
        metadata: Any,
        kwargs: dict[str, Any],
    ) -> None:
        self._channel = channel
        self._signed_for = channel.instance

        def open_() -> Any:
            self._signed_for = channel.instance
            return inner(body, metadata=channel.sign(method, body, metadata), **kwargs)

        self._open = open_
        self._call = open_()
        self._retried = False

    def _again(self, exc: grpc.aio.AioRpcError) -> bool:
        """Open the stream again if ``exc`` refused it for the instance it was signed for."""
        if self._retried or not self._channel.learn(exc, self._signed_for):
            return False
        self._retried = True
        self._call = self._open()
        return True

    async def wait_for_connection(self) -> None:
        try:
            await self._call.wait_for_connection()
        except grpc.aio.AioRpcError as exc:
            if not self._again(exc):
                raise
            await self._call.wait_for_connection()

    async def _first(self) -> Any:
        try:
            return await self._call.read()
        except grpc.aio.AioRpcError as exc:
            if not self._again(exc):
                raise
        return await self._call.read()

    async def _items(self) -> AsyncIterator[Any]:
        item = await self._first()
        while item is not grpc.aio.EOF:
            yield item
            item = await self._call.read()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._items()

    def cancel(self) -> bool:
        return bool(self._call.cancel())
