"""The call path: actor calls and results as msgpack frames over a stream transport.

This is the hot path, so it avoids per-call tasks and per-frame syscalls: a caller gets a bare
future; the first frame of an event-loop turn is written at once and the rest of the turn's
frames in one write; one socket read can deliver many frames; and an idle actor runs a sync
endpoint straight from the receive callback. The transport underneath comes
from the :mod:`orchestr.fabric` registry by URL scheme (``tcp://`` today).

The caller half lives here; the server half, which hosts actors, is :mod:`._callserver`, and
the messages both speak are in :mod:`._wire`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from orchestr import fabric
from orchestr.fabric import _registry as fabric_registry
from orchestr.fabric import connect_stream, stream_transports
from orchestr.fabric._local import process_key

from . import _bulk, _serde
from ._bulk import (
    BulkLink,
    check_probe,
    local_url_of_address,
    peer_is_local,
    peer_of_address,
)
from ._serde import lift_large
from ._wire import (
    CALL,
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
from .config import Config
from .errors import (
    ActorDiedError,
    ActorError,
    AuthenticationError,
    BrokenResourceError,
    CallTimeoutError,
    ClosedResourceError,
    DescriptorError,
    FallbackError,
    OrchestrError,
    ProtocolError,
    TransportError,
)

__all__ = ["CallClient", "current_client", "set_current_client"]

log = structlog.get_logger("orchestr.callpath")

#: Reports why an actor went away: ``(actor_id) -> description or None``.
DeathReporter = Callable[[str], Awaitable[ActorDiedError | None]]


class _Pending:
    __slots__ = ("actor_id", "endpoint", "future", "label", "timeout", "timer")

    def __init__(
        self, future: asyncio.Future[Any], actor_id: str, label: str, endpoint: str, timeout: float
    ) -> None:
        self.future = future
        self.actor_id = actor_id
        self.label = label
        self.endpoint = endpoint
        self.timeout = timeout
        self.timer: asyncio.TimerHandle | None = None


class _Connection(FramedProtocol):
    """One caller-side connection to one worker's call server."""

    def __init__(self, client: CallClient, address: str) -> None:
        super().__init__(*frame_limits(client.config))
        self.client = client
        self.address = address
        self.pending: dict[int, _Pending] = {}
        self.broken: BaseException | None = None
        self.bulk = BulkLink(client.config, self.loop, self._send_release)
        self.bulk.stream = address.partition("://")[0]
        peer = peer_of_address(address)
        local = False
        if peer is not None:
            try:
                local = self.bulk.set_peer(peer)
            except (ValueError, IndexError):
                peer = None
        info = {"process": process_key(), "probe": _bulk.probe() if local or peer is None else None}
        if peer == process_key():  # calling an actor in this very process: prove it is us
            info["self"] = _bulk.self_secret()
        self.out = pack_frame([HELLO, client.token, info], 1 << 20)
        self.welcomed = False
        #: Messages held until WELCOME: (message to encode again with shared memory, or None;
        #: its frame as first encoded; the call's fallback policy).
        self.held: list[tuple[list[Any] | None, list[bytes | memoryview], str | None]] | None
        self.held = None

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
        it (and everything after it waits too, to keep the order)."""
        if self.held is None and not (big and sink is None and self.awaiting_shm()):
            self.bulk.sent(sink)
            self.send(parts)
            return
        if self.held is None:
            self.held = []
        self.held.append((message if big and sink is None else None, parts, fallback))

    def awaiting_shm(self) -> bool:
        return not self.welcomed and self.bulk.same_host and not self.lost

    def _send_held(self) -> None:
        held, self.held = self.held or [], None
        config = self.client.config
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
            self.client.done(pending)
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
        try:
            frames = self.decoder.buffer_updated(nbytes)
        except ProtocolError as exc:
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
                        self.client.done(pending)
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
            self.client.done(pending)
            if pending.future.done():
                continue
            if kind == OK:
                pending.future.set_result(message[2])
            else:
                pending.future.set_exception(_remote_error(message, pending))

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.bulk.lost()
        self.abort(exc or BrokenResourceError(f"{self.address} closed the connection"))

    # -- failure -------------------------------------------------------------------------
    def abort(self, exc: BaseException) -> None:
        """Fail every pending call; the connection is not used again."""
        if self.broken is None:
            self.broken = exc
            self.client.forget(self)
        self.lost = True
        self.held = None
        if self.transport is not None:
            self.transport.abort()
            self.transport = None
        pending, self.pending = self.pending, {}
        for p in pending.values():
            self.client.done(p)
        if pending:
            self.client.report_broken(list(pending.values()), exc)


def _connection_error(message: list[Any], address: str) -> OrchestrError:
    kind, type_name, text = [*message[2:5], "", ""][:3]
    if kind == "auth":
        return AuthenticationError(f"{address} refused the connection: {text}")
    return ProtocolError(f"{address} reported {type_name}: {text}")


def _remote_error(message: list[Any], p: _Pending) -> OrchestrError:
    try:
        _, _, kind, type_name, text, tb = message
    except ValueError:
        return ProtocolError(f"malformed error reply for {p.label}.{p.endpoint}")
    if kind == "too_large":
        return ProtocolError(f"{p.label}.{p.endpoint}: {text}")
    if kind == "transport":
        cls = DescriptorError if "Descriptor" in str(type_name) else TransportError
        return cls(f"{p.label}.{p.endpoint}: the actor could not receive the call: {text}")
    return ActorError(p.label, p.endpoint, str(type_name), str(text), str(tb))


class CallClient:
    """Caller side of the call path: a connection per worker address, opened on first use.

    Owned by one process (the driver or a worker) and used from its event loop only.
    """

    def __init__(
        self, token: str, config: Config, death_reporter: DeathReporter | None = None
    ) -> None:
        self.token = token
        self.config = config
        fabric.configure(bind_host=config.bind_host, fallback=config.transport_fallback)
        self.death_reporter = death_reporter
        self.loop = asyncio.get_running_loop()
        self._connections: dict[str, _Connection] = {}
        self._ids = itertools.count(1)
        self._inflight: dict[str, int] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        fabric_registry.connection_sources.append(self.connections)

    def inflight(self, actor_id: str) -> int:
        """Calls sent to ``actor_id`` from this process that have not finished."""
        return self._inflight.get(actor_id, 0)

    def call(
        self,
        address: str,
        actor_id: str,
        label: str,
        endpoint: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None = None,
        fallback: str | None = None,
    ) -> asyncio.Future[Any]:
        """Send one call; the returned future resolves to its result.

        Raises at once (not through the future) when the arguments cannot be sent.
        """
        call_id = next(self._ids)
        conn = self._connection(address)
        sink = conn.bulk.sink(fallback)
        message = [CALL, call_id, actor_id, endpoint, lift_large(args), lift_large(kwargs)]
        parts, big = pack_frame_sized(message, self.config.max_message_bytes, sink, self.config)
        future = self.loop.create_future()
        if timeout is None:
            timeout = self.config.call_timeout
        pending = _Pending(future, actor_id, label, endpoint, timeout)
        pending.timer = self.loop.call_later(timeout, self._expire, conn, call_id)
        self._inflight[actor_id] = self._inflight.get(actor_id, 0) + 1
        if conn.broken is not None:
            if sink is not None:
                sink.abandon()
            self.report_broken([pending], conn.broken)
            self.done(pending)
            return future
        conn.pending[call_id] = pending
        conn.submit(message, parts, big, sink, fallback)
        return future

    def send(
        self,
        address: str,
        actor_id: str,
        endpoint: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """Send a call whose result nobody waits for; the actor logs any error it raises."""
        conn = self._connection(address)
        sink = conn.bulk.sink()
        message = [SEND, 0, actor_id, endpoint, lift_large(args), lift_large(kwargs)]
        parts, big = pack_frame_sized(message, self.config.max_message_bytes, sink, self.config)
        if conn.broken is not None or conn.lost:
            if sink is not None:
                sink.abandon()
            return
        conn.submit(message, parts, big, sink, None)

    def connections(self) -> list[dict[str, Any]]:
        """What each open connection negotiated: the stream, how large values travel
        (``shm`` or ``inline``), whether the peer is on this host, and any fallback."""
        return [
            {"direction": "out", "address": a, **c.bulk.report()}
            for a, c in self._connections.items()
        ]

    def _connection(self, address: str) -> _Connection:
        if self._closed:
            raise ClosedResourceError("this orchestr client was closed; the job has ended")
        conn = self._connections.get(address)
        if conn is None:
            conn = _Connection(self, address)
            self._connections[address] = conn
            self._spawn(self._open(conn))
        return conn

    async def _open(self, conn: _Connection) -> None:
        target = conn.address
        local = local_url_of_address(target)
        if (
            local is not None
            and conn.bulk.same_host
            and self.config.local_call_transport == "shm"
            and "shm" in stream_transports()
        ):
            try:
                await connect_stream(local, lambda: conn)
            except OSError as exc:
                reason = f"cannot connect to {local}: {exc}"
                if self.config.transport_fallback == "error":
                    conn.abort(FallbackError(f"{reason}; the fallback policy is 'error'"))
                    return
                conn.bulk.stream_fallback(reason)
            else:
                conn.bulk.stream = "shm"
                return
        try:
            await connect_stream(target, lambda: conn)
        except OSError as exc:
            conn.abort(BrokenResourceError(f"cannot connect to {target}: {exc}"))

    def done(self, p: _Pending) -> None:
        if p.timer is not None:
            p.timer.cancel()
            p.timer = None
        left = self._inflight.get(p.actor_id, 1) - 1
        if left:
            self._inflight[p.actor_id] = left
        else:
            self._inflight.pop(p.actor_id, None)

    def _expire(self, conn: _Connection, call_id: int) -> None:
        p = conn.pending.pop(call_id, None)
        if p is None:
            return
        p.timer = None
        self.done(p)
        if not p.future.done():
            p.future.set_exception(CallTimeoutError(p.label, p.endpoint, p.timeout))

    def forget(self, conn: _Connection) -> None:
        if self._connections.get(conn.address) is conn:
            del self._connections[conn.address]

    def report_broken(self, pending: list[_Pending], exc: BaseException) -> None:
        """Fail calls whose connection broke, asking the head why the actor went away."""
        if isinstance(exc, AuthenticationError | ProtocolError | ClosedResourceError):
            for p in pending:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        self._spawn(self._explain_death(pending, exc))

    async def _explain_death(self, pending: list[_Pending], exc: BaseException) -> None:
        reasons: dict[str, ActorDiedError | None] = {}
        for p in pending:
            if p.actor_id not in reasons and self.death_reporter is not None:
                try:
                    reasons[p.actor_id] = await self.death_reporter(p.actor_id)
                except OrchestrError:
                    reasons[p.actor_id] = None
            reason = reasons.get(p.actor_id)
            if p.future.done():
                continue
            if reason is not None:
                err = ActorDiedError(
                    f"{p.label}.{p.endpoint} failed: {reason}",
                    actor=p.label,
                    exit_code=reason.exit_code,
                    signal=reason.signal,
                )
            else:
                err = ActorDiedError(
                    f"{p.label}.{p.endpoint} failed: lost the connection to the actor's worker "
                    f"({exc})",
                    actor=p.label,
                )
            err.__cause__ = exc
            p.future.set_exception(err)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Close every connection and fail calls still pending. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(ValueError):
            fabric_registry.connection_sources.remove(self.connections)
        for conn in list(self._connections.values()):
            conn.abort(ClosedResourceError("the orchestr client was closed"))
        self._connections.clear()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


_current: CallClient | None = None


def set_current_client(client: CallClient | None) -> None:
    """Internal: the client that handles made in this process use."""
    global _current
    _current = client


def current_client() -> CallClient:
    if _current is None:
        raise ClosedResourceError(
            "no orchestr runtime is running in this process; call actors from inside a job "
            "(orchestr.run / orchestr run job.py) or from another actor"
        )
    return _current
