"""The worker's side of one caller's connection: the handshake that admits it, the frames it
reads, and the results and errors it writes back (:class:`~._server.CallServer` owns them)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import structlog

from orchestr.errors import (
    MessageTooLargeError,
    ProtocolError,
    SerializationError,
    TransportError,
)
from orchestr.fabric import process_key

from . import _handshake, _serde
from ._bulk import BulkLink
from ._locality import check_probe, peer_is_local, probe, self_secret
from ._serde import lift_large
from ._wire import (
    AUTH,
    CHALLENGE,
    ERR,
    HELLO,
    OK,
    RELEASE,
    WELCOME,
    FramedProtocol,
    frame_limits,
    pack_frame,
    pack_frame_sized,
    traffic,
)

if TYPE_CHECKING:
    from ._server import CallServer

__all__ = ["ServerConnection"]

log = structlog.get_logger("orchestr.callserver")


class ServerConnection(FramedProtocol):
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
