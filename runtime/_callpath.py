"""The call path: actor calls and results as msgpack frames over a stream transport.

This is the hot path, so it avoids per-call tasks and per-frame syscalls: a caller gets a bare
future; the first frame of an event-loop turn is written at once and the rest of the turn's
frames in one write; one socket read can deliver many frames; and an idle actor runs a sync
endpoint straight from the receive callback. The transport underneath comes
from the :mod:`orchestr.fabric` registry by URL scheme (``tcp://`` today).

The caller half lives here, its connections in :mod:`._callconn`; the server half is
:mod:`._callserver` (actors run in :mod:`._actorhost`), and the messages both speak are in
:mod:`._wire`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

from orchestr import fabric
from orchestr.fabric import _registry as fabric_registry
from orchestr.fabric import connect_stream, stream_transports

from ._callconn import Connection, Pending
from ._locality import local_url_of_address
from ._serde import lift_large
from ._wire import (
    CALL,
    SEND,
    pack_frame_sized,
)
from .config import Config
from .errors import (
    ActorDiedError,
    AuthenticationError,
    BrokenResourceError,
    CallTimeoutError,
    ClosedResourceError,
    FallbackError,
    OrchestrError,
    ProtocolError,
)

__all__ = ["CallClient", "current_client", "set_current_client"]

#: Reports why an actor went away: ``(actor_id) -> description or None``.
DeathReporter = Callable[[str], Awaitable[ActorDiedError | None]]


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
        self._connections: dict[str, Connection] = {}
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
        pending = Pending(future, actor_id, label, endpoint, timeout)
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

    def _connection(self, address: str) -> Connection:
        if self._closed:
            raise ClosedResourceError("this orchestr client was closed; the job has ended")
        conn = self._connections.get(address)
        if conn is None:
            conn = Connection(self, address)
            self._connections[address] = conn
            self._spawn(self._open(conn))
        return conn

    async def _open(self, conn: Connection) -> None:
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

    def done(self, p: Pending) -> None:
        if p.timer is not None:
            p.timer.cancel()
            p.timer = None
        left = self._inflight.get(p.actor_id, 1) - 1
        if left:
            self._inflight[p.actor_id] = left
        else:
            self._inflight.pop(p.actor_id, None)

    def _expire(self, conn: Connection, call_id: int) -> None:
        p = conn.pending.pop(call_id, None)
        if p is None:
            return
        p.timer = None
        self.done(p)
        if not p.future.done():
            p.future.set_exception(CallTimeoutError(p.label, p.endpoint, p.timeout))

    def forget(self, conn: Connection) -> None:
        if self._connections.get(conn.address) is conn:
            del self._connections[conn.address]

    def report_broken(self, pending: list[Pending], exc: BaseException) -> None:
        """Fail calls whose connection broke, asking the head why the actor went away."""
        if isinstance(exc, AuthenticationError | ProtocolError | ClosedResourceError):
            for p in pending:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        self._spawn(self._explain_death(pending, exc))

    async def _explain_death(self, pending: list[Pending], exc: BaseException) -> None:
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
