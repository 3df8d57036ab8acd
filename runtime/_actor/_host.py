"""One live actor in its worker: its endpoints, its mailbox, and how calls run.

Ordering: calls to one actor run one at a time in arrival order, and a connection delivers one
caller's frames in the order they were sent, so one caller's messages are processed in order.
Endpoints marked ``concurrent=True`` skip the queue. An idle actor runs a sync endpoint
directly from the receive callback; everything else goes through the actor's mailbox task.

Each endpoint counts the calls it started and those that raised (two integers, bumped on the
hot path); :meth:`ActorHost.stats` reads them with the mailbox's depth for the head's metrics.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import time
import traceback
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from orchestr.tasks import TaskOwner

from ._actor import Actor, EndpointSpec, saves_state
from ._distributed import JOIN_ENDPOINT, STORE_ENDPOINT, join, open_store

if TYPE_CHECKING:
    from orchestr._stats import ActorStats

__all__ = ["ActorHost", "Counts", "Item", "Replies"]

log = structlog.get_logger("orchestr.callserver")


class Replies(Protocol):
    """Where a call's answer goes (the caller's connection)."""

    def ok(self, call_id: int, value: Any) -> None: ...

    def error(
        self, call_id: int, kind: str, exc: BaseException, *, tb: str = "", note: str = ""
    ) -> None: ...


# (where to reply, or None for a broadcast; call id; endpoint; args; kwargs)
#: (where to reply, call id, endpoint, args, kwargs, the caller's deadline in wall-clock
#: seconds or 0 for none)
Item = tuple[Replies | None, int, EndpointSpec, Any, Any, float]


def _signature(fn: Any) -> str:
    try:
        return str(inspect.signature(fn, eval_str=True))
    except Exception:  # annotations that do not evaluate here; show them as written
        return str(inspect.signature(fn))


class Counts:
    """One endpoint's calls: started, those of them that raised, and those dropped because
    their deadline had passed before they started."""

    __slots__ = ("calls", "dropped", "errors")

    def __init__(self) -> None:
        self.calls = 0
        self.errors = 0
        self.dropped = 0


class ActorHost:
    """One live actor: its instance, its endpoints and its mailbox."""

    def __init__(self, instance: Actor, label: str, actor_id: str = "") -> None:
        self.instance = instance
        self.label = label
        self.actor_id = actor_id
        self.endpoints: dict[str, tuple[EndpointSpec, Any]] = {
            name: (spec, getattr(instance, name))
            for name, spec in instance._orchestr_endpoints.items()
        }
        #: Calls by endpoint name; an entry is made on an endpoint's first call.
        self.counts: collections.defaultdict[str, Counts] = collections.defaultdict(Counts)
        # Every actor can join a torch.distributed group of its mesh (see _distributed); the
        # join blocks until all members have, so it runs in a thread.
        self.endpoints[STORE_ENDPOINT] = (EndpointSpec(STORE_ENDPOINT, False, False), open_store)
        self.endpoints[JOIN_ENDPOINT] = (EndpointSpec(JOIN_ENDPOINT, False, True), join)
        if saves_state(type(instance)):  # in order with the actor's other calls
            self.endpoints["__save_state__"] = (
                EndpointSpec("__save_state__", False, False),
                instance.save_state,
            )
        self.mailbox: collections.deque[Item] = collections.deque()
        self.busy = False
        self.waiter: asyncio.Future[None] | None = None
        self.tasks = TaskOwner()  # the calls of concurrent endpoints in flight
        self._runs = TaskOwner()  # the mailbox's runner
        self.runner = self._runs.start(self._run())

    def submit(self, item: Item) -> None:
        spec = item[2]
        if spec.concurrent:
            self.tasks.start(self._invoke(item))
        elif not self.busy and not self.mailbox and not spec.is_async:
            self.busy = True
            try:
                self._invoke_sync(item)
            finally:
                self.busy = False
        else:
            self.mailbox.append(item)
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.mailbox:
                self.waiter = loop.create_future()
                await self.waiter
                continue
            item = self.mailbox.popleft()
            self.busy = True
            try:
                if item[2].is_async:
                    await self._invoke(item)
                else:
                    self._invoke_sync(item)
            finally:
                self.busy = False
                # drop the arguments now, not at the next call: values that came through
                # shared memory go back to their sender when they are freed
                del item

    def _too_late(self, item: Item) -> bool:
        """Whether ``item``'s caller has given up already; then it is answered, not run."""
        conn, call_id, spec, _, _, deadline = item
        if not deadline or time.time() <= deadline:
            return False
        self.counts[spec.name].dropped += 1
        log.info("dropped a call past its deadline", actor=self.label, endpoint=spec.name)
        if conn is not None:
            conn.error(call_id, "timeout", TimeoutError("its deadline passed before it started"))
        return True

    def _invoke_sync(self, item: Item) -> None:
        if self._too_late(item):
            return
        conn, call_id, spec, args, kwargs, _ = item
        fn = self.endpoints[spec.name][1]
        self.counts[spec.name].calls += 1
        try:
            value = fn(*args, **kwargs)
        except Exception as exc:
            self._failed(item, exc)
        else:
            if conn is not None:
                conn.ok(call_id, value)

    async def _invoke(self, item: Item) -> None:
        if self._too_late(item):
            return
        conn, call_id, spec, args, kwargs, deadline = item
        fn = self.endpoints[spec.name][1]
        self.counts[spec.name].calls += 1
        # a cancel-safe endpoint is cancelled where it runs once its caller's deadline passes
        limit = asyncio.timeout(deadline - time.time() if spec.cancel_safe and deadline else None)
        try:
            if spec.is_async:
                async with limit:
                    value = await fn(*args, **kwargs)
            else:
                value = await asyncio.to_thread(fn, *args, **kwargs)
        except TimeoutError as exc:
            if limit.expired():
                log.info("cancelled a call at its deadline", actor=self.label, endpoint=spec.name)
                if conn is not None:
                    conn.error(call_id, "timeout", TimeoutError("cancelled at its deadline"))
            else:
                self._failed(item, exc)
        except Exception as exc:
            self._failed(item, exc)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the actor is stopping
            # the endpoint's own code let a cancellation escape: an error for this call only
            self._failed(item, RuntimeError(f"endpoint was cancelled from inside: {exc!r}"))
        else:
            if conn is not None:
                conn.ok(call_id, value)

    def _failed(self, item: Item, exc: Exception) -> None:
        conn, call_id, spec, args, kwargs, _ = item
        fn = self.endpoints[spec.name][1]
        self.counts[spec.name].errors += 1
        tb = traceback.format_exc()
        kind = "raised"
        if isinstance(exc, TypeError):
            try:
                inspect.signature(fn).bind(*args, **kwargs)
            except TypeError as bind_exc:
                kind = "bad_call"
                exc = TypeError(f"{self.label}.{spec.name}{_signature(fn)}: {bind_exc}")
                tb = ""
        if conn is None:
            log.error(
                "broadcast call raised",
                actor=self.label,
                endpoint=spec.name,
                error=repr(exc),
                traceback=tb,
            )
        else:
            log.info(
                "call raised", actor=self.label, call=call_id, endpoint=spec.name, error=repr(exc)
            )
            conn.error(call_id, kind, exc, tb=tb)

    def stats(self) -> ActorStats:
        """Its counters now, by endpoint (the actor's own, never-called ones included). Calls
        in flight: the one the mailbox runs, and concurrent ones."""
        from orchestr._stats import (  # for the metrics scrape, not every start
            ActorStats,
            EndpointStats,
        )

        zero = Counts()
        endpoints = []
        for name in sorted(self.instance._orchestr_endpoints):
            c = self.counts.get(name, zero)
            endpoints.append(EndpointStats(name, c.calls, c.errors))
        return ActorStats(
            actor_id=self.actor_id,
            label=self.label,
            queue_depth=len(self.mailbox),
            in_flight=int(self.busy) + len(self.tasks),
            endpoints=endpoints,
        )

    async def aclose(self) -> None:
        self.runner.cancel()
        await self.tasks.aclose()  # cancels them all before it waits
        await self._runs.aclose()
