"""Spawning a GRPO job's roles: generators, trainers, the reward mesh and (for the KL penalty)
a reference policy, each with its restart policy and the hook that hears of its deaths; a
resumed run's trainer starts from the run's last checkpoint."""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from typing import TYPE_CHECKING, Any

import orchestr as oc
from orchestr.roles.generator import Generator
from orchestr.roles.reward import Reward
from orchestr.roles.trainer import LOAD_MODEL, Trainer

from ._config import CHECKPOINTED, generator_engine
from ._faults import lost_during
from ._llama import Checkpoint
from ._recovery import checkpoint, on_group_failure, resume

if TYPE_CHECKING:
    from ._job import Job

# LOAD_MODEL: how the trainer builds a checkpoint model (the modules the generators' engine
# runs), which a sharded trainer reads by rows
__all__ = ["LOAD_MODEL", "spawn_roles"]


async def spawn_roles(job: Job) -> None:
    """Spawn ``job``'s roles on its cluster. Blocks until every member is up (and a resumed
    run's trainer has restored its checkpoint)."""
    tc, cfg = job.tc, job.cfg
    res = {"cpu": cfg.cpu}
    policy = oc.RestartPolicy(max_restarts=cfg.max_restarts)
    model: dict[str, Any] = {"model_kwargs": dataclasses.asdict(tc.model)}
    trained = model
    if isinstance(tc.model, CHECKPOINTED):
        if isinstance(tc.model, Checkpoint):
            folder = tc.model.path
        else:  # made here, once, from the run's seed: every role loads the same folder
            job.model_dir = tempfile.mkdtemp(prefix="orchestr-grpo-model-")
            folder = tc.model.make(os.path.join(job.model_dir, "llama"), tc.seed)
        engine = generator_engine(cfg)
        model = {"checkpoint": folder, "engine": engine}
        model |= {"kv": job.source.kv(tc)} if engine == "paged" else {"vllm": cfg.vllm}
        trained = {"model_factory": LOAD_MODEL, "model_kwargs": {"folder": folder}}
    job.gen_spawn = {
        "seed": tc.seed,
        "max_batch": cfg.max_batch,
        "torch_threads": cfg.torch_threads,
        "nice": cfg.generator_nice,
        "resources": res,
        "restart": policy,
        "supervise": job.hook("generator"),
        **model,
    }
    tp: dict[str, Any] = {"tp": cfg.generator_tp} if cfg.generator_tp > 1 else {}
    job.gens = await job.ctx.spawn(Generator, n=cfg.generators, **tp | job.gen_spawn)
    # one trainer is restarted where it was; a group is formed again, every member new (the
    # job's rollback does it), since a newcomer cannot join the survivors' process group
    group = cfg.trainers > 1
    supervise: Any = job.hook("trainer")
    if not job.trainer_restarts:
        supervise = _trainer_cannot_restart
    elif group:
        supervise = functools.partial(on_group_failure, job)
    job.trainer_spawn = {
        "seed": tc.seed,
        "lr": tc.lr,
        "lr_schedule": tc.lr_schedule,
        "lr_steps": tc.steps,
        "min_lr_ratio": tc.min_lr_ratio,
        "betas": tc.betas,
        "weight_decay": tc.weight_decay,
        "update": dataclasses.asdict(tc.update) | dict(cfg.update_options),
        "max_staleness": cfg.eta if cfg.mode != "sync" else 0,
        "pad_id": job.source.pad_id,
        "eos_id": job.source.eos_id,
        "torch_threads": cfg.torch_threads,
        "resources": res,
        "restart": policy if job.trainer_restarts and not group else None,
        "supervise": supervise,
        **trained,
        **cfg.trainer_options,
    }
    job.trainers = await job.ctx.spawn(Trainer, n=cfg.trainers, **job.trainer_spawn)
    args, kwargs = job.source.reward_args
    if cfg.update_options.get("kl_coef"):
        # the frozen starting policy: a trainer that never trains, for the KL penalty
        job.reference = await job.ctx.spawn(
            Trainer,
            seed=tc.seed,
            pad_id=job.source.pad_id,
            torch_threads=cfg.torch_threads,
            n=1,
            resources=res,
            restart=policy,
            **trained,
        )
    job.rewards = await job.ctx.spawn(
        Reward,
        *args,
        **kwargs,
        n=cfg.rewards,
        resources=res,
        restart=policy,
        supervise=job.hook("reward"),
    )
    if cfg.trainers > 1:
        await job.ctx.init_distributed(job.trainers)
    if job.injector is not None:
        meshes = {"generator": job.gens, "trainer": job.trainers, "reward": job.rewards}
        job.injector.meshes = meshes
    if job.trainer_restarts:
        job.checkpoint_base = job.checkpoint_base_path()
        if cfg.resume:
            await resume(job)
        while job.checkpoint_path is None:  # a restarted trainer starts from version 0 too
            epoch = job.trainer_watch.epoch
            try:
                await checkpoint(job, 0, epoch)
            except oc.OrchestrError as exc:
                if not await lost_during([job.trainer_watch], [epoch], exc):
                    raise


def _trainer_cannot_restart(failure: oc.Failure) -> None:
    raise oc.ConfigError(
        "a trainer without checkpoints (checkpoint_every=0) is not restarted: there is no "
        "state to go on from"
    )
