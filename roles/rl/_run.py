"""``run_rl``: an :class:`~._rlconfig.RLConfig` planned (every check before a process starts),
run on the job's cluster, and written to its run folder.

The run folder (``run.dir``/``run.name``) holds ``config.json`` (the config as run),
``metrics.jsonl`` (a line per batch, written as it is trained, and one per held-out
evaluation), ``samples.jsonl`` (some completions with their rewards, every ``eval_every``
batches), ``tensorboard/`` (the same figures as event files, with the tensorboard package),
``summary.json``, ``reward.png`` (with matplotlib), the job's ``events.jsonl`` and
``trace.json``, ``checkpoints/`` (the trainer's, for restarts) and ``model/``: the trained
policy as a Hugging Face folder (``model-NNNNN/`` every ``export_every`` batches). With
``run.mlflow`` the run is logged to that MLflow store too, its run's id noted in ``mlflow.json``.
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
from orchestr.roles._common._hf._tokenizer import Tokenizer
from orchestr.roles.reward import check_functions
from orchestr.roles.trainer import UpdateConfig

from . import _task
from ._config import GRPOConfig, GRPOResult, StepRecord
from ._data import DataSource, DataSpec, load_rows
from ._grpo import run_grpo
from ._layout import LayoutCosts
from ._llama import Checkpoint, LlamaModel
from ._mlflow import MlflowStore, mlflow_store
from ._recovery import read_state
from ._reference import TrainConfig
from ._rlconfig import RLConfig, section_from
from ._rundir import RunWriter
from ._source import DigitSource, Source

__all__ = ["DigitsData", "Plan", "plan_rl", "run_rl"]


@dataclasses.dataclass(frozen=True)
class DigitsData:
    """The built-in digit task (``[data] digits = {...}``): ``task`` ``copy`` or ``reverse``,
    prompts of up to ``max_digits`` digits (lengths falling off by ``decay``) in a ``field``
    of that many (0: none), judged on ``eval_size`` held-out prompts."""

    task: str = "copy"
    max_digits: int = 8
    decay: float = 0.9
    field: int = 8
    eval_size: int = 128


@dataclasses.dataclass
class Plan:
    """What :func:`run_rl` runs: the job's settings, its source, its folder and the MLflow
    store it logs to too (``run.mlflow``; None: none)."""

    config: RLConfig
    job: GRPOConfig
    source: Source
    run_dir: str
    mlflow: MlflowStore | None = None


def _fail(config: RLConfig, section: str, exc: Exception) -> oc.ConfigError:
    return oc.ConfigError(f"{config.source}: [{section}] {exc}")


def _train_config(config: RLConfig, model: Any, digits: DigitsData | None) -> TrainConfig:
    a, s = config.algorithm, config.schedule
    extra: dict[str, Any] = {}
    if digits is not None:
        extra = {
            "task": _task.Task(digits.task, field=digits.field or None),
            "lengths": _task.LengthDistribution(digits.max_digits, digits.decay),
            "eval_size": digits.eval_size,
        }
    try:
        return TrainConfig(
            seed=s.seed,
            steps=s.steps,
            prompts_per_step=s.prompts_per_step,
            group_size=s.group_size,
            model=model,
            lr=s.lr,
            lr_schedule=s.lr_schedule,
            min_lr_ratio=s.min_lr_ratio,
            betas=(s.betas[0], s.betas[1]),
            weight_decay=s.weight_decay,
            max_grad_norm=a.max_grad_norm,
            updates_per_step=a.updates_per_step,
            clip_eps=a.clip_eps,
            temperature=a.temperature,
            advantage_scale=a.advantage_scale,
            entropy_coef=a.entropy_coef,
            behaviour_weight_cap=a.behaviour_weight_cap,
            eval_every=s.eval_every,
            threads=None,
            **extra,
        )
    except (TypeError, ValueError) as exc:
        raise _fail(config, "schedule", exc) from None


def _update_options(config: RLConfig) -> dict[str, Any]:
    """The algorithm's settings beyond :class:`TrainConfig`'s, as :class:`UpdateConfig` takes
    them (checked here)."""
    a, t = config.algorithm, config.trainer
    options: dict[str, Any] = {
        "advantage": a.name,
        "clip_eps_high": a.clip_eps_high,
        "loss_agg": a.loss_agg,
        "kl_coef": a.kl_coef,
        "kl_estimator": a.kl_estimator,
        "overlong_filter": a.overlong_filter,
        "micro_batch_tokens": t.micro_batch_tokens or None,
    }
    try:
        UpdateConfig(**options)
    except (TypeError, ValueError) as exc:
        raise _fail(config, "algorithm", exc) from None
    return options


def plan_rl(config: RLConfig, run_dir: str | None = None, *, resume: bool = False) -> Plan:
    """Check ``config`` as far as can be without a process (files, the checkpoint's tokenizer,
    the data's fields, the reward functions' imports and signatures, every setting) and lay the
    run out. With ``resume``, ``run_dir`` is a run that stopped, to go on with: its config
    must be this one (but for ``run`` and ``schedule.steps``). Raises :class:`ConfigError`
    naming the config file, the key and the fix."""
    name = config.run.name or time.strftime("%Y%m%d-%H%M%S-") + config.layout.mode.replace("+", "-")
    if resume and run_dir is None:
        raise oc.ConfigError("resume needs the run's folder")
    run_dir = os.path.abspath(run_dir or os.path.join(config.run.dir, name))
    if resume:
        _same_run(config, run_dir)
    store = mlflow_store(config.run, config.source)
    data = dict(config.data)
    digits = None
    if "digits" in data:
        if len(data) > 1:
            raise oc.ConfigError(
                f"{config.source}: [data] digits is the built-in task: no other keys"
            )
        digits = section_from(DigitsData, data["digits"], f"{config.source}: [data] digits")
        if config.reward:
            raise oc.ConfigError(f"{config.source}: the digit task scores itself: drop [[reward]]")
        if config.model.tiny is None:
            raise oc.ConfigError(f"{config.source}: the digit task trains [model] tiny = {{}}")
    model: LlamaModel | Checkpoint
    if config.model.tiny is not None:
        if digits is None:
            raise oc.ConfigError(
                f"{config.source}: [model] tiny is the digit task's model; give path"
            )
        try:
            model = LlamaModel(**config.model.tiny)
        except TypeError as exc:
            raise _fail(config, "model", exc) from None
    else:
        assert config.model.path is not None
        folder = os.path.abspath(config.model.path)
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise oc.ConfigError(
                f"{config.source}: [model] path {config.model.path}: no checkpoint there "
                "(a Hugging Face folder with config.json)"
            )
        model = Checkpoint(folder)
    train = _train_config(config, model, digits)
    source: Source
    if digits is not None:
        source = DigitSource(train)
    else:
        assert isinstance(model, Checkpoint)
        source = _data_source(config, data, train, model)
    lay, run = config.layout, config.run
    try:
        job = GRPOConfig(
            train=train,
            mode=lay.mode,  # type: ignore[arg-type]
            generators=lay.generators,
            trainers=lay.trainers,
            rewards=lay.rewards,
            eta=lay.eta,
            lookahead=lay.lookahead,
            long_generators=lay.long_generators,
            max_batch=lay.max_batch,
            torch_threads=lay.torch_threads,
            cpu=lay.cpu,
            engine=lay.engine,
            vllm=lay.vllm,
            max_restarts=lay.max_restarts,
            generator_tp=lay.generator_tp,
            layout_degrees=tuple(lay.layout_degrees),
            layout_costs=_layout_costs(config),
            layout_margin=lay.layout_margin,
            checkpoint_every=run.checkpoint_every,
            checkpoint_dir=os.path.join(run_dir, "checkpoints"),
            kill=tuple(run.kill),
            kill_seed=run.kill_seed,
            export_dir=os.path.join(run_dir, "model") if run.export else None,
            export_every=run.export_every if run.export else 0,
            resume=resume,
            dynamic_sampling=config.algorithm.dynamic_sampling,
            max_draws=config.algorithm.max_draws,
            update_options=_update_options(config),
            trainer_options={
                "dtype": config.trainer.dtype,
                "warmup_steps": config.schedule.warmup_steps,
                "activation_checkpointing": config.trainer.activation_checkpointing,
                "sharding": config.trainer.sharding,
            },
        )
    except oc.ConfigError as exc:
        raise oc.ConfigError(f"{config.source}: {exc}") from None
    return Plan(config, job, source, run_dir, store)


def _layout_costs(config: RLConfig) -> LayoutCosts | None:
    table = config.layout.layout_costs
    if table is None:
        return None
    try:
        return LayoutCosts(**table)
    except (TypeError, ValueError) as exc:
        fields = ", ".join(f.name for f in dataclasses.fields(LayoutCosts))
        raise oc.ConfigError(f"[layout] layout_costs: {exc} (its keys: {fields})") from None


def _comparable(table: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in table.items() if k not in ("run", "source")}
    out["schedule"] = {k: v for k, v in out.get("schedule", {}).items() if k != "steps"}
    return out


def _same_run(config: RLConfig, run_dir: str) -> None:
    path = os.path.join(run_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            before = json.load(f)
    except FileNotFoundError:
        raise oc.ConfigError(f"{run_dir}: not a run folder (no config.json) to resume") from None
    except (OSError, ValueError) as exc:
        raise oc.ConfigError(f"{path}: not readable: {exc}") from None
    now = json.loads(json.dumps(dataclasses.asdict(config), default=str))
    old, new = _comparable(before), _comparable(now)
    changed = sorted(
        f"{section}.{key}"
        for section in set(old) | set(new)
        for key in set(_keys(old.get(section))) | set(_keys(new.get(section)))
        if _get(old.get(section), key) != _get(new.get(section), key)
    )
    if changed:
        raise oc.ConfigError(
            f"{config.source}: the run in {run_dir} was started with other settings "
            f"({', '.join(changed)}); resume it with its own config (run.*, schedule.steps "
            "may change)"
        )
    state = os.path.join(run_dir, "checkpoints", "controller.json")
    if os.path.exists(state) and int(read_state(state)["version"]) >= config.schedule.steps:
        raise oc.ConfigError(
            f"{config.source}: the run in {run_dir} has trained all {config.schedule.steps} "
            "batches already; raise schedule.steps (--set schedule.steps=N) to train on"
        )


def _keys(table: Any) -> list[Any]:
    if isinstance(table, dict):
        return list(table)
    return list(range(len(table))) if isinstance(table, list) else [None]


def _get(table: Any, key: Any) -> Any:
    if key is None:
        return table
    try:
        return table[key]
    except (KeyError, IndexError, TypeError):
        return None


def _data_source(
    config: RLConfig, data: dict[str, Any], train: TrainConfig, model: Checkpoint
) -> Source:
    spec = section_from(DataSpec, data, f"{config.source}: [data]")
    if not os.path.isfile(os.path.join(model.path, "tokenizer.json")):
        raise oc.ConfigError(f"{config.source}: [model] {model.path} has no tokenizer.json")
    tokenizer = Tokenizer(model.path)
    try:
        rows, held = load_rows(spec, tokenizer)
    except oc.ConfigError as exc:
        raise oc.ConfigError(f"{config.source}: [data] {exc}") from None
    if not config.reward:
        raise oc.ConfigError(f"{config.source}: a data run needs at least one [[reward]]")
    functions = [
        {"path": r.function, "weight": r.weight, "args": dict(r.args)}
        | ({"name": r.name} if r.name else {})
        for r in config.reward
        if r.function is not None
    ]
    fields = {key for row in rows.fields[:1] for key in row}
    if functions:
        try:
            check_functions(functions, fields)
        except oc.ConfigError as exc:
            raise oc.ConfigError(f"{config.source}: [[reward]] {exc}") from None
    scorer: dict[str, Any] = {}
    for r in config.reward:
        if r.model is not None:
            if not os.path.isfile(os.path.join(r.model, "config.json")):
                raise oc.ConfigError(
                    f"{config.source}: [[reward]] model {r.model}: no checkpoint there"
                )
            scorer = {"model": r.model, "model_weight": r.weight}
            scorer |= {"model_name": r.name} if r.name else {}
    return DataSource(
        train,
        rows,
        held,
        max_new_tokens=config.algorithm.max_new_tokens,
        checkpoint=model.path,
        functions=functions,
        timeout_s=config.scoring.timeout_s,
        default=config.scoring.default,
        scorer=scorer,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.token_id(tokenizer.pad_token) or 0,
        overlong=(config.algorithm.overlong_buffer, config.algorithm.overlong_penalty),
        tokenizer=tokenizer,
    )


async def run_rl(
    ctx: oc.JobContext,
    config: RLConfig,
    on_step: Callable[[StepRecord], None] | None = None,
    *,
    on_phase: Callable[[str], None] | None = None,
    run_dir: str | None = None,
    resume: bool = False,
) -> tuple[Plan, GRPOResult, dict[str, Any]]:
    """Plan ``config`` (:func:`plan_rl`), run it on ``ctx``'s cluster and write its run folder;
    with ``resume``, go on with the run in ``run_dir`` from its last checkpoint. Returns the
    plan, the result and the summary written. Raises :class:`ConfigError` before any process
    starts for a bad config, and what :func:`~._grpo.run_grpo` raises. Blocks until the last
    batch is trained and evaluated; not cancel-safe: a cancelled run stops its roles and leaves
    its folder as far as it got (``--resume`` goes on from its last checkpoint)."""
    plan = plan_rl(config, run_dir, resume=resume)
    # off the loop: MLflow's import and a new store's tables take seconds, past the cluster's
    # heartbeat timeout on a busy machine
    writer = await asyncio.to_thread(RunWriter, plan)

    def step(record: StepRecord) -> None:
        writer.step(record)
        if on_step is not None:
            on_step(record)

    result = None
    try:
        result = await run_grpo(ctx, plan.job, step, on_phase=on_phase, source=plan.source)
    finally:
        summary = writer.close(result)  # plots reward.png; ends the MLflow run
    ctx.write_trace(plan.run_dir)  # events.jsonl and trace.json (Perfetto)
    return plan, result, summary
