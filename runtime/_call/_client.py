"""The call path: actor calls and results as msgpack frames over a stream transport.

This is the hot path, so it avoids per-call tasks and per-frame syscalls: a caller gets a bare
future; the first frame of an event-loop turn is written at once and the rest of the turn's
frames in one write; one socket read can deliver many frames; and an idle actor runs a sync
endpoint straight from the receive callback. The transport underneath comes
from the :mod:`orchestr.fabric` registry by URL scheme (``tcp://`` today).

The caller half lives here, its connections in :mod:`._connection`; the server half is
:mod:`._server` (actors run in :mod:`orchestr._actor._host`), and the messages both speak are in
:mod:`._wire`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from orchestr import fabric
from orchestr.config import Config
from orchestr.errors import (
    AuthenticationError,
    BrokenResourceError,
    CallTimeoutError,
    ClosedResourceError,
    FallbackError,
    OrchestrError,
    ProtocolError,
)
from orchestr.fabric import connect_stream, stream_transports
from orchestr.fabric.lowlevel import connection_sources
from orchestr.tasks import TaskOwner

from ._connection import Connection, Pending
from ._locality import local_url_of_address
from ._lookup import ActorLookup, ActorView, death_of, restarting
from ._serde import lift_large
from ._wire import CALL, SEND, pack_frame_sized

__all__ = ["CallClient", "current_client", "set_current_client"]

log = structlog.get_logger("orchestr.call")


class CallClient:
    """Caller side of the call path: a connection per worker address, opened on first use.

    Owned by one process (the driver or a worker) and used from its event loop only.
    """

    def __init__(self, token: str, config: Config, lookup: ActorLookup | None = None) -> None:
        self.token = token
        self.config = config
        fabric.configure(
            bind_host=config.bind_host,
            fallback=config.transport_fallback,
            stall_timeout=config.transfer_stall_timeout,
        )
        self.lookup = lookup
        self.loop = asyncio.get_running_loop()
        self._connections: dict[str, Connection] = {}
        #: actor id -> the address of its current incarnation, once it was restarted.
        self.moved: dict[str, str] = {}
        #: Addresses of workers the head reported gone, and why: no connection is opened to
        #: them again (a worker cut off by a partition may still run there, given up).
        self._gone: dict[str, BrokenResourceError] = {}
        # Call spans for the job's event log: (start, end, actor, endpoint, ok), at most
        # ``_span_rate`` a second, handed to ``_span_sink`` once a second.
        self._spans: list[tuple[float, float, str, str, bool]] = []
        self._span_quota = 0
        self._span_rate = 0
        self._span_sink: Callable[[list[tuple[float, float, str, str, bool]]], None] | None = None
        self._span_timer: asyncio.TimerHandle | None = None
        self._ids = itertools.count(1)
        self._inflight: dict[str, int] = {}
        self._tasks = TaskOwner()  # connections opening, broken calls settling
        self._closed = False
        connection_sources.append(self.connections)

    def record_spans(
        self, per_s: int, sink: Callable[[list[tuple[float, float, str, str, bool]]], None]
    ) -> None:
        """Time up to ``per_s`` calls a second and hand their spans to ``sink`` once a second
        (the job's event log). Past the rate, calls are not timed: the log stays bounded."""
        self._span_rate = self._span_quota = per_s
        self._span_sink = sink
        if per_s > 0:
            self._span_timer = self.loop.call_later(1.0, self._flush_spans)

    def _flush_spans(self) -> None:
        self._span_quota = self._span_rate
        spans, self._spans = self._spans, []
        if spans and self._span_sink is not None:
            self._span_sink(spans)
        if not self._closed:
            self._span_timer = self.loop.call_later(1.0, self._flush_spans)

    def step_span(self, started: float, graph: str, ok: bool) -> None:
        """Record a compiled graph's step as a span, within the same rate as calls."""
        if self._span_quota:
            self._span_quota -= 1
            self._spans.append((started, time.time(), graph, "step", ok))

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
        retry: bool = False,
    ) -> asyncio.Future[Any]:
        """Send one call; the returned future resolves to its result. With ``retry`` (the
        mesh's at-least-once policy) a call in flight when the actor dies is sent again to its
        restarted incarnation, within the same deadline.

        Raises at once (not through the future) when the arguments cannot be sent.
        """
        future = self.loop.create_future()
        if timeout is None:
            timeout = self.config.call_timeout
        pending = Pending(
            future, actor_id, label, endpoint, timeout, (args, kwargs), fallback, retry
        )
        pending.deadline = self.loop.time() + timeout
        if self._span_quota:
            self._span_quota -= 1
            pending.started = time.time()
        self._submit(self.moved.get(actor_id, address), pending)
        return future

    def _submit(self, address: str, pending: Pending) -> None:
        call_id = next(self._ids)
        conn = self._connection(address)
        sink = conn.bulk.sink(pending.fallback)
        args, kwargs = pending.args
        message = [CALL, call_id, pending.actor_id, pending.endpoint]
        # the deadline travels as wall-clock time: the actor drops a call it reaches too late
        deadline = time.time() + (pending.deadline - self.loop.time())
        message += [lift_large(args), lift_large(kwargs), deadline]
        parts, big = pack_frame_sized(message, self.config.max_message_bytes, sink, self.config)
        pending.timer = self.loop.call_at(pending.deadline, self._expire, conn, call_id)
        self._inflight[pending.actor_id] = self._inflight.get(pending.actor_id, 0) + 1
        if conn.broken is not None:
            if sink is not None:
                sink.abandon()
            self.done(pending)
            self.report_broken([pending], conn.broken, sent=conn.connected, address=address)
            return
        conn.pending[call_id] = pending
        conn.submit(message, parts, big, sink, pending.fallback)

    def send(
        self,
        address: str,
        actor_id: str,
        endpoint: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """Send a call whose result nobody waits for; the actor logs any error it raises."""
        conn = self._connection(self.moved.get(actor_id, address))
        sink = conn.bulk.sink()
        message = [SEND, 0, actor_id, endpoint, lift_large(args), lift_large(kwargs), 0.0]
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
            gone = self._gone.get(address)
            if gone is not None:  # broken from the start: its calls never leave
                conn.abort(gone)
                return conn
            self._connections[address] = conn
            self._spawn(self._open(conn))
        return conn

    def worker_gone(self, address: str, why: str) -> None:
        """The head reports that the worker serving calls at ``address`` is gone (it exited,
        or its node was lost): calls in flight to it are settled now, as for a broken
        connection (sent again to a restarted actor when that is safe, else failed with
        :class:`ActorDiedError`), and later calls to that address never leave. Without this a
        call to a host whose link went silently down (no reset ever comes) would wait for its
        deadline. Never blocks; idempotent."""
        if not address or self._closed:
            return
        gone = BrokenResourceError(f"the head reported the worker at {address} gone: {why}")
        self._gone.setdefault(address, gone)
        conn = self._connections.get(address)
        if conn is not None:
            conn.abort(gone)

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

    def done(self, p: Pending, ok: bool = False) -> None:
        """The call left flight (``ok``: with a result, not an error)."""
        if p.started:
            self._spans.append((p.started, time.time(), p.label, p.endpoint, ok))
            p.started = 0.0
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

    def report_broken(
        self, pending: list[Pending], exc: BaseException, *, sent: bool = True, address: str = ""
    ) -> None:
        """Settle calls whose connection broke: ask the head what became of the actor, then
        send each call again to its restarted incarnation when that is safe (the call never
        left, or it is at-least-once), else fail it with an error that says why."""
        if isinstance(exc, AuthenticationError | ProtocolError | ClosedResourceError):
            for p in pending:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        self._spawn(self._settle_broken(pending, exc, sent, address))

    async def _settle_broken(
        self, pending: list[Pending], exc: BaseException, sent: bool, address: str
    ) -> None:
        views: dict[str, ActorView | None] = {}
        reported_gone = self._gone.get(address) is exc  # worker_gone broke it, or refused it
        for p in pending:
            if p.future.done():
                continue
            resend = p.retry or not sent
            if p.actor_id not in views or (resend and restarting(views[p.actor_id])):
                views[p.actor_id] = await self._look_up(p.actor_id, address, resend)
            view = views[p.actor_id]
            if p.future.done():
                continue
            moved = view is not None and view.state == "alive" and view.address != address
            # Alive where it was reported gone: a new worker took the address; use it again.
            revived = reported_gone and view is not None and view.state == "alive" and not moved
            if (moved or revived) and view is not None:
                if moved:
                    self.moved[p.actor_id] = view.address
                else:
                    self._gone.pop(address, None)
                if resend and not self._closed:
                    if self.loop.time() >= p.deadline:
                        p.future.set_exception(CallTimeoutError(p.label, p.endpoint, p.timeout))
                        continue
                    try:
                        self._submit(view.address, p)
                    except OrchestrError as err:
                        p.future.set_exception(err)
                    _settled(p, address, view, "sent again")
                    continue
            p.future.set_exception(death_of(p, view, exc, moved))
            _settled(p, address, view, "failed")

    async def _look_up(self, actor_id: str, address: str, wait_restart: bool) -> ActorView | None:
        if self.lookup is None:
            return None
        restart_wait = self.config.restart_wait if wait_restart else 0.0
        try:
            return await self.lookup(actor_id, address, restart_wait)
        except OrchestrError:
            return None

    def _spawn(self, coro: Awaitable[None]) -> None:
        self._tasks.start(coro)

    async def aclose(self) -> None:
        """Close every connection and fail calls still pending. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._span_timer is not None:
            self._span_timer.cancel()
            self._flush_spans()
        with contextlib.suppress(ValueError):
            connection_sources.remove(self.connections)
        for conn in list(self._connections.values()):
            conn.abort(ClosedResourceError("the orchestr client was closed"))
        self._connections.clear()
        await self._tasks.aclose()


def _settled(p: Pending, address: str, view: ActorView | None, outcome: str) -> None:
    """Log what became of a call whose connection broke (a rare path: a worker or its host
    lost), so that a call that waits too long says which step it waited in."""
    log.info(
        "a call on a broken connection settled",
        actor=p.label,
        endpoint=p.endpoint,
        address=address,
        state=view.state if view is not None else None,
        now_at=view.address if view is not None else None,
        outcome=outcome,
    )


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
