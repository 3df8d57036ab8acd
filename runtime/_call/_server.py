"""The serving half of the call path: accepts connections, answers the handshake, decodes
calls and hands them to the actors hosted here (:mod:`orchestr._actor._host` runs them).

Before a caller has proven it knows the cluster token (:mod:`._handshake`), the only thing
read from it is a small handshake frame of plain values: nothing is decoded into objects,
looked up, imported or allocated for it, it has ``handshake_timeout`` seconds, and a listener
holds at most ``max_pending_handshakes`` such callers (and ``max_connections`` in all).
Anything else closes the connection."""

from __future__ import annotations

import contextlib
from typing import Any

import structlog

from orchestr._actor._host import ActorHost
from orchestr._log import Throttled
from orchestr.config import Config
from orchestr.errors import (
    OrchestrError,
    ProtocolError,
)
from orchestr.fabric import Listener, listen_stream, stream_transports
from orchestr.fabric.lowlevel import connection_sources

from . import _handshake, _serde
from ._locality import address_with_process
from ._server_conn import ServerConnection
from ._wire import (
    CALL,
    READY,
    RELEASE,
    SEND,
)

__all__ = ["CallServer"]

log = structlog.get_logger("orchestr.callserver")


class CallServer:
    """Accepts call-path connections and routes calls to the actors hosted in this process."""

    def __init__(self, token: str, config: Config) -> None:
        self.token = token.encode()
        self.config = config
        self.actors: dict[str, ActorHost] = {}
        self.connections: set[ServerConnection] = set()
        #: Open connections by listener (stream scheme), and those not yet authenticated.
        self.counts: dict[str, int] = {}
        #: Connections still in the handshake, oldest first.
        self.pending: dict[ServerConnection, None] = {}
        #: Connections refused or closed unauthenticated (logged at most once a second).
        self.refusals = Throttled(log, "refused a call-path connection")
        self.listener: Listener | None = None
        self.local_listener: Listener | None = None

    @property
    def identity(self) -> str:
        """What handshake proofs are bound to: the address callers dial (see _handshake)."""
        assert self.listener is not None, "serve() first"
        return _handshake.identity(self.listener.url)

    def admit(self, conn: ServerConnection) -> str | None:
        """Take a new connection in, or say why it must be closed at once. When too many are
        in the handshake, the oldest of them goes instead: holding connections open without
        authenticating then locks nobody out who can finish a handshake quickly."""
        limit = self.config.max_connections
        if self.counts.get(conn.stream, 0) >= limit:
            return f"{limit} connections are open (ORCHESTR_MAX_CONNECTIONS)"
        if len(self.pending) >= self.config.max_pending_handshakes:
            oldest = next(iter(self.pending))
            oldest.refuse(
                PermissionError(
                    f"{len(self.pending)} connections were waiting in the handshake "
                    f"(ORCHESTR_MAX_PENDING_HANDSHAKES); this was the oldest"
                )
            )
            oldest.forget()
        self.connections.add(conn)
        self.counts[conn.stream] = self.counts.get(conn.stream, 0) + 1
        self.pending[conn] = None
        return None

    def note_refusal(self, why: str, **context: str) -> None:
        """Count a refused connection and log it (at most once a second)."""
        self.refusals(reason=why, **context)

    @property
    def url(self) -> str:
        """The address callers use; it also names this process (see ``_bulk``)."""
        assert self.listener is not None, "serve() first"
        local = self.local_listener.url if self.local_listener is not None else None
        return address_with_process(self.listener.url, local)

    async def start(self, url: str) -> None:
        """Listen on ``url``, and also on ``shm://`` for callers on this host when
        ``Config.local_call_transport`` is ``"shm"``."""
        scheme = url.partition("://")[0]
        self.listener = await listen_stream(url, lambda: ServerConnection(self, scheme))
        if self.config.local_call_transport == "shm" and "shm" in stream_transports():
            self.local_listener = await listen_stream(
                "shm://", lambda: ServerConnection(self, "shm")
            )
        connection_sources.append(self.connection_report)

    def connection_report(self) -> list[dict[str, Any]]:
        return [{"direction": "in", **c.bulk.report()} for c in self.connections]

    def handle(self, conn: ServerConnection, msg: memoryview, extra: memoryview) -> None:
        """One frame from an authenticated caller."""
        mapped = conn.bulk.mapped
        conn.bulk.this_decode = []
        try:
            message = _serde.decode(msg, extra, conn.bulk)
            if not isinstance(message, list) or len(message) < 2:
                raise ProtocolError("a message must be an array of at least two items")
            kind, call_id = message[0], message[1]
            if not isinstance(call_id, int):
                raise ProtocolError("call id must be an integer")
        except OrchestrError as exc:
            conn.bulk.release_unmapped(msg)
            head = _serde.peek(msg)
            if isinstance(head, list) and len(head) == 7 and head[0] == CALL:
                # the envelope is fine but a value is not (say, a stale shared-memory
                # descriptor): fail this call only
                log.info("undecodable call", call=head[1], error=str(exc))
                if isinstance(head[1], int):
                    conn.error(head[1], "transport", exc)
                return
            log.warning("malformed frame", error=str(exc))
            conn.error(0, "protocol", exc)
            return
        if kind == RELEASE or kind == READY:
            try:
                if kind == RELEASE:
                    conn.bulk.released(message[2])
                else:
                    conn.ready(message[2])
            except (OrchestrError, IndexError, TypeError) as exc:
                conn.error(0, "protocol", ProtocolError(f"malformed message: {exc}"))
            return
        if kind not in (CALL, SEND) or len(message) != 7:
            conn.error(call_id, "protocol", ProtocolError(f"unexpected message kind {kind!r}"))
            return
        _, _, actor_id, endpoint, args, kwargs, deadline = message
        reply_to = conn if kind == CALL else None
        if conn.bulk.mapped != mapped and reply_to is not None:
            conn.mapped_calls.add(call_id)
        host = self.actors.get(actor_id)
        if host is None:
            self._reject(reply_to, call_id, LookupError(f"no actor {actor_id!r} in this worker"))
            return
        entry = host.endpoints.get(endpoint)
        if entry is None:
            names = ", ".join(sorted(n for n in host.endpoints if not n.startswith("__"))) or "none"
            self._reject(
                reply_to,
                call_id,
                AttributeError(f"{host.label} has no endpoint {endpoint!r}; endpoints: {names}"),
            )
            return
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            self._reject(reply_to, call_id, ProtocolError("args must be an array and kwargs a map"))
            return
        if isinstance(deadline, bool) or not isinstance(deadline, int | float):
            self._reject(reply_to, call_id, ProtocolError("a call's deadline is a number"))
            return
        host.submit((reply_to, call_id, entry[0], args, kwargs, float(deadline)))

    def _reject(self, conn: ServerConnection | None, call_id: int, exc: Exception) -> None:
        if conn is None:
            log.error("broadcast call rejected", error=str(exc))
        else:
            conn.error(call_id, "bad_call", exc)

    async def aclose(self) -> None:
        if self.local_listener is not None:
            await self.local_listener.aclose()
            self.local_listener = None
        if self.listener is not None:
            await self.listener.aclose()
            self.listener = None
            with contextlib.suppress(ValueError):
                connection_sources.remove(self.connection_report)
        for conn in list(self.connections):
            conn.close()
        for host in list(self.actors.values()):
            await host.aclose()
        self.actors.clear()
