"""The GRPO job's ``sync`` schedule (generate, score, train, sync, repeat) on a
:class:`~._job.Job`; the stream modes run on a graph (:mod:`._stream`)."""

from __future__ import annotations

import asyncio

from orchestr.roles.generator import Completion, Request

from ._faults import lost_during
from ._job import Job, groups_of
from ._recovery import ready
from ._steps import finish_step, record, run_steps

__all__ = ["generate_on", "run_sync"]


# -- sync --------------------------------------------------------------------------------
async def run_sync(job: Job) -> None:
    n_gen, size = job.cfg.generators, job.tc.group_size

    async def one_step(step: int) -> None:
        groups = groups_of(job.source.step_requests(step), size)
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
