"""The serving half of the call path: accepts connections, answers the handshake, decodes
calls and hands them to the actors hosted here (:mod:`orchestr._actor._host` runs them).

Before a caller has proven it knows the cluster token (:mod:`._handshake`), the only thing
read from it is a small handshake frame of plain values: nothing is decoded into objects,
looked up, imported or allocated for it, it has ``handshake_timeout`` seconds, and a listener
holds at most ``max_pending_handshakes`` such callers (and ``max_connections`` in all).
Anything else closes the connection."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog

from orchestr._actor._host import ActorHost
from orchestr._log import Throttled
from orchestr.config import Config
from orchestr.errors import (
    MessageTooLargeError,
    OrchestrError,
    ProtocolError,
    SerializationError,
    TransportError,
)
from orchestr.fabric import Listener, listen_stream, process_key, stream_transports
from orchestr.fabric.lowlevel import connection_sources

from . import _handshake, _serde
from ._bulk import BulkLink
from ._locality import address_with_process, check_probe, peer_is_local, probe, self_secret
from ._serde import lift_large
from ._wire import (
    AUTH,
    CALL,
    CHALLENGE,
    ERR,
    HELLO,
    OK,
    READY,
    RELEASE,
    SEND,
    WELCOME,
    FramedProtocol,
    frame_limits,
    pack_frame,
    pack_frame_sized,
    traffic,
)

__all__ = ["CallServer"]

log = structlog.get_logger("orchestr.callserver")


class _ServerConnection(FramedProtocol):
    def __init__(self, server: CallServer, stream: str) -> None:
        super().__init__(*frame_limits(server.config))
        self.server = server
        self.stream = stream
        self.authed = False
        #: The caller's HELLO nonce and ours, once it has said HELLO.
        self.nonces: tuple[bytes, bytes] | None = None
        self.deadline: asyncio.TimerHandle | None = None
        self.mapped_calls: set[int] = set()
        self.ready_seen = False
        #: Large results held until READY says whether they may go through shared memory.
        self.held: list[list[Any]] = []
        self.bulk = BulkLink(server.config, self.loop, self._send_release)
        self.bulk.stream = stream

    def _send_release(self, items: list[list[int]]) -> None:
        self.send(pack_frame([RELEASE, 0, items], 1 << 30))

    # -- the handshake (see _handshake) -----------------------------------------------------
    def handshake(self, msg: memoryview) -> None:
        """One frame from a caller that has not proven itself yet."""
        try:
            message = _serde.decode_plain(msg)
            if not (
                isinstance(message, list)
                and len(message) == 3
                and message[1] == 0
                and isinstance(message[2], dict)
            ):
                raise ProtocolError("a handshake message is [kind, 0, {...}]")
            kind, info = message[0], message[2]
            if kind == HELLO and self.nonces is None:
                self.challenge(_handshake.nonce_of(info))
                return
            if kind == AUTH and self.nonces is not None:
                self.authenticate(info)
                return
            raise ProtocolError(f"message kind {kind!r} before the handshake was done")
        except (ProtocolError, PermissionError) as exc:
            self.refuse(exc)

    def challenge(self, client_nonce: bytes) -> None:
        server_nonce = _handshake.new_nonce()
        self.nonces = (client_nonce, server_nonce)
        proof = _handshake.proof(
            self.server.token, "server", self.server.identity, client_nonce, server_nonce
        )
        self.send(pack_frame([CHALLENGE, 0, {"nonce": server_nonce, "proof": proof}], 1 << 12))

    def authenticate(self, info: dict[str, Any]) -> None:
        assert self.nonces is not None
        expected = _handshake.proof(self.server.token, "client", self.server.identity, *self.nonces)
        if not _handshake.proves(expected, info.get("proof")):
            raise PermissionError("missing or wrong cluster token")
        self.authed = True
        self.cancel_deadline()
        self.server.pending.pop(self, None)
        self.open_up()
        self.hello(info)

    def refuse(self, exc: Exception) -> None:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        self.server.note_refusal(str(exc), peer=str(peer), stream=self.stream)
        self.error(0, "auth", exc)
        self.close()

    def handshake_expired(self) -> None:
        self.deadline = None
        if not self.authed and not self.lost:
            self.refuse(
                PermissionError(
                    f"the handshake was not done within {self.server.config.handshake_timeout} s"
                )
            )

    def cancel_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def hello(self, info: dict[str, Any]) -> None:
        """Answer the caller's handshake: can each side map the other's shared memory?"""
        if not isinstance(info.get("process"), str):
            # a caller that offers nothing gets everything inline
            self.send(pack_frame([WELCOME, 0, {"process": process_key(), "shm": False}], 1 << 20))
            return
        reachable = peer_is_local(self.transport)
        if info["process"] == process_key() and info.get("self") != self_secret():
            reachable = False  # claims to be this process without knowing its secret
        try:
            local = self.bulk.set_peer(info["process"], reachable=reachable)
        except (ValueError, IndexError):
            raise ProtocolError(f"malformed process key {info['process']!r}") from None
        reason = None
        if local:
            reason = check_probe(info.get("probe"), self.bulk.peer_pid)
            self.bulk.can_receive = reason is None
        welcome = {
            "process": process_key(),
            "probe": probe() if self.bulk.can_receive else None,
            "shm": self.bulk.can_receive,
            "reason": reason,
        }
        self.send(pack_frame([WELCOME, 0, welcome], 1 << 20))

    def ready(self, info: Any) -> None:
        if not isinstance(info, dict):
            raise ProtocolError("READY carries a map")
        if not self.bulk.can_receive or self.ready_seen:
            return  # we never offered shared memory on this connection, or heard already
        self.ready_seen = True
        if info.get("shm") is True:
            self.bulk.can_send = True
        else:
            self.bulk.refuse(str(info.get("reason")))
        held, self.held = self.held, []
        for message in held:
            self.ok(message[1], message[2])

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        server = self.server
        full = server.admit(self)
        if full is not None:
            server.note_refusal(full)
            self.lost = True
            transport.close()
            self.transport = None
            return
        self.deadline = self.loop.call_later(
            server.config.handshake_timeout, self.handshake_expired
        )

    def forget(self) -> None:
        """Leave the server's books (closed by us, or lost)."""
        self.cancel_deadline()
        server = self.server
        if self in server.connections:
            server.connections.discard(self)
            server.counts[self.stream] -= 1
            server.pending.pop(self, None)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.forget()
        self.bulk.lost()

    def buffer_updated(self, nbytes: int) -> None:
        traffic["received"] += nbytes
        self.counters.received += nbytes
        try:
            frames = self.decoder.buffer_updated(nbytes)
            while frames:
                handshaking = self.decoder.single
                for msg, extra in frames:
                    if self.authed:
                        self.server.handle(self, msg, extra)
                    else:
                        self.handshake(msg)
                    if self.transport is None:
                        return
                # a handshake is parsed one frame at a time: parse what came behind it now,
                # under the limits the handshake left in force
                frames = self.decoder.more() if handshaking else []
        except ProtocolError as exc:
            if not self.authed:
                self.refuse(exc)
                return
            log.warning("closing connection after an oversized frame", error=str(exc))
            self.error(0, "too_large", exc)
            self.close()
            return

    # -- replies (a caller that went away gets none; its client fails the call) ------------
    def ok(self, call_id: int, value: Any) -> None:
        if self.transport is not None and self.unsent() > self.server.config.max_unsent_bytes:
            # the caller does not take its results: drop it rather than hold them all
            log.warning(
                "closing a call connection whose caller does not read its results",
                unsent=self.unsent(),
                limit=self.server.config.max_unsent_bytes,
            )
            self.lost = True
            self.transport.abort()
            return
        sink = self.bulk.sink()
        message = [OK, call_id, lift_large(value)]
        config = self.server.config
        try:
            parts, big = pack_frame_sized(message, config.max_message_bytes, sink, config)
        except (SerializationError, MessageTooLargeError, TransportError) as exc:
            self.error(call_id, "raised", exc, note="while sending the result")
            return
        if self.lost:
            if sink is not None:
                sink.abandon()
            return
        if big and sink is None and self.bulk.can_receive and not self.ready_seen:
            # the caller has not yet said whether it maps our memory: hold large results
            self.held.append(message)
            return
        self.bulk.sent(sink)
        if call_id in self.mapped_calls:
            # the call's arguments came through shared memory: answer once they are dropped,
            # after their releases, so the caller can reuse those segments for its next call
            self.mapped_calls.discard(call_id)
            self.loop.call_soon(self._reply_after_release, parts)
            return
        self.send(parts)

    def _reply_after_release(self, parts: list[bytes | memoryview]) -> None:
        self.bulk.flush()
        self.send(parts)

    def error(
        self, call_id: int, kind: str, exc: BaseException, *, tb: str = "", note: str = ""
    ) -> None:
        self.mapped_calls.discard(call_id)
        text = f"{exc} ({note})" if note else str(exc)
        message = [ERR, call_id, kind, type(exc).__name__, text, tb]
        self.send(pack_frame(message, 1 << 30))

    def close(self) -> None:
        self.flush()
        self.lost = True
        if self.transport is not None:
            self.transport.close()
            self.transport = None


class CallServer:
    """Accepts call-path connections and routes calls to the actors hosted in this process."""

    def __init__(self, token: str, config: Config) -> None:
        self.token = token.encode()
        self.config = config
        self.actors: dict[str, ActorHost] = {}
        self.connections: set[_ServerConnection] = set()
        #: Open connections by listener (stream scheme), and those not yet authenticated.
        self.counts: dict[str, int] = {}
        #: Connections still in the handshake, oldest first.
        self.pending: dict[_ServerConnection, None] = {}
        #: Connections refused or closed unauthenticated (logged at most once a second).
        self.refusals = Throttled(log, "refused a call-path connection")
        self.listener: Listener | None = None
        self.local_listener: Listener | None = None

    @property
    def identity(self) -> str:
        """What handshake proofs are bound to: the address callers dial (see _handshake)."""
        assert self.listener is not None, "serve() first"
        return _handshake.identity(self.listener.url)

    def admit(self, conn: _ServerConnection) -> str | None:
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
        self.listener = await listen_stream(url, lambda: _ServerConnection(self, scheme))
        if self.config.local_call_transport == "shm" and "shm" in stream_transports():
            self.local_listener = await listen_stream(
                "shm://", lambda: _ServerConnection(self, "shm")
            )
        connection_sources.append(self.connection_report)

    def connection_report(self) -> list[dict[str, Any]]:
        return [{"direction": "in", **c.bulk.report()} for c in self.connections]

    def handle(self, conn: _ServerConnection, msg: memoryview, extra: memoryview) -> None:
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

    def _reject(self, conn: _ServerConnection | None, call_id: int, exc: Exception) -> None:
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
