"""Control-plane plumbing: token-checked grpc.aio servers and clients, and the one place where
gRPC errors become orchestr errors (and back)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import grpc
import structlog

from . import _tls, errors
from .config import Config
from .errors import (
    AuthenticationError,
    ControlPlaneError,
    MessageTooLargeError,
    OrchestrError,
)

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


class _TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong orchestr cluster token; pass the token the cluster printed "
                "at start (ORCHESTR_TOKEN)",
            )

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        presented = ""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                presented = value if isinstance(value, str) else value.decode("latin-1")
        if hmac.compare_digest(presented.encode(), self._expected):
            return await continuation(details)
        log.warning("refused a control-plane request", method=details.method, reason="bad token")
        return self._deny


def make_server(token: str, config: Config) -> grpc.aio.Server:
    """A grpc.aio server that refuses requests without the cluster token."""
    return grpc.aio.server(interceptors=[_TokenInterceptor(token)], options=_options(config))


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
    """A channel to one control-plane service that sends the token with every request, over
    mutual TLS when the config sets ``tls_*``."""

    def __init__(self, address: str, token: str, config: Config) -> None:
        self.address = address
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._tls = config.tls
        if config.tls:
            credentials = _tls.channel_credentials(config)
            self._channel = grpc.aio.secure_channel(address, credentials, options=_options(config))
        else:
            self._channel = grpc.aio.insecure_channel(address, options=_options(config))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every request on this channel carries (the token), for streaming calls."""
        return self._metadata

    def stub(self, stub_cls: Callable[[grpc.aio.Channel], Any]) -> Any:
        return stub_cls(self._channel)

    async def rpc(self, method: Any, request: Any, *, timeout: float | None = 30.0) -> Any:  # noqa: ASYNC109 (passed to grpc as its deadline)
        """Call a stub method; raises the orchestr error matching the failure."""
        name = getattr(method, "_method", b"?")
        try:
            return await method(request, metadata=self._metadata, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            method_name = name.decode() if isinstance(name, bytes) else str(name)
            raise self.translate(exc, method_name) from exc

    def translate(self, exc: grpc.aio.AioRpcError, method: str) -> OrchestrError:
        """The orchestr error for a failed call on this channel, for callers of streaming
        methods (``rpc`` does this itself); raise it ``from exc``."""
        return _translate(exc, self.address, method, self._tls)

    async def aclose(self) -> None:
        await self._channel.close()
