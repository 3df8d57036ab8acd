"""The GRPO job's schedules: ``sync`` (generate, score, train, sync, repeat) and the stream modes
(generators run ahead; scored groups queue under the staleness bound; ``stream+skew`` routes
predicted-long prompts to their own generators). Each runs its steps on a :class:`~._job.Job`."""

from __future__ import annotations

import asyncio
import collections
import dataclasses

from orchestr.roles._common._weights import WeightsRef
from orchestr.roles.generator import Completion, Request

from ._faults import lost_during
from ._job import Job, first_of, group_key, groups_of
from ._recovery import ready
from ._reference import group_requests, step_requests
from ._steps import finish_step, record, run_steps
from ._streaming import LengthRanker, SampleChannel

__all__ = ["generate_on", "run_stream", "run_sync"]


# -- sync --------------------------------------------------------------------------------
async def run_sync(job: Job) -> None:
    n_gen, size = job.cfg.generators, job.tc.group_size

    async def one_step(step: int) -> None:
        groups = groups_of(step_requests(job.tc, step), size)
        per = -(-len(groups) // n_gen)
        shares = [[r for g in groups[i * per : (i + 1) * per] for r in g] for i in range(n_gen)]
        job.phase = "generate"
        async with job.ctx.phase("generation"):
            done = await asyncio.gather(
                *(generate_on(job, i, s) for i, s in enumerate(shares) if s)
            )
        completions = [c for part in done for c in part]
        job.phase = "score"
        rewards = await job.score(completions)
        scored = groups_of(list(zip(completions, rewards, strict=True)), size)
        stats = await job.train(scored)
        await job.sync_weights()
        await finish_step(job, record(job, step, stats, scored))

    await run_steps(job, one_step)


async def generate_on(job: Job, i: int, requests: list[Request]) -> list[Completion]:
    """Generator ``i``'s completions of ``requests``, drawn again while it dies."""
    watch = job.watch["generator"][i]
    while True:
        await ready(job, watch)
        epoch = watch.epoch
        try:
            done: list[Completion] = await job.gens[i].generate.call_one(requests)
        except Exception as exc:
            if not await lost_during([watch], [epoch], exc):
                raise
            done = []
        if watch.epoch == epoch and done:
            return done
        job.redrawn += -(-len(requests) // job.tc.group_size)


# -- stream ------------------------------------------------------------------------------
async def run_stream(job: Job, skew: bool) -> None:
    cfg, tc = job.cfg, job.tc
    size, per_step = tc.group_size, tc.prompts_per_step
    channel = SampleChannel()
    ranker = LengthRanker()
    requeue: collections.deque[list[Request]] = collections.deque()
    room = asyncio.Condition()
    outstanding = 0  # groups submitted and neither trained on nor dropped
    budget = per_step * (1 + cfg.lookahead)
    pending: dict[str, list[tuple[Completion, float]]] = {}
    long_ids = list(range(cfg.long_generators)) if skew else []
    short_ids = [i for i in range(cfg.generators) if i not in long_ids]
    turn = 0
    wakers: set[asyncio.Future[None]] = set()

    def requeue_keys(keys: list[str]) -> None:
        """Draw these groups ("step/index") again under newer weights, same keys."""
        nonlocal outstanding
        for key in keys:
            outstanding -= 1
            pending.pop(key, None)
            step, index = (int(x) for x in key.split("/"))
            requeue.append(group_requests(tc, step, index))
        wake = asyncio.ensure_future(notify())
        wakers.add(wake)
        wake.add_done_callback(wakers.discard)

    def drop(group: list[tuple[Completion, float]]) -> None:
        requeue_keys([group_key(group[0][0].id)])

    def void_scored() -> None:
        keys = [group_key(g[0][0].id) for g in channel.drain()]
        requeue_keys(keys)
        job.redrawn += len(keys)

    job.requeue_keys = requeue_keys
    job.void_scored = void_scored

    async def notify() -> None:
        async with room:
            room.notify_all()

    def has_room() -> bool:
        return outstanding + per_step <= budget or bool(requeue)

    async def feed() -> None:
        nonlocal outstanding, turn
        next_step = 0
        while True:
            async with room:
                await room.wait_for(has_room)
                if requeue:
                    batch = [requeue.popleft()]
                else:
                    batch = groups_of(step_requests(tc, next_step), size)
                    next_step += 1
                outstanding += len(batch)
            routes: dict[int, list[list[Request]]] = collections.defaultdict(list)
            if skew:
                heads = [g[0] for g in batch]
                long = ranker.split(heads, len(long_ids) / cfg.generators)
                for g, is_long in zip(batch, long, strict=True):
                    ids = long_ids if is_long else short_ids
                    routes[ids[turn % len(ids)]].append(g)
                    turn += 1
                    job.routed_long += is_long
            else:
                for g in batch:
                    routes[turn % cfg.generators].append(g)
                    turn += 1
            await asyncio.gather(*(submit(i, gs) for i, gs in routes.items()))

    async def submit(i: int, groups: list[list[Request]]) -> None:
        watch = job.watch["generator"][i]
        while True:
            await ready(job, watch)
            async with watch.lock:
                if not watch.up.is_set():
                    continue  # lost while this waited for the lock
                epoch = watch.epoch
                for g in groups:  # before the call: a death during it redraws them
                    watch.assigned[group_key(g[0].id)] = epoch
                try:
                    await job.gens[i].submit.call_one([r for g in groups for r in g])
                except Exception as exc:
                    if not await lost_during([watch], [epoch], exc):
                        raise
                return

    async def load_then_release(ref: WeightsRef, groups: int) -> None:
        nonlocal outstanding
        try:
            await job.load(ref)
        except Exception:
            if ref is job.current_ref:
                raise  # else a rollback replaced it: its loads do not matter
        finally:
            async with room:  # new prompts start under the new weights
                outstanding -= groups
                room.notify_all()

    async def collect(i: int) -> None:
        watch = job.watch["generator"][i]
        while True:
            await ready(job, watch)
            epoch, token = watch.epoch, watch.token
            try:
                # the token: a call that reaches a reset or restarted generator takes
                # nothing meant for the work given to it since
                done = await job.gens[i].next_completed.call_one(4096, 1.0, token)
            except Exception as exc:
                if not await lost_during([watch], [epoch], exc):
                    raise
                continue
            if not done or watch.epoch != epoch:
                continue  # nothing, or the dead incarnation's: its groups are redrawn
            rewards = await job.score(done)
            for c, r in zip(done, rewards, strict=True):
                key = group_key(c.id)
                if watch.epoch != epoch or watch.assigned.get(key) != epoch:
                    continue  # voided while it was scored (a death or a rollback)
                ranker.observe(c.prompt, len(c.tokens))
                group = pending.setdefault(key, [])
                group.append((c, r))
                if len(group) == size:
                    del pending[key]
                    del watch.assigned[key]
                    group.sort(key=lambda s: int(s[0].id.rsplit("/", 1)[1]))
                    await channel.put(group)

    tasks = [asyncio.create_task(feed())]
    tasks += [asyncio.create_task(collect(i)) for i in range(cfg.generators)]
    loading: asyncio.Task[None] | None = None

    async def one_step(step: int) -> None:
        nonlocal loading, outstanding
        job.phase = "wait"
        # the trainer's version is the number of batches trained: ``step``
        take = channel.take(per_step, step - cfg.eta, drop)
        groups = await first_of(take, tasks)
        try:
            stats = await job.train(groups)
            if loading is not None:
                await loading
            # the generators load while the trainer goes on: the weight sync is off the
            # trainer's critical path (the publisher keeps two versions; the next
            # publish waits for this load)
            ref = await job.publish()
        except BaseException:
            async with room:  # not trained: the groups leave the budget, undrawn
                outstanding -= len(groups)
                room.notify_all()
            raise
        loading = asyncio.create_task(load_then_release(ref, len(groups)))
        done = record(job, step, stats, groups)
        await finish_step(job, dataclasses.replace(done, dropped=channel.dropped))

    try:
        await run_steps(job, one_step)
        if loading is not None:
            await loading
        job.dropped = channel.dropped
    finally:
        if loading is not None:
            tasks.append(loading)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
