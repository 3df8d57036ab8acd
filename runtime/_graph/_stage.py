"""A running map or fan-out stage: reads its input edge, calls the mesh endpoint once per
item or batch, and puts the results on its output edges.

One dispatcher loop per stage takes items (de-duplicated and checked for staleness by a
:class:`~._channelstate.Receiver`), groups them into batches, waits for a member slot and
starts a call task in the stage's task group. A call that finds its actor dead is sent again
(:class:`~._route.Router` backs the member off); results go through a second Receiver,
which releases them in input order on an ordered stage. An input item's window slot frees
when its result has gone on.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from typing import TYPE_CHECKING, Any

import structlog

from orchestr.errors import ActorDiedError, ConfigError

from ._channels import Edge, NodeOut, Token, Work, first_error, nap
from ._channelstate import Item, Receiver
from ._graph import GraphNode
from ._items import Versioned
from ._route import Batcher, Router

if TYPE_CHECKING:
    from ._run import GraphRun

__all__ = ["MAX_REQUEUES", "StageRunner", "send_back"]

log = structlog.get_logger("orchestr.graph")

#: How often one item may be sent back as stale before it is dropped instead.
MAX_REQUEUES = 3


class StageRunner:
    """Runs one ``map`` or ``fanout`` node of a :class:`GraphRun`."""

    def __init__(
        self, run: GraphRun, node: GraphNode, in_edge: Edge, out: NodeOut, wake: asyncio.Event
    ) -> None:
        assert node.endpoint is not None
        self.graph_run = run
        self.node = node
        self.endpoint = node.endpoint
        self.members = node.endpoint.mesh.members
        self.in_edge = in_edge
        self.out = out
        self.wake = wake
        self.router = Router(len(self.members), node.choice, node.inflight_per_member)
        self.receiver = Receiver(ordered=False, staleness=node.staleness)
        self.results = Receiver(ordered=node.ordered)
        inlet = node.inputs[0]
        self.batcher = (
            Batcher(inlet.count, inlet.timeout_s)
            if inlet.count is not None or inlet.timeout_s is not None
            else None
        )
        #: The stage this one sends stale input back to (policy "requeue").
        self.producer: StageRunner | None = None
        #: Output edges whose consumer may send items back: kept open until all are through.
        self.requeue_edges: list[Edge] = []
        self.requests: deque[Work] = deque()
        self._order = itertools.count()
        self._emit_lock = asyncio.Lock()
        self._active = 0
        self._track = f"graph {run.graph.name}: {node.name}"

    def set_version(self, version: int) -> None:
        self.receiver.set_version(version)

    def requeue(self, work: Work) -> None:
        """A consumer found an output of ours stale: make it again."""
        self.requests.append(work)
        self.wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as calls:
            while (work := await self._next_work(loop)) is not None:
                work.t = next(self._order)
                if self.node.kind == "fanout":
                    for member in range(len(self.members)):
                        await self._member_slot(loop, member)
                    calls.create_task(self._perform(work, -1))
                else:
                    work.preferred = self.router.preferred(work.value)
                    member = await self._slot(loop, work)
                    calls.create_task(self._perform(work, member))
                self._active += 1
        self.out.close()

    # -- input --------------------------------------------------------------------------

    def _done(self) -> bool:
        if not self.in_edge.closed or self.in_edge.queue or self.requests:
            return False
        if self.batcher is not None and self.batcher.items:
            return False
        return not self.requeue_edges or (
            self._active == 0 and not any(e.sender.unacked for e in self.requeue_edges)
        )

    async def _next_work(self, loop: asyncio.AbstractEventLoop) -> Work | None:
        """The next item or batch to call the endpoint with; ``None`` when all are through."""
        while True:
            if self.requests:
                return self.requests.popleft()
            item = self.in_edge.take_nowait()
            if item is not None:
                work = self._admit(item, loop.time())
                if work is not None:
                    return work
                continue
            batcher = self.batcher
            if batcher is not None and batcher.items:
                if self.in_edge.closed or batcher.due(loop.time()):
                    return self._batch_work(batcher.take())
            if self._done():
                return None
            await nap(self.wake, batcher.deadline if batcher is not None else None)

    def _admit(self, item: Item, now: float) -> Work | None:
        receiver = self.receiver
        duplicates, dropped = receiver.duplicates, receiver.dropped
        fresh = receiver.receive(item)
        stats = self.in_edge.stats
        stats.duplicates += receiver.duplicates - duplicates
        if receiver.dropped > dropped:
            stats.dropped_stale += receiver.dropped - dropped
            self.in_edge.ack(item.seq, delivered=False)
        for stale in receiver.take_requeued():
            self._send_back(stale)
        for ready in fresh:
            token: Token = ready.value
            if self.batcher is None:
                return Work(token.value, ready.version, [ready.seq])
            if self.batcher.add(ready, now) or self.batcher.due(now):
                return self._batch_work(self.batcher.take())
        return None

    def _batch_work(self, items: list[Item]) -> Work:
        versions = [i.version for i in items if i.version is not None]
        values = [i.value.value for i in items]
        return Work(values, min(versions) if versions else None, [i.seq for i in items])

    def _send_back(self, stale: Item) -> None:
        send_back(stale, self.in_edge, self.producer, self.graph_run.graph.name, self.node.name)

    # -- slots and calls ----------------------------------------------------------------

    async def _slot(self, loop: asyncio.AbstractEventLoop, work: Work) -> int:
        while True:
            now = loop.time()
            member = self.router.take(now, work.preferred)
            if member is not None:
                return member
            await nap(self.wake, self.router.wake_at(now))

    async def _member_slot(self, loop: asyncio.AbstractEventLoop, member: int) -> None:
        while True:
            now = loop.time()
            if self.router.take_member(member, now):
                return
            await nap(self.wake, self.router.wake_at(now))

    async def _call(self, member: int, work: Work, attempt: int) -> Any:
        """One call on a slot already taken; frees the slot."""
        target = self.members[member]
        ok = False
        try:
            with self.graph_run.events.span(
                self.node.name,
                track=f"{self._track}[{target.rank}]",
                kind="call",
                graph=self.graph_run.graph.name,
                stage=self.node.name,
                member=target.rank,
                order=work.t,
                items=len(work.seqs),
                attempt=attempt,
            ):
                result = await self.endpoint._send(target, (work.value,), {})
            ok = True
            return result
        finally:
            self.router.end(member, ok=ok)
            self.wake.set()

    async def _with_retries(
        self, loop: asyncio.AbstractEventLoop, work: Work, member: int, fixed: bool
    ) -> Any:
        """Call until a result comes: after a death, again on another member (or on the same
        one, ``fixed``, once it is up again), within the stage's retries and retry time."""
        first_death: float | None = None
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self._call(member, work, attempt)
            except ActorDiedError as exc:
                now = loop.time()
                backoff = self.router.died(member, now)
                first_death = now if first_death is None else first_death
                elapsed = now - first_death
                if attempt > self.node.retries or elapsed >= self.node.retry_timeout_s:
                    raise self._gave_up(exc, attempt, elapsed) from exc
                self.in_edge.stats.redelivered += max(1, len(work.seqs))
                log.warning(
                    "redelivering after a member died",
                    graph=self.graph_run.graph.name,
                    stage=self.node.name,
                    member=self.members[member].rank,
                    attempt=attempt,
                    backoff_s=backoff,
                )
            if fixed:
                await self._member_slot(loop, member)
            else:
                member = await self._slot(loop, work)

    def _gave_up(self, exc: ActorDiedError, attempts: int, elapsed: float) -> ActorDiedError:
        node = self.node
        return ActorDiedError(
            f"graph {self.graph_run.graph.name!r}, stage {node.name!r}: gave up on an item after "
            f"{attempts} attempts over {elapsed:.1f} s (retries={node.retries}, "
            f"retry_timeout_s={node.retry_timeout_s:g}); last error: {exc}. Give the actors a "
            f"restart policy, the stage more members, or raise retries/retry_timeout_s",
            actor=exc.actor,
            exit_code=exc.exit_code,
            signal=exc.signal,
        )

    async def _perform(self, work: Work, member: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            if self.node.kind == "fanout":
                value, version = await self._fanout(loop, work)
            else:
                result = await self._with_retries(loop, work, member, fixed=False)
                value, version = self._unwrap(result, work.version)
            await self._emit(work, value, version)
        except Exception as exc:
            self.graph_run.fail(exc, self.node.name)
        finally:
            self._active -= 1
            self.wake.set()

    async def _fanout(self, loop: asyncio.AbstractEventLoop, work: Work) -> tuple[Any, int | None]:
        try:
            async with asyncio.TaskGroup() as tg:
                calls = [
                    tg.create_task(self._with_retries(loop, work, m, fixed=True))
                    for m in range(len(self.members))
                ]
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        pairs = [self._unwrap(c.result(), None) for c in calls]
        versions = [v for _, v in pairs if v is not None]
        return [v for v, _ in pairs], min(versions) if versions else work.version

    async def _emit(self, work: Work, value: Any, version: int | None) -> None:
        async with self._emit_lock:
            duplicates = self.results.duplicates
            ready = self.results.receive(Item(work.t, Token(value, work), version))
            self.in_edge.stats.duplicates += self.results.duplicates - duplicates
            for item in ready:
                token: Token = item.value
                done = token.origin
                assert done is not None
                await self.out.emit(token, item.version, only=done.target)
                for seq in done.seqs:
                    self.receiver.commit(seq)
                    self.in_edge.ack(seq)
                self.results.commit(item.seq)

    def _unwrap(self, result: Any, version: int | None) -> tuple[Any, int | None]:
        if isinstance(result, Versioned):
            return result.value, result.version
        if self.node.version_of is not None:
            made = self.node.version_of(result)
            if isinstance(made, bool) or not isinstance(made, int):
                raise ConfigError(
                    f"stage {self.node.name!r}: version_of returned {made!r}; a version is an "
                    f"integer"
                )
            return result, made
        return result, version


def send_back(
    stale: Item, edge: Edge, producer: StageRunner | None, graph: str, where: str
) -> None:
    """``stale`` (taken from ``edge``) goes back through ``producer`` to be made again, or is
    dropped after :data:`MAX_REQUEUES`; either way its slot on ``edge`` frees."""
    origin = stale.value.origin
    stats = edge.stats
    if producer is None or origin is None or origin.requeues >= MAX_REQUEUES:
        stats.dropped_stale += 1
        log.warning(
            "stale item dropped after requeues",
            graph=graph,
            stage=where,
            version=stale.version,
            requeues=MAX_REQUEUES,
        )
    else:
        stats.requeued += 1
        producer.requeue(Work(origin.value, origin.version, [], origin.requeues + 1, edge))
    edge.ack(stale.seq, delivered=False)
