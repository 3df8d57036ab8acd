"""The GRPO job's ``sync`` schedule (generate, score, train, sync, repeat) on a
:class:`~._job.Job`; the stream modes run on a graph (:mod:`._stream`)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

from orchestr.roles.generator import Completion, Request

from ._config import StepRecord
from ._faults import lost_during
from ._job import Job, groups_of
from ._recovery import ready
from ._reshard import adapt_pool
from ._steps import finish_step, record, run_steps

Scored = list[tuple[Completion, float]]

__all__ = ["generate_on", "informative", "run_sync", "varied", "with_seen"]


# -- sync --------------------------------------------------------------------------------
async def run_sync(job: Job) -> None:
    size = job.tc.group_size

    async def draw(step: int, requests: list[Request]) -> list[Scored]:
        n_gen = len(job.gens)
        groups = groups_of(requests, size)
        per = -(-len(groups) // n_gen)
        shares = [[r for g in groups[i * per : (i + 1) * per] for r in g] for i in range(n_gen)]
        job.phase = "generate"
        async with job.ctx.phase("generation"):
            done = await asyncio.gather(
                *(generate_on(job, i, s) for i, s in enumerate(shares) if s)
            )
        completions = [c for part in done for c in part]
        job.lengths.extend(len(c.tokens) for c in completions)
        job.phase = "score"
        rewards = await job.score(completions)
        return groups_of(list(zip(completions, rewards, strict=True)), size)

    async def one_step(step: int) -> None:
        requests = job.source.step_requests(step)
        if job.cfg.layout_degrees:
            await adapt_pool(job, step, requests)
        scored = await draw(step, requests)
        trained, seen = scored, scored
        if job.cfg.dynamic_sampling:
            trained, seen = await informative(job, step, scored, draw)
        stats = await job.train(trained)
        await job.sync_weights()
        done = record(job, step, stats, trained)
        await finish_step(job, with_seen(done, trained, seen))

    await run_steps(job, one_step)


async def informative(
    job: Job,
    step: int,
    scored: list[Scored],
    draw: Callable[[int, list[Request]], Awaitable[list[Scored]]],
) -> tuple[list[Scored], list[Scored]]:
    """Dynamic sampling (DAPO): the step's groups whose rewards are not all equal (those teach
    nothing under group-relative advantages), topped up by drawing more groups, up to
    ``max_draws`` batches in all; and every group scored. A batch with none keeps its last
    draw's groups (one trainer: ``GRPOConfig`` refuses dynamic sampling with more)."""
    per_step = job.tc.prompts_per_step
    kept = [g for g in scored if varied(g)]
    seen, last = list(scored), scored
    for extra in range(1, job.cfg.max_draws):
        if len(kept) >= per_step:
            break
        last = await draw(step, job.source.extra_requests(step, extra))
        seen += last
        kept += [g for g in last if varied(g)]
    kept = kept[:per_step]
    job.skipped_groups += len(seen) - len(kept)
    return (kept or last), seen


def varied(group: Scored) -> bool:
    """Whether a group's rewards differ (so its advantages are not all zero)."""
    rewards = [r for _, r in group]
    return max(rewards) - min(rewards) > 1e-9


def with_seen(done: StepRecord, trained: list[Scored], seen: list[Scored]) -> StepRecord:
    """``done`` with its reward over every group scored for the batch (the policy's, not just
    the informative groups'), and the groups left out."""
    if seen is trained:
        return done
    rewards = [r for g in seen for _, r in g]
    reward = sum(rewards) / len(rewards)
    return dataclasses.replace(done, reward=reward, skipped=len(seen) - len(trained))


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
