"""The caller's connection to one worker's call server: the handshake that proves both ends
know the cluster token (:mod:`._handshake`) and settles how large values travel
(:mod:`._bulk`), messages held until it has, and the replies coming back.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import structlog

from orchestr.config import Config
from orchestr.errors import (
    ActorError,
    AuthenticationError,
    BrokenResourceError,
    CallTimeoutError,
    DescriptorError,
    OrchestrError,
    ProtocolError,
    TransportError,
)
from orchestr.fabric import process_key

from . import _handshake, _locality, _serde
from ._bulk import BulkLink
from ._locality import check_probe, peer_is_local, peer_of_address
from ._wire import (
    AUTH,
    CALL,
    CHALLENGE,
    ERR,
    HELLO,
    OK,
    READY,
    RELEASE,
    WELCOME,
    FramedProtocol,
    frame_limits,
    pack_frame,
    probe_idle_peer,
    traffic,
)

__all__ = ["Connection", "ConnectionOwner", "Pending"]

log = structlog.get_logger("orchestr.callpath")


class Pending:
    """A call waiting for its reply. It keeps what it sent (references, no copies), so a call
    that never left, or one under at-least-once retry, can be sent again to a restarted actor."""

    __slots__ = (
        "actor_id",
        "args",
        "deadline",
        "endpoint",
        "fallback",
        "future",
        "label",
        "retry",
        "started",
        "timeout",
        "timer",
    )

    def __init__(
        self,
        future: asyncio.Future[Any],
        actor_id: str,
        label: str,
        endpoint: str,
        timeout: float,
        args: tuple[Any, Any] = ((), {}),
        fallback: str | None = None,
        retry: bool = False,
    ) -> None:
        self.future = future
        self.actor_id = actor_id
        self.label = label
        self.endpoint = endpoint
        self.timeout = timeout
        self.deadline = 0.0
        self.args = args
        self.fallback = fallback
        #: At-least-once: sent again to the actor's next incarnation if it dies meanwhile.
        self.retry = retry
        #: When the call was sent (epoch seconds) if its span is recorded, else 0.
        self.started = 0.0
        self.timer: asyncio.TimerHandle | None = None


class ConnectionOwner(Protocol):
    """What a connection needs of whoever opened it (the call client): the settings and token
    it connects with, and where finished and broken calls go. The connection calls nothing
    else of its owner; the owner drives the connection through :meth:`Connection.submit` and
    :meth:`Connection.abort`."""

    config: Config
    token: str

    def done(self, p: Pending, ok: bool = False) -> None:
        """The call ``p`` left flight (``ok``: with a result, not an error)."""

    def forget(self, conn: Connection) -> None:
        """``conn`` broke: open a new one for the next call."""

    def report_broken(
        self, pending: list[Pending], exc: BaseException, *, sent: bool = True, address: str = ""
    ) -> None:
        """Settle ``pending``, whose connection broke with ``exc`` (``sent``: they may have
        reached the worker)."""


class Connection(FramedProtocol):
    """One caller-side connection to one worker's call server."""

    def __init__(self, owner: ConnectionOwner, address: str) -> None:
        super().__init__(*frame_limits(owner.config))
        self.owner = owner
        self.address = address
        self.pending: dict[int, Pending] = {}
        self.broken: BaseException | None = None
        self.bulk = BulkLink(owner.config, self.loop, self._send_release)
        self.bulk.stream = address.partition("://")[0]
        peer = peer_of_address(address)
        local = False
        if peer is not None:
            try:
                local = self.bulk.set_peer(peer)
            except (ValueError, IndexError):
                peer = None
        info: dict[str, Any] = {
            "process": process_key(),
            "probe": _locality.probe() if local or peer is None else None,
        }
        if peer == process_key():  # calling an actor in this very process: prove it is us
            info["self"] = _locality.self_secret()
        #: What AUTH carries besides the proof, once the server has proven itself.
        self.info = info
        self.nonce = _handshake.new_nonce()
        self.out = pack_frame([HELLO, 0, {"nonce": self.nonce}], 1 << 12)
        #: The server proved it knows the token, and we sent our proof.
        self.proven = False
        self.welcomed = False
        #: Messages held until the server has proven itself, and those with large values until
        #: WELCOME: (message to encode again with shared memory, or None; its frame as first
        #: encoded; the call's fallback policy).
        self.held: list[tuple[list[Any] | None, list[bytes | memoryview], str | None]] | None
        self.held = []
        self.held_bytes = 0
        #: Whether the stream was ever open: calls on one that never was were never sent.
        self.connected = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.connected = True
        super().connection_made(transport)
        probe_idle_peer(transport, self.owner.config)

    def submit(
        self,
        message: list[Any],
        parts: list[bytes | memoryview],
        big: int,
        sink: Any,
        fallback: str | None,
    ) -> None:
        """Send one encoded message. Before the handshake has said whether large values may
        go through shared memory, a message carrying them to a server on this host waits for
        it (and everything after it waits too, to keep the order).

        Raises :class:`TransportError`, sending nothing, when over ``max_unsent_bytes`` already
        wait for the peer: an actor that does not keep up (or is stopped) must not make its
        callers grow without bound."""
        limit = self.owner.config.max_unsent_bytes
        waiting = self.unsent() + self.held_bytes
        if waiting > limit:
            if sink is not None:
                sink.abandon()
            raise TransportError(
                f"{self.address} is not taking what this process sends: {waiting} bytes wait "
                f"unsent, over ORCHESTR_MAX_UNSENT_BYTES ({limit}); the actor may be stopped "
                f"or too slow for this rate of calls"
            )
        if self.held is None and not (big and sink is None and self.awaiting_shm()):
            self.bulk.sent(sink)
            self.send(parts)
            return
        if self.held is None:
            self.held = []
        self.held.append((message if big and sink is None else None, parts, fallback))
        self.held_bytes += sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)

    def awaiting_shm(self) -> bool:
        return not self.welcomed and self.bulk.same_host and not self.lost

    def challenge(self, info: Any) -> None:
        """The server's answer to HELLO: check its proof before anything else is sent."""
        server_nonce = _handshake.nonce_of(info)
        identity = _handshake.identity(self.address)
        token = self.owner.token.encode()
        expected = _handshake.proof(token, "server", identity, self.nonce, server_nonce)
        if not _handshake.proves(expected, _handshake.proof_of(info)):
            raise AuthenticationError(
                f"{self.address} did not prove it knows the cluster token: it is not this "
                f"cluster's worker (another process may hold the port of one that exited); "
                f"nothing was sent to it"
            )
        proof = _handshake.proof(token, "client", identity, self.nonce, server_nonce)
        self.proven = True
        self.open_up()
        self.send(pack_frame([AUTH, 0, {"proof": proof, **self.info}], 1 << 20))
        if not self.awaiting_shm():
            self._send_held()

    def _send_held(self) -> None:
        held, self.held = self.held or [], None
        self.held_bytes = 0
        config = self.owner.config
        for message, parts, fallback in held:
            sink = None
            if message is not None:
                sink = self.bulk.sink(fallback)
                if sink is not None:  # shared memory it is: encode it again for that
                    try:
                        parts = pack_frame(message, config.max_message_bytes, sink, config)
                    except OrchestrError as exc:
                        self._fail(message, exc)  # a broadcast has no caller to tell: logged
                        continue
            self.bulk.sent(sink)
            self.send(parts)

    def _fail(self, message: list[Any], exc: OrchestrError) -> None:
        if message[0] != CALL:
            log.error("a broadcast could not be sent", address=self.address, error=str(exc))
            return
        pending = self.pending.pop(message[1], None)
        if pending is not None:
            self.owner.done(pending)
            if not pending.future.done():
                pending.future.set_exception(exc)

    def _send_release(self, items: list[list[int]]) -> None:
        self.send(pack_frame([RELEASE, 0, items], 1 << 30))

    def welcome(self, info: Any) -> None:
        if not isinstance(info, dict) or not isinstance(info.get("process"), str):
            raise ProtocolError("WELCOME carries a map with the server's process")
        self.welcomed = True
        try:
            local = self.bulk.set_peer(info["process"], reachable=peer_is_local(self.transport))
        except (ValueError, IndexError):
            raise ProtocolError(f"malformed process key {info['process']!r}") from None
        if local:
            if info.get("shm") is True:
                self.bulk.can_send = True
            else:
                self.bulk.refuse(str(info.get("reason")))
            reason = check_probe(info.get("probe"), self.bulk.peer_pid)
            self.bulk.can_receive = reason is None
            self.send(pack_frame([READY, 0, {"shm": reason is None, "reason": reason}], 1 << 20))
        elif info.get("shm") is True:  # it offers shared memory; this connection says no
            reason = "this connection does not come from the caller's host"
            self.send(pack_frame([READY, 0, {"shm": False, "reason": reason}], 1 << 20))
        self._send_held()

    def buffer_updated(self, nbytes: int) -> None:
        traffic["received"] += nbytes
        self.counters.received += nbytes
        try:
            frames = self.decoder.buffer_updated(nbytes)
            if not self.proven:
                self._handshake(frames)
                if self.lost or not self.proven:
                    return
                # parsed one at a time until now: what came behind the server's proof
                frames = self.decoder.more()
        except OrchestrError as exc:
            self.abort(exc)
            return
        for msg, extra in frames:
            self.bulk.this_decode = []
            try:
                message = _serde.decode(msg, extra, self.bulk)
                if not (isinstance(message, list) and len(message) >= 3):
                    raise ProtocolError("a reply is an array of at least three items")
                kind, call_id = message[0], message[1]
                if kind in (WELCOME, RELEASE) and call_id == 0:
                    if kind == WELCOME:
                        self.welcome(message[2])
                    else:
                        self.bulk.released(message[2])
                    continue
                if kind not in (OK, ERR) or not isinstance(call_id, int):
                    raise ProtocolError(f"unexpected reply kind {kind!r} or call id {call_id!r}")
            except OrchestrError as exc:
                self.bulk.release_unmapped(msg)
                head = _serde.peek(msg)
                if isinstance(head, list) and len(head) == 3 and head[0] == OK:
                    pending = self.pending.pop(head[1], None) if isinstance(head[1], int) else None
                    if pending is not None:  # a result that cannot be decoded fails its call
                        self.owner.done(pending)
                        if not pending.future.done():
                            pending.future.set_exception(exc)
                        continue
                self.abort(ProtocolError(f"malformed reply from {self.address}: {exc}"))
                return
            pending = self.pending.pop(call_id, None)
            if pending is None:
                if kind == ERR and call_id == 0:
                    self.abort(_connection_error(message, self.address))
                    return
                continue  # the call already timed out or was cancelled
            self.owner.done(pending, kind == OK)
            if pending.future.done():
                continue
            if kind == OK:
                pending.future.set_result(message[2])
            else:
                pending.future.set_exception(_remote_error(message, pending))

    def _handshake(self, frames: list[tuple[memoryview, memoryview]]) -> None:
        """Frames from a server that has not proven itself: only CHALLENGE, or its refusal."""
        for msg, _ in frames:
            message = _serde.decode_plain(msg)
            if not (isinstance(message, list) and len(message) >= 3 and message[1] == 0):
                raise ProtocolError(f"malformed handshake reply from {self.address}")
            if message[0] == CHALLENGE:
                self.challenge(message[2])
                return
            if message[0] == ERR:
                raise _connection_error(message, self.address)
            raise ProtocolError(
                f"{self.address} sent message kind {message[0]!r} before proving itself"
            )

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.bulk.lost()
        self.abort(exc or BrokenResourceError(f"{self.address} closed the connection"))

    # -- failure -------------------------------------------------------------------------
    def abort(self, exc: BaseException) -> None:
        """Fail every pending call; the connection is not used again."""
        if self.broken is None:
            self.broken = exc
            self.owner.forget(self)
        self.lost = True
        self.held = None
        self.held_bytes = 0
        if self.transport is not None:
            self.transport.abort()
            self.transport = None
        pending, self.pending = self.pending, {}
        for p in pending.values():
            self.owner.done(p)
        if pending:
            self.owner.report_broken(
                list(pending.values()), exc, sent=self.connected, address=self.address
            )


def _connection_error(message: list[Any], address: str) -> OrchestrError:
    kind, type_name, text = [*message[2:5], "", ""][:3]
    if kind == "auth":
        return AuthenticationError(f"{address} refused the connection: {text}")
    return ProtocolError(f"{address} reported {type_name}: {text}")


def _remote_error(message: list[Any], p: Pending) -> OrchestrError:
    try:
        _, _, kind, type_name, text, tb = message
    except ValueError:
        return ProtocolError(f"malformed error reply for {p.label}.{p.endpoint}")
    if kind == "too_large":
        return ProtocolError(f"{p.label}.{p.endpoint}: {text}")
    if kind == "timeout":  # the actor gave up on it at the deadline, a moment before we did
        return CallTimeoutError(p.label, p.endpoint, p.timeout)
    if kind == "transport":
        cls = DescriptorError if "Descriptor" in str(type_name) else TransportError
        return cls(f"{p.label}.{p.endpoint}: the actor could not receive the call: {text}")
    return ActorError(p.label, p.endpoint, str(type_name), str(text), str(tb))
