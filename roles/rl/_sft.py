"""``run_sft``: supervised fine-tuning of a checkpoint on prompt and response rows, on the job's
cluster, with the RL jobs' trainer role, written to a run folder.

A run is planned first (:func:`plan_sft`: every check before a process starts: the
checkpoint's files and config, the tokenizer, the rows and their fields, every setting), then
a :class:`~orchestr.roles.Trainer` mesh is spawned on the checkpoint (``layout.trainers``
replicas, one ``torch.distributed`` group when there are several) and takes ``schedule.steps``
steps of :meth:`~orchestr.roles.Trainer.sft_step`, each on ``batch_size`` rows of the seeded
order (:class:`~._sft_data.SFTOrder`) split among the replicas. The held-out loss is measured
before the first step, every ``eval_every`` steps and after the last.

The run folder (``run.dir``/``run.name``) holds ``config.json`` (the config as run),
``metrics.jsonl`` (a line per step, written as it is taken, and one per held-out evaluation),
``summary.json``, the job's ``events.jsonl`` and ``trace.json``, and ``model/``: the trained
weights as a Hugging Face folder (``model-NNNNN/`` every ``export_every`` steps), which an RL
config's ``[model] path`` can name to go on with RL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

import orchestr as oc
from orchestr import clock
from orchestr.roles._common._hf._tokenizer import Tokenizer
from orchestr.roles.models import read_config
from orchestr.roles.trainer import Trainer, call_trainer

from ._sft_data import SFTOrder, SFTRows, load_sft_rows, shares
from ._sftconfig import SFTConfig
from ._spawn import LOAD_MODEL

__all__ = ["SFTPlan", "SFTResult", "SFTStep", "plan_sft", "run_sft"]


@dataclasses.dataclass
class SFTPlan:
    """What :func:`run_sft` runs: the config, the checkpoint's folder, the rendered rows, the
    tokenizer's ids and the run's folder."""

    config: SFTConfig
    checkpoint: str
    train: SFTRows
    held_out: SFTRows
    run_dir: str
    pad_id: int
    eos_id: int | None

    def trainer_kwargs(self) -> dict[str, Any]:
        """The :class:`~orchestr.roles.Trainer`'s arguments (but ``n`` and placement)."""
        s, t = self.config.schedule, self.config.trainer
        return {
            "model_factory": LOAD_MODEL,
            "model_kwargs": {"folder": self.checkpoint},
            "seed": s.seed,
            "lr": s.lr,
            "betas": (s.betas[0], s.betas[1]),
            "weight_decay": s.weight_decay,
            "update": self.config.update_options(),
            "torch_threads": self.config.layout.torch_threads,
            "pad_id": self.pad_id,
            "eos_id": self.eos_id,
            "lr_schedule": s.lr_schedule,
            "lr_steps": s.steps,
            "min_lr_ratio": s.min_lr_ratio,
            "warmup_steps": s.warmup_steps,
            "dtype": t.dtype,
            "activation_checkpointing": t.activation_checkpointing,
            "sharding": t.sharding,
        }


@dataclasses.dataclass(frozen=True)
class SFTStep:
    """One step as the run took it: ``step`` (from 0), the batch's ``loss`` (before the step),
    response ``tokens``, ``grad_norm``, ``lr``, the ``version`` after it, ``wall_s`` since the
    run started, the step's ``tokens_per_s`` and ``held_out``: the held-out loss measured
    after it (None when none was)."""

    step: int
    loss: float
    tokens: float
    grad_norm: float
    lr: float
    version: int
    wall_s: float
    tokens_per_s: float
    held_out: float | None = None


@dataclasses.dataclass
class SFTResult:
    """A finished run: its steps, held-out evaluations ``(version, loss, wall_s)``, the time
    spent in steps, the exported folder ('' when none) and the weights' digest (every
    replica's, equal when they stayed equal)."""

    steps: list[SFTStep]
    evals: list[tuple[int, float, float]]
    wall_s: float
    train_s: float
    exported: str
    digests: list[str]

    def summary(self) -> dict[str, Any]:
        tokens = sum(r.tokens for r in self.steps)
        return {
            "steps": len(self.steps),
            "tokens": tokens,
            "tokens_per_s": tokens / self.train_s if self.train_s else 0.0,
            "wall_s": self.wall_s,
            "first_loss": self.steps[0].loss if self.steps else None,
            "last_loss": self.steps[-1].loss if self.steps else None,
            "first_held_out": self.evals[0][1] if self.evals else None,
            "last_held_out": self.evals[-1][1] if self.evals else None,
            "held_out": [[v, loss] for v, loss, _ in self.evals],
            "final_digest": self.digests[0] if self.digests else "",
            "trainer_digests_equal": len(set(self.digests)) <= 1,
            "exported": self.exported,
        }


def _fail(config: SFTConfig, section: str, message: object) -> oc.ConfigError:
    return oc.ConfigError(f"{config.source}: [{section}] {message}")


def plan_sft(config: SFTConfig, run_dir: str | None = None) -> SFTPlan:
    """Check ``config`` as far as can be without a process (the checkpoint's ``config.json``
    and ``tokenizer.json``, the data files, every row's fields, a run folder not used before)
    and lay the run out in ``run_dir`` (default ``run.dir``/``run.name``). Raises
    :class:`ConfigError` naming the config file, the key and the fix."""
    name = config.run.name or time.strftime("%Y%m%d-%H%M%S-sft")
    run_dir = os.path.abspath(run_dir or os.path.join(config.run.dir, name))
    folder = os.path.abspath(config.model.path)
    for needed in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(folder, needed)):
            raise _fail(
                config,
                "model",
                f"path {config.model.path}: no {needed} there (give a Hugging "
                "Face checkpoint folder)",
            )
    try:
        read_config(folder)
        tokenizer = Tokenizer(folder)
    except oc.ConfigError as exc:
        raise _fail(config, "model", exc) from None
    try:
        train, held = load_sft_rows(config.data, tokenizer, config.schedule.seed)
    except oc.ConfigError as exc:
        raise _fail(config, "data", exc) from None
    for used in ("metrics.jsonl", "model"):
        if os.path.exists(os.path.join(run_dir, used)):
            raise oc.ConfigError(
                f"{config.source}: {run_dir} holds a run already ({used}); give another "
                "--run-dir or run.name"
            )
    pad = tokenizer.token_id(tokenizer.pad_token)
    return SFTPlan(config, folder, train, held, run_dir, pad or 0, tokenizer.eos_id)


class SFTWriter:
    """Writes the run folder as the run goes: ``config.json`` first, ``metrics.jsonl`` line by
    line, ``summary.json`` at the end."""

    def __init__(self, plan: SFTPlan) -> None:
        self.plan = plan
        os.makedirs(plan.run_dir, exist_ok=True)
        with open(os.path.join(plan.run_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(plan.config), f, indent=2, default=str)
        self.metrics = open(os.path.join(plan.run_dir, "metrics.jsonl"), "w", encoding="utf-8")

    def line(self, row: dict[str, Any]) -> None:
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()

    def close(self, result: SFTResult | None) -> dict[str, Any]:
        self.metrics.close()
        if result is None:
            return {}
        plan = self.plan
        summary = {
            **result.summary(),
            "rows": {"train": len(plan.train), "held_out": len(plan.held_out)},
            "too_long": {"train": plan.train.too_long, "held_out": plan.held_out.too_long},
        }
        with open(os.path.join(plan.run_dir, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
        return summary


async def run_sft(
    ctx: oc.JobContext,
    config: SFTConfig,
    on_step: Callable[[SFTStep], None] | None = None,
    *,
    run_dir: str | None = None,
) -> tuple[SFTPlan, SFTResult, dict[str, Any]]:
    """Plan ``config`` (:func:`plan_sft`), train on ``ctx``'s cluster and write the run folder;
    ``on_step`` hears of each step as it is taken. Returns the plan, the result and the
    summary written. Blocks for the whole run. Raises :class:`ConfigError` before any process
    starts for a bad config, and what the spawn and the trainer's calls raise. Cancel-safe in
    that the trainer mesh is stopped at the end however the run ends (a failed or cancelled
    run leaves the lines written so far, and no ``summary.json``); not idempotent: a run
    folder used before is refused."""
    plan = plan_sft(config, run_dir)
    writer = SFTWriter(plan)
    n = config.layout.trainers
    trainers: oc.Mesh | None = None
    finished: SFTResult | None = None  # set once everything is done: then a summary
    try:
        trainers = await ctx.spawn(
            Trainer, n=n, resources={"cpu": config.layout.cpu}, **plan.trainer_kwargs()
        )
        if n > 1:
            await ctx.init_distributed(trainers)
        result = await _train(ctx, plan, trainers, writer, on_step)
        if config.run.export:
            sharded = config.trainer.sharding == "full"
            result.exported = await call_trainer(
                trainers, sharded, "export_hf", os.path.join(plan.run_dir, "model")
            )
        result.digests = [d["digest"] for d in await trainers.digest.call()]
        finished = result
    finally:
        summary = writer.close(finished)
        if trainers is not None:
            await ctx.stop(trainers)
    ctx.write_trace(plan.run_dir)  # events.jsonl and trace.json (Perfetto)
    return plan, result, summary


async def _train(
    ctx: oc.JobContext,
    plan: SFTPlan,
    trainers: oc.Mesh,
    writer: SFTWriter,
    on_step: Callable[[SFTStep], None] | None,
) -> SFTResult:
    config = plan.config
    s, run, n = config.schedule, config.run, config.layout.trainers
    result = SFTResult([], [], 0.0, 0.0, "", [])
    held_out = plan.held_out.samples()
    start = clock.perf_counter()
    sharded = config.trainer.sharding == "full"

    async def evaluate(version: int) -> float:
        async with ctx.phase("eval"):
            out = await call_trainer(trainers, sharded, "sft_loss", held_out)
        loss, wall = float(out["loss"]), clock.perf_counter() - start
        result.evals.append((version, loss, wall))
        writer.line({"kind": "eval", "version": version, "held_out": loss, "wall_s": wall})
        return loss

    await evaluate(0)
    order = SFTOrder(len(plan.train), s.batch_size, s.seed)
    for step in range(s.steps):
        parts = shares(order.step(step), n)
        t0 = clock.perf_counter()
        async with ctx.phase("training"):
            stats = await asyncio.gather(
                *(trainers[i].sft_step.call_one(plan.train.samples(parts[i])) for i in range(n))
            )
        took = clock.perf_counter() - t0
        result.train_s += took
        first = stats[0]
        version = int(first["version"])
        row = {
            "step": step,
            "loss": float(first["loss"]),
            "tokens": float(first["tokens"]),
            "grad_norm": float(first["grad_norm"]),
            "lr": float(first["lr"]),
            "version": version,
            "wall_s": clock.perf_counter() - start,
            "tokens_per_s": first["tokens"] / took,
        }
        writer.line({"kind": "step", **row})
        held = None
        if version % s.eval_every == 0 or version == s.steps:
            held = await evaluate(version)
        record = SFTStep(**row, held_out=held)
        result.steps.append(record)
        if on_step is not None:
            on_step(record)
        every = run.export_every if run.export else 0
        if every and version % every == 0 and version < s.steps:  # the last: model/
            folder = os.path.join(plan.run_dir, f"model-{version:05d}")
            await call_trainer(trainers, sharded, "export_hf", folder, None, True)
    result.wall_s = clock.perf_counter() - start
    return result
