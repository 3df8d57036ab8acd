"""Recovering the GRPO job from its roles' deaths: waiting for a restarted member, bringing a
restarted generator up to the current weights, checkpointing the trainer, and rolling the job
back to the trainer's last checkpoint when the trainer died."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
from typing import TYPE_CHECKING, Any, Literal

import structlog

import orchestr as oc
from orchestr import clock
from orchestr.roles.trainer import publish_weights
from orchestr.tasks import TaskOwner

from ._faults import MemberWatch, lost_during

if TYPE_CHECKING:
    from ._job import Job

__all__ = [
    "checkpoint",
    "job_state",
    "on_group_failure",
    "read_state",
    "ready",
    "recover_generator",
    "reform_trainers",
    "renew_generator",
    "restore_trainers",
    "resume",
    "rollback",
    "state_path",
    "write_state",
]

log = structlog.get_logger("orchestr.roles.grpo")


async def ready(job: Job, watch: MemberWatch) -> None:
    """Wait until ``watch``'s member is up to date (its recovery done); raises the error
    of a recovery that failed."""
    while not watch.up.is_set():
        if job.failure is not None:
            raise job.failure
        async with TaskOwner() as tasks:  # the other wait is cancelled on the way out
            waits = [tasks.start(watch.up.wait()), tasks.start(job.failed.wait())]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if job.failure is not None:
        raise job.failure


async def recover_generator(job: Job, i: int) -> None:
    watch = job.watch["generator"][i]
    epoch = watch.epoch
    async with job.recovery:
        if watch.epoch == epoch:  # else it died again: the newer recovery does it
            # a restarted generator holds nothing; one the graph feeds may have its
            # redelivered work already, which a reset would fail
            await renew_generator(job, i, epoch, reset=not job.generators_in_graph)


async def renew_generator(job: Job, i: int, epoch: int, *, reset: bool = True) -> None:
    """Bring generator ``i`` (whose work since ``epoch`` began is void) up to date: with
    ``reset`` it drops what it holds (and may then load older weights); it loads the
    current weights."""
    watch, trainer = job.watch["generator"][i], job.trainer_watch
    async with watch.lock:  # no weight load to it in flight
        while watch.epoch == epoch:
            ref, ref_epoch = job.current_ref, job.ref_epoch
            try:
                # the first call waits for the restarted worker
                if reset or ref is None:
                    await job.gens[i].reset.call_one()
                if ref is not None:
                    await job.gens[i].sync_weights.call_one(ref)
                break
            except Exception as exc:
                if watch.epoch != epoch:
                    return  # it died again: the next recovery does it
                if isinstance(exc, oc.ActorDiedError):
                    await asyncio.sleep(0.5)  # still being restarted
                    continue
                if ref is not job.current_ref or await lost_during([trainer], [ref_epoch], exc):
                    break  # the weights' publisher died: the rollback loads them all
                raise
        if watch.epoch == epoch:
            watch.up.set()


async def rollback(job: Job, step: int) -> int:
    """The trainer died: restore it from its last checkpoint, void every sample made
    since (each generator drops what it holds and loads the restored weights; the stream
    modes' graph run ends, and the next draws its groups again) and forget the batches after
    the checkpoint.
    Returns the restored version: the batch to go on from."""
    trainer = job.trainer_watch
    async with job.recovery:
        while True:
            epoch = trainer.epoch
            try:
                if job.cfg.trainers > 1:
                    await reform_trainers(job)
                path = job.checkpoint_path
                assert path is not None  # the job checkpoints version 0 before any batch
                version = await restore_trainers(job, path)
                ref = await publish_weights(job.trainers, job.sharded)
            except Exception as exc:
                if isinstance(exc, oc.ActorDiedError) or trainer.epoch != epoch:
                    await asyncio.sleep(0.5)  # still being restarted, or died again
                    continue
                raise
            job.current_ref, job.ref_epoch = ref, epoch
            # every generator's work is void from here, all at once: no group made under
            # the undone versions is taken once the graph's run has ended
            epochs = [watch.lost() for watch in job.watch["generator"]]
            if job.void_scored is not None:
                await job.void_scored()
            for i, generator_epoch in enumerate(epochs):
                await renew_generator(job, i, generator_epoch)
            if trainer.epoch == epoch:
                break
    undone = sum(1 for r in job.steps if r.step >= version)
    job.rolled_back += undone
    job.steps = [r for r in job.steps if r.step < version]
    job.evals = [e for e in job.evals if e[0] <= version]
    log.warning("trainer restored from its checkpoint", version=version, undone=undone)
    return version


def on_group_failure(job: Job, failure: oc.Failure) -> Literal["handle", "escalate"]:
    """The ``supervise`` hook of a data-parallel trainer mesh (bound to ``job``): the first
    death of a group loses the whole group (the rollback forms a new one,
    :func:`reform_trainers`); the group's other deaths until then are part of that loss.
    Escalates once the group has been formed again ``max_restarts`` times."""
    if failure.mesh.mesh_id != job.trainers.mesh_id or job.trainer_group_lost:
        return "handle"
    if job.restarts["trainer"] >= job.cfg.max_restarts:
        return "escalate"
    job.trainer_group_lost = True
    job.restarts["trainer"] += 1
    job.trainer_watch.lost()  # the group's watch: every member's work is void
    return "handle"


async def restore_trainers(job: Job, path: str) -> int:
    """Every trainer restores the checkpoint at ``path`` (a replicated group's members each
    read the one file, a sharded group's their shards); the restored version."""
    if job.cfg.trainers == 1 or job.sharded:
        return int(await job.on_trainer("restore", path))
    return int((await job.trainers.restore.call(path))[0])


async def reform_trainers(job: Job) -> None:
    """A data-parallel group lost a member: stop the group, spawn a new one (every member a
    new process; a newcomer cannot join the survivors' process group) and form its process
    group. The caller restores it from the last checkpoint."""
    from orchestr.roles.trainer import Trainer

    await job.ctx.stop(job.trainers)
    job.trainer_groups += 1
    name = f"trainers-{job.trainer_groups}"
    job.trainers = await job.ctx.spawn(Trainer, n=job.cfg.trainers, name=name, **job.trainer_spawn)
    job.trainer_group_lost = False  # a death from here on loses this group
    await job.ctx.init_distributed(job.trainers)
    if job.injector is not None:
        job.injector.meshes["trainer"] = job.trainers
    log.warning("trainer group formed again", members=job.cfg.trainers, group=name)


async def checkpoint(job: Job, version: int, epoch: int) -> None:
    """Checkpoint the trainer at ``version`` to a file of its own (a sharded group: a folder
    of every member's shards). It becomes the one a restart restores only when the trainer
    lived through the call (``epoch``): a call that reached a restarted trainer wrote that
    one's state, which is not the job's."""
    path = f"{job.checkpoint_base}-v{version}" + ("" if job.sharded else ".pt")
    await job.on_trainer("checkpoint", path)
    if job.trainer_watch.epoch != epoch:
        return
    previous, job.checkpoint_path = job.checkpoint_path, path
    job.checkpoints += 1
    # the controller's side, after the trainer's: a resumed run goes on from the pair
    await asyncio.to_thread(write_state, state_path(job), job_state(job, version, path))
    if previous is not None and previous != path:
        await asyncio.to_thread(_remove, previous)


def write_state(path: str, state: dict[str, Any]) -> None:
    """``state`` as JSON at ``path``, atomically (a temporary file, then a rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_state(path: str) -> dict[str, Any]:
    """What :func:`write_state` wrote; raises :class:`ConfigError` when there is none to
    resume from."""
    try:
        with open(path, encoding="utf-8") as f:
            state: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        raise oc.ConfigError(
            f"nothing to resume: {path} is missing (the run never reached a checkpoint)"
        ) from None
    except (OSError, ValueError) as exc:
        raise oc.ConfigError(f"{path}: not a readable controller state: {exc}") from None
    if not os.path.isfile(state.get("checkpoint", "")):
        raise oc.ConfigError(f"{path}: its trainer checkpoint {state.get('checkpoint')} is missing")
    return state


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError, IsADirectoryError):
        os.remove(path)


def state_path(job: Job) -> str:
    """The controller's state beside the trainer's checkpoints (what ``resume`` reads)."""
    return os.path.join(os.path.dirname(job.checkpoint_base), "controller.json")


def job_state(job: Job, version: int, path: str) -> dict[str, Any]:
    """What a resumed run needs besides the trainer's checkpoint at ``path``: the batches
    and evaluations recorded up to ``version``, the counts and the source's own."""
    return {
        "version": version,
        "checkpoint": path,
        "steps": [dataclasses.asdict(r) for r in job.steps if r.step < version],
        "evals": [list(e) for e in job.evals if e[0] <= version],
        "trained_samples": job.trained_samples,
        "wall_s": clock.perf_counter() - job.start,
        "source": job.source.state(),
    }


async def resume(job: Job) -> None:
    """Go on from the last checkpoint of a run that stopped (``resume``): the trainer
    restores it, and the batches and evaluations before it are the run's."""
    from ._config import StepRecord

    state = read_state(state_path(job))
    job.checkpoint_path = state["checkpoint"]
    job.first_step = int(await job.trainers[0].restore.call_one(job.checkpoint_path))
    job.steps = [StepRecord(**r) for r in state["steps"]]
    job.evals = [(int(v), float(a), float(w)) for v, a, w in state["evals"]]
    job.trained_samples = int(state["trained_samples"])
    job.resumed_wall = float(state["wall_s"])
    job.source.restore(state["source"])
