"""A GRPO job over the roles: generators, a reward mesh and trainers, on one of three schedules.

:func:`run_grpo` spawns the roles on the job's cluster and trains the digit-reversal policy
(:mod:`._task`) for ``config.train.steps`` batches of ``prompts_per_step`` groups:

``sync``
    generate the step's groups on every generator, score, train, sync weights, repeat. The
    samples, their order and the update are the single-process reference's
    (:func:`~._reference.train`), so the run reproduces it up to float rounding between batch
    shapes.
``stream``
    generators run ahead by ``lookahead`` batches, on an :class:`orchestr.Graph`
    (:mod:`._stream`): prompt groups flow to the generators' ``generate`` and whole groups
    wait in an output that the trainer draws each batch from, in the order they finished. The
    output enforces the staleness bound η (``oc.Staleness(eta, "requeue")``, checked as the
    trainer takes each group): a group whose oldest token's policy version is below ``trainer
    version - eta`` is drawn again under the newest weights (counted), so every trained
    sample satisfies ``version >= trainer version - eta``. Each batch is scored as it is
    taken. Weights reach the
    generators after every batch while they keep generating: requests in flight finish under
    the new version (AReaL's interruptible generation; the per-token behaviour log-probs keep
    the ratio exact).
``stream+skew``
    as ``stream``, plus a :class:`LengthRanker` that predicts each prompt's output length and
    routes the predicted-long prompts to ``long_generators`` dedicated generators, so they
    neither widen the short requests' batches nor hold them up (StreamRL's skewness-aware
    dispatch).

Weights always travel trainer → generators over the data plane (:meth:`Trainer.publish`,
:meth:`Generator.sync_weights`). Held-out accuracy is measured greedily by trainer 0.

Failures: a role survives the death of any of its workers (SIGKILL, OOM, a lost node). Every
mesh restarts its members (``max_restarts``), and the controller hears each death before the
new incarnation exists (a ``supervise`` hook), so it can tell the dead one's work from the new
one's (:class:`~._faults.MemberWatch`):

- a generator: the groups it held are drawn again (counted), and the restarted generator loads
  the current weights. In sync mode it loads them before it gets work, and the redrawn samples
  are the same ones (they are keyed by seed, step, prompt and sample), so the run is the run
  without the death. In the stream modes the graph sends the groups again at once, to the
  other generators while the dead one is backed off; a group the restarted one draws before
  its load carries the version it was made with (its initial weights, version 0, are the
  trainer's), so the staleness bound sends it back if it is too old.
- a reward worker: the samples being scored are scored again on the restarted one.
- the trainer (a mesh of one): it is restored from its last checkpoint (taken every
  ``checkpoint_every`` batches), the batches after it are undone (counted), every generator
  drops what it holds and loads the restored weights, and the job goes on from there. Sync
  mode then redoes the same batches, bit for bit.

The phases declare their traffic to the cluster's fabric manager (``ctx.phase``): ``weight_sync``
the published weights from the trainer mesh to every generator, ``training`` (with more than one
trainer) an all-reduce of gradients as large as the weights over the trainer mesh;
``generation`` moves little (prompts and completions go through the controller) and declares
nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import orchestr as oc
from orchestr import clock

from ._config import MODES, GRPOConfig, GRPOResult, StepRecord
from ._job import Job
from ._modes import run_sync
from ._source import Source
from ._stream import run_stream
from ._streaming import LengthRanker

__all__ = ["MODES", "GRPOConfig", "GRPOResult", "LengthRanker", "StepRecord", "run_grpo"]


async def run_grpo(
    ctx: oc.JobContext,
    config: GRPOConfig,
    on_step: Callable[[StepRecord], None] | None = None,
    *,
    on_phase: Callable[[str], None] | None = None,
    source: Source | None = None,
) -> GRPOResult:
    """Spawn the roles on ``ctx``'s cluster, run ``config`` to the end, stop the roles and
    return the history. ``on_step`` sees each batch as it is trained on (its evaluation
    included) and ``on_phase`` each change of the controller's phase (``generate``,
    ``score``, ``train``, ``sync``, ``eval``, ``wait``); ``GRPOResult`` carries the figures
    :mod:`bench.rl_throughput` reports, and what deaths of the roles' workers cost.
    ``source`` is what it trains on (default: the digit task of ``config.train``; a
    :class:`~._data.DataSource` for a user's data and reward functions).

    Blocks until the last batch is trained and evaluated. Raises :class:`ConfigError` for a
    bad config, and :class:`SupervisionError` when a role's deaths exhaust its restarts (or
    the trainer dies with no checkpoint). Not cancel-safe: a cancelled run stops its roles
    but returns no history."""
    job = Job(ctx, config, on_step, on_phase, source)
    try:
        await job.spawn()
        await job.sync_weights()  # version 0 everywhere: generators start from the trainer's
        job.busy_base = [s["busy_s"] for s in await job.generator_stats()]
        job.start = clock.perf_counter() - job.resumed_wall
        if not config.resume:  # a resumed run evaluated its checkpoint's version before
            await job.evaluate(0)
        if config.mode == "sync":
            await run_sync(job)
        else:
            await run_stream(job, skew=config.mode == "stream+skew")
        wall = clock.perf_counter() - job.start
        busy = job.busy_retired + job.busy_since_base(await job.generator_stats())
        digests = job.digests
        exported = ""
        if config.export_dir is not None:  # the trained policy, out as a Hugging Face folder
            # a resumed run may replace the folder of the run it extends (more steps)
            exported = await job.on_trainer("export_hf", config.export_dir, None, config.resume)
        if job.injector is not None:
            job.injector.check()
    finally:
        await job.stop()
    accelerators = config.generators * config.generator_tp
    sync = sorted(job.sync_times)
    return GRPOResult(
        config=config,
        steps=job.steps,
        evals=job.evals,
        wall_s=wall,
        generator_idle_frac=max(0.0, 1 - busy / (accelerators * wall)),
        trainer_idle_frac=max(0.0, 1 - job.trainer_busy / wall),
        weight_sync={
            "seconds": sync[len(sync) // 2] if sync else math.nan,
            "bytes": job.sync_bytes,
            "transports": sorted(job.sync_transports),
        },
        dropped_groups=job.dropped,
        routed_long=job.routed_long,
        skipped_groups=job.skipped_groups,
        final_digest=digests[0],
        trainer_digests_equal=len(set(digests)) == 1,
        faults=job.faults(),
        exported=exported,
        rewards=job.source.tally.failed(),
        layouts=job.layouts,
    )
