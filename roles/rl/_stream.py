"""The stream modes on a dataflow graph: prompt groups flow from a source through the
generators' ``generate`` to an output whose staleness bound is the job's η.

The graph (:class:`Rollouts`), per run::

    prompts (source: the next batches' groups, while the lookahead budget has room)
      -> generate (map over the generator mesh; the member: least loaded, or for
         stream+skew the pool the length ranker picks; a death redelivers the group)
      -> output "rollouts", staleness Staleness(eta, "requeue")

The trainer takes each batch from the output after ``set_version(step)``, so a group is
checked as it is taken: one whose oldest token's policy version is below ``step - eta`` goes
back through ``generate`` to be drawn again under the newest weights (a group stale three
times over is given up; both are counted). The controller scores each batch as it takes it.

A run of the graph ends when the trainer is rolled back (every group in it was drawn under
the undone versions) or when it fails because a member it needed died in a way its retries
did not cover; the next take starts a new run, which draws the groups the old one held again
before new ones.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import importlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import orchestr as oc
from orchestr.roles.generator import Completion, Request
from orchestr.tasks import TaskOwner

from ._faults import lost_during
from ._job import Job, group_key, groups_of
from ._modes import varied, with_seen
from ._steps import finish_step, record, run_steps
from ._streaming import LengthRanker

__all__ = ["Rollouts", "ranker_of", "run_stream"]

T = TypeVar("T")

#: How long the generate stage sends a group again while its generators die and restart.
RETRY_S = 300.0
#: Runs of the graph in a row that may fail through deaths before the job fails.
MAX_RESTARTS = 10
#: How often a source waiting for budget looks again (groups given up free budget).
POLL_S = 0.5

Scored = list[tuple[Completion, float]]


def ranker_of(path: str | None) -> Any:
    """stream+skew's ranker: a :class:`LengthRanker`, or what ``path`` (``module:callable``)
    makes. Raises :class:`ConfigError` for a path that does not import."""
    if path is None:
        return LengthRanker()
    module, _, name = path.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise oc.ConfigError(f"ranker {path!r} does not import: {exc}") from None
    return factory()


def oldest(completions: list[Completion]) -> int:
    """A generated group's version: the oldest policy version among its tokens."""
    return min(c.version for c in completions)


class Rollouts:
    """The stream modes' rollout graph, run after run, and what the controller keeps across
    runs: the groups not yet taken, the lookahead budget, the length ranker's routes."""

    def __init__(self, job: Job, skew: bool) -> None:
        self.job = job
        cfg, tc = job.cfg, job.tc
        self.skew = skew
        self.size, self.per_step = tc.group_size, tc.prompts_per_step
        self.budget = self.per_step * (1 + cfg.lookahead)
        self.ranker = ranker_of(cfg.ranker)
        self.long_ids = list(range(cfg.long_generators)) if skew else []
        self.short_ids = [i for i in range(cfg.generators) if i not in self.long_ids]
        self.route: dict[str, int] = {}  # stream+skew: group key -> generator
        self.turn = 0
        self.next_step = job.first_step
        self.again: collections.deque[list[Request]] = collections.deque()  # drawn first
        self.queued: collections.deque[list[Request]] = collections.deque()  # counted, not fed
        self.fed: dict[str, list[Request]] = {}  # in this run's graph, not taken
        self.taken = 0  # taken, their batch's weights not loaded yet
        self.room = asyncio.Condition()
        self.restarts = 0
        self.ended = collections.Counter[str]()  # edge counts of the runs that ended
        self.run: oc.GraphRun | None = None
        self._results: Any = None
        self._holder: asyncio.Task[None] | None = None
        #: The run's holder, and the weight loads of :func:`run_stream`; closed at its end.
        self.tasks = TaskOwner()
        self._stop = asyncio.Event()
        self._epochs: list[int] = []
        #: Every group scored for the last batch taken (more than it with dynamic sampling).
        self.seen: list[Scored] = []

    # -- the graph ---------------------------------------------------------------------------
    def graph(self) -> oc.Graph:
        job = self.job
        g = oc.Graph("grpo-stream-skew" if self.skew else "grpo-stream")
        prompts = g.source("prompts", self.feed(), capacity=self.budget)
        rollouts = g.map(
            "generate",
            job.gens.generate,
            prompts,
            choice=self.choose if self.skew else "least_loaded",
            capacity=self.budget,
            ordered=False,
            inflight_per_member=self.budget,
            retries=1000,
            retry_timeout_s=RETRY_S,
            version_of=oldest,
        )
        g.output(rollouts, "rollouts", staleness=oc.Staleness(job.cfg.eta, "requeue"))
        return g

    def choose(self, group: list[Request], n: int) -> int:
        """stream+skew: the generator the ranker's split gave ``group`` (its pool's next)."""
        return self.route.get(group_key(group[0].id), 0)

    def occupied(self) -> int:
        """Groups in the budget: fed or about to be, and taken but not yet released, less
        those this run gave up as stale."""
        given_up = self._edge("dropped_stale") if self.run is not None else 0
        return len(self.fed) + len(self.queued) + self.taken - given_up

    async def feed(self) -> AsyncIterator[list[Request]]:
        """The source: groups to draw again first, then each next batch's groups once the
        budget has room for all of them."""
        while True:
            if not self.queued:
                async with self.room:
                    while not self.again and self.occupied() + self.per_step > self.budget:
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(POLL_S):
                                await self.room.wait()
                    if self.again:
                        self.queued.append(self.again.popleft())
                    else:
                        batch = groups_of(self.job.source.step_requests(self.next_step), self.size)
                        self.next_step += 1
                        self._route(batch)
                        self.queued.extend(batch)
            group = self.queued[0]
            self.fed[group_key(group[0].id)] = group
            self.queued.popleft()
            yield group

    def _route(self, batch: list[list[Request]]) -> None:
        if not self.skew:
            return
        heads = [g[0] for g in batch]
        long = self.ranker.split(heads, len(self.long_ids) / self.job.cfg.generators)
        for group, is_long in zip(batch, long, strict=True):
            ids = self.long_ids if is_long else self.short_ids
            self.route[group_key(group[0].id)] = ids[self.turn % len(ids)]
            self.turn += 1
            self.job.routed_long += is_long

    # -- runs --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start a run of the graph. Blocks until its nodes have started."""
        graph, started = self.graph(), asyncio.Event()
        self._stop = stop = asyncio.Event()
        self._epochs = [w.epoch for w in self.job.watch["generator"]]

        async def hold() -> None:
            try:
                async with graph.run(self.job.ctx) as run:
                    self.run = run
                    self._results = run.results("rollouts", versioned=True)
                    started.set()
                    await stop.wait()
            except Exception:
                if not started.is_set():
                    raise
                # else the reader was told, or the run was being stopped anyway

        self._holder = holder = self.tasks.start(hold())
        async with TaskOwner() as waits:
            waiting = waits.start(started.wait())
            await asyncio.wait([waiting, holder], return_when=asyncio.FIRST_COMPLETED)
        if not started.is_set():
            holder.result()  # raises why it did not start

    async def stop(self, *, redraw: bool = True) -> None:
        """End the run, if one is going: with ``redraw`` what its graph held is drawn again by
        the next one (counted as redrawn). Blocks until the run's tasks have ended."""
        holder, run = self._holder, self.run
        if holder is None or run is None:
            return
        self._stop.set()
        await asyncio.gather(holder, return_exceptions=True)
        stats = run.stats()
        for edge in stats.values():
            self.ended.update(edge)
        # sent again by the graph after their generator died, or by the next run
        self.job.redrawn += stats["prompts->generate"]["redelivered"]
        if redraw:
            self.job.redrawn += len(self.fed)
        self.again.extendleft(reversed([*self.fed.values(), *self.queued]))
        self.fed.clear()
        self.queued.clear()
        self._holder = self.run = self._results = None
        async with self.room:
            self.room.notify_all()

    def _edge(self, count: str) -> int:
        assert self.run is not None
        return self.run.stats()["generate->output:rollouts"][count]

    def stale(self) -> int:
        """Groups found past the staleness bound so far (drawn again, or given up)."""
        now = 0
        if self.run is not None:
            now = self._edge("requeued") + self._edge("dropped_stale")
        return self.ended["requeued"] + self.ended["dropped_stale"] + now

    # -- the trainer's side ------------------------------------------------------------------
    async def take(self, step: int) -> list[Scored]:
        """The next batch for the trainer at version ``step``, scored; nothing older than
        ``step - eta``. Blocks until ``prompts_per_step`` groups are through. With dynamic
        sampling, only groups whose rewards differ, taking more (up to ``max_draws`` rounds)
        while too few did; the groups left out leave the budget at once."""
        scored = await self._scored(await self._groups(step, self.per_step))
        self.seen = scored
        if not self.job.cfg.dynamic_sampling:
            return scored
        kept = [g for g in scored if varied(g)]
        seen, last = list(scored), scored
        for _ in range(1, self.job.cfg.max_draws):
            if len(kept) >= self.per_step:
                break
            await self.release(len(last) - sum(map(varied, last)))
            last = await self._scored(await self._groups(step, self.per_step - len(kept)))
            seen += last
            kept += [g for g in last if varied(g)]
        self.seen = seen
        self.job.skipped_groups += len(seen) - len(kept or last)
        if not kept:  # nothing to learn from: the last round's groups, as plain GRPO would
            return last
        await self.release(len(last) - sum(map(varied, last)))  # the last round's uniform ones
        return kept

    async def _groups(self, step: int, n: int) -> list[list[Completion]]:
        """The next ``n`` groups through the graph."""
        groups: list[list[Completion]] = []
        while len(groups) < n:
            if self.run is None:
                await self.start()
            assert self.run is not None
            self.run.set_version(step)
            try:
                done, _ = await self._or_failure(anext(self._results))
            except Exception as exc:
                if not await self._lost(exc):
                    raise
                self.restarts += 1
                await self.stop()
                continue
            self.fed.pop(group_key(done[0].id), None)
            self.taken += 1
            groups.append(done)
        self.restarts = 0
        self.job.dropped = self.stale()
        return groups

    async def _scored(self, groups: list[list[Completion]]) -> list[Scored]:
        # one call for the batch: the groups that came first waited for the last anyway
        job = self.job
        job.phase = "score"
        samples = [c for g in groups for c in g]
        rewards = iter(await job.score(samples))
        for c in samples:
            self.ranker.observe(c.prompt, len(c.tokens))
        return [[(c, next(rewards)) for c in g] for g in groups]

    async def _lost(self, exc: BaseException) -> bool:
        """Whether the run failed because a generator it needed died (a new run then draws
        its groups again), up to :data:`MAX_RESTARTS` runs in a row."""
        watches = self.job.watch["generator"]
        return self.restarts < MAX_RESTARTS and await lost_during(watches, self._epochs, exc)

    async def _or_failure(self, awaitable: Awaitable[T]) -> T:
        """``awaitable``'s result, or the failure of a background recovery if it comes first."""
        job = self.job
        async with TaskOwner() as tasks:  # the loser is cancelled on the way out
            main = tasks.start(awaitable)
            failed = tasks.start(job.failed.wait())
            await asyncio.wait([main, failed], return_when=asyncio.FIRST_COMPLETED)
            if not main.done():
                assert job.failure is not None
                raise job.failure
        return main.result()

    async def release(self, groups: int) -> None:
        """``groups`` taken groups leave the budget (their batch's weights are loaded, or
        they were not trained on): new prompts may start."""
        async with self.room:
            self.taken -= groups
            self.room.notify_all()


async def run_stream(job: Job, skew: bool) -> None:
    rollouts = Rollouts(job, skew)
    job.generators_in_graph = True
    job.void_scored = rollouts.stop
    loading: asyncio.Task[None] | None = None

    async def load_then_release(ref: Any, groups: int) -> None:
        try:
            await job.load(ref)
        except Exception:
            if ref is job.current_ref:
                raise  # else a rollback replaced it: its loads do not matter
        finally:
            await rollouts.release(groups)  # new prompts start under the new weights

    async def one_step(step: int) -> None:
        nonlocal loading
        job.phase = "wait"
        # the trainer's version is the number of batches trained: ``step``
        groups = await rollouts.take(step)
        try:
            stats = await job.train(groups)
            if loading is not None:
                await loading
            # the generators load while the trainer goes on: the weight sync is off the
            # trainer's critical path (the publisher keeps two versions; the next
            # publish waits for this load)
            ref = await job.publish()
        except BaseException:
            await rollouts.release(len(groups))  # not trained: they leave the budget, undrawn
            raise
        loading = rollouts.tasks.start(load_then_release(ref, len(groups)))
        done = with_seen(record(job, step, stats, groups), groups, rollouts.seen)
        await finish_step(job, dataclasses.replace(done, dropped=rollouts.stale()))

    try:
        await run_steps(job, one_step)
        if loading is not None:
            await loading
        job.dropped = rollouts.stale()
    finally:
        if loading is not None:
            loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
        await rollouts.stop(redraw=False)
        await rollouts.tasks.aclose()
