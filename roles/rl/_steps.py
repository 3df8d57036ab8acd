"""The GRPO job's steps, whatever the schedule: running them in order (going back after a
trainer's rollback), and recording each one (rewards, staleness, timings, the held-out
evaluation) with a checkpoint when one is due."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orchestr as oc
from orchestr import clock
from orchestr.roles.generator import Completion

from ._config import StepRecord, evaluates
from ._faults import lost_during
from ._recovery import checkpoint, rollback

if TYPE_CHECKING:
    from ._job import Job

__all__ = ["finish_step", "record", "run_steps"]


def record(
    job: Job, step: int, stats: dict[str, Any], groups: list[list[tuple[Completion, float]]]
) -> StepRecord:
    samples = [s for g in groups for s in g]
    version = int(stats["version"]) - 1  # the trainer's version when it took the batch
    lags = [version - c.version for c, _ in samples]
    job.trained_samples += len(samples)
    wall = clock.perf_counter() - job.start
    return StepRecord(
        step=step,
        version=int(stats["version"]),
        reward=sum(r for _, r in samples) / len(samples),
        version_lag=sum(lags) / len(lags),
        max_lag=max(lags),
        mean_length=sum(len(c.tokens) for c, _ in samples) / len(samples),
        dropped=0,
        samples_per_s=job.trained_samples / wall,
        wall_s=wall,
        loss=float(stats["loss"]),
        clip_frac=float(stats["clip_frac"]),
        approx_kl=float(stats["approx_kl"]),
        entropy=float(stats["entropy"]),
        logprob_gap=float(stats["logprob_gap"]),
        kl=float(stats.get("kl", 0.0)),
    )


async def finish_step(job: Job, record: StepRecord) -> None:
    version = record.step + 1  # the trainer's, after this batch
    if evaluates(job.tc, record.step):
        record = dataclasses.replace(record, accuracy=await job.evaluate(version))
    job.steps.append(record)
    # the dashboard's reward and length curves (and the trace's marks) read these
    job.ctx.events.record(
        "rl_step",
        step=record.step,
        reward=record.reward,
        mean_length=record.mean_length,
        accuracy=record.accuracy,
        version_lag=record.version_lag,
    )
    if job.on_step is not None:
        job.on_step(record)
    every = job.cfg.export_every
    if every and version % every == 0 and version < job.tc.steps:  # the last: export_dir
        await job.export(version)
    # after the record: a restore from this checkpoint goes on with the next batch
    if job.trainer_restarts and version % job.cfg.checkpoint_every == 0:
        await checkpoint(job, version, job.step_epoch)


async def run_steps(job: Job, body: Callable[[int], Awaitable[None]]) -> None:
    """Run ``body`` for each batch; when the trainer dies during one, roll back to its
    checkpoint and go on from there."""
    step = job.first_step
    trainer = job.trainer_watch
    while True:
        while step < job.tc.steps:
            epoch = job.step_epoch = trainer.epoch
            job.begin_step(step)
            try:
                await body(step)
            except oc.OrchestrError as exc:  # what a death causes; anything else is a bug
                if not job.trainer_restarts or not await lost_during([trainer], [epoch], exc):
                    raise
            if trainer.epoch != epoch:  # also when the batch went to the new one
                step = await rollback(job, step)
                continue
            step += 1
        # the final weights, from the trainer that trained the last batch
        try:
            job.digests = [d["digest"] for d in await job.trainers.digest.call()]
        except oc.OrchestrError as exc:
            if not job.trainer_restarts or not await lost_during([trainer], [job.step_epoch], exc):
                raise
        if trainer.epoch == job.step_epoch:
            return
        step = await rollback(job, step)
