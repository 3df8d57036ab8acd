"""``RLConfig``: one RL post-training run as a TOML file, read with ``--set`` overrides and checked
before any process starts.

The sections and their keys are the dataclasses below (their docstrings are what ``orchestr rl
train --help`` prints and ``examples/rl/*.toml`` comment). A key no section has is refused with
the closest one it might have meant; a value of the wrong type, with the type it needs.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
import types
import typing
from typing import Any

import orchestr as oc

__all__ = [
    "AlgorithmSection",
    "LayoutSection",
    "ModelSection",
    "RLConfig",
    "RewardSection",
    "RunSection",
    "ScheduleSection",
    "ScoringSection",
    "TrainerSection",
    "apply_overrides",
    "did_you_mean",
    "load_rl_config",
    "read_config_table",
    "rl_config_from_dict",
    "section_from",
]


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The policy. ``path``: a Hugging Face checkpoint folder (any family orchestr loads:
    Llama, Qwen2, Qwen2-MoE). ``tiny``: the digit task's own small Llama, made from the run's
    seed (its sizes: hidden, layers, heads, kv_heads, intermediate, init_std, max_positions)."""

    path: str | None = None
    tiny: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class RewardSection:
    """One reward: ``function`` (``"module:function"``, called as ``fn(prompt, completion,
    **fields)`` with the row's fields its signature names; ``prompt`` and ``completion`` go by
    name to a function whose parameters have those names) or ``model`` (a reward model's
    checkpoint folder, ``LlamaForSequenceClassification`` or ``Qwen2ForSequenceClassification``
    with one label, scoring the prompt and completion as text on the reward workers); its
    ``weight`` in the sum, a ``name`` for the metrics (default: the function's,
    ``reward_model`` for a model), and ``args`` (keyword arguments given to every call of a
    function, e.g. a regex's ``pattern``)."""

    function: str | None = None
    model: str | None = None
    weight: float = 1.0
    name: str | None = None
    args: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ScoringSection:
    """How reward functions run: a call past ``timeout_s`` or one that raises scores
    ``default`` (counted per function and cause; the run goes on)."""

    timeout_s: float = 5.0
    default: float = 0.0


@dataclasses.dataclass(frozen=True)
class AlgorithmSection:
    """The policy update. ``name``: the advantage estimator, ``grpo`` (group mean and std),
    ``dr_grpo`` (group mean only), ``rloo`` (leave-one-out mean) or ``reinforce_pp``
    (REINFORCE++: group mean, whitened over the batch). ``updates_per_step`` optimizer steps a
    batch; the ratio clipped to ``[1 - clip_eps, 1 + clip_eps_high]`` (clip-higher when the
    second is larger; default equal); ``loss_agg`` ``token_mean``, ``seq_mean_token_mean`` or
    ``seq_mean_token_sum``; ``kl_coef`` times the KL to the starting policy (``kl_estimator`` k1, k2
    or k3; 0 turns the reference role off); ``entropy_coef`` times the entropy as a bonus;
    ``temperature`` of sampling; ``max_new_tokens`` a completion's limit;
    ``overlong_filter`` leaves completions cut at that limit out of the loss, and
    ``overlong_buffer`` > 0 takes up to ``overlong_penalty`` off the reward of completions
    within that many tokens of it (DAPO's soft penalty). ``dynamic_sampling`` trains only on
    groups whose rewards differ, drawing more groups (at most ``max_draws`` batches a step;
    one trainer). ``advantage_scale`` 0 or -1 gives the controls."""

    name: str = "grpo"
    updates_per_step: int = 4
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    loss_agg: str = "token_mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.003
    temperature: float = 1.0
    max_new_tokens: int = 64
    max_grad_norm: float = 1.0
    behaviour_weight_cap: float | None = 2.0
    overlong_filter: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    dynamic_sampling: bool = False
    max_draws: int = 3
    advantage_scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class ScheduleSection:
    """How long and how fast: ``steps`` batches of ``prompts_per_step`` prompts x ``group_size``
    samples; the rate ``lr`` after ``warmup_steps``, then ``constant``, ``cosine`` or ``linear``
    down to ``min_lr_ratio`` of it; AdamW's ``betas`` and ``weight_decay``; the held-out set is
    scored every ``eval_every`` batches and at the end; ``seed`` draws everything."""

    steps: int = 100
    prompts_per_step: int = 32
    group_size: int = 8
    lr: float = 1e-5
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    eval_every: int = 20
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class TrainerSection:
    """The trainer's arithmetic: ``dtype`` ``float32`` or ``bfloat16`` (autocast, float32
    weights); ``micro_batch_tokens`` bounds a forward pass's padded tokens, gradients
    accumulated over a batch's micro-batches (0: the whole batch at once);
    ``activation_checkpointing`` recomputes each layer's activations in the backward pass;
    ``sharding`` ``full`` shards the parameters, gradients and optimizer state over the
    ``layout.trainers`` (two or more) instead of replicating them (FSDP2)."""

    dtype: str = "float32"
    micro_batch_tokens: int = 0
    activation_checkpointing: bool = False
    sharding: str = "none"


@dataclasses.dataclass(frozen=True)
class LayoutSection:
    """Where the roles run: ``mode`` ``sync``, ``stream`` or ``stream+skew``; how many
    ``generators``, ``trainers`` (data parallel) and ``rewards`` workers; the generators'
    ``engine`` (``paged`` or ``vllm``, with ``vllm`` options); the stream modes' staleness
    bound ``eta`` and ``lookahead``; stream+skew's ``long_generators``; each role's
    ``torch_threads`` and ``cpu`` share; restarts per member (``max_restarts``). Each
    generator split over ``generator_tp`` processes (tensor parallel); with
    ``layout_degrees`` the sync mode re-shards the generator pool between batches to
    whichever degree the layout policy picks, priced by ``layout_costs`` (the fields of
    ``orchestr.roles.rl.LayoutCosts``), moving only for a gain of ``layout_margin``."""

    mode: str = "sync"
    generators: int = 2
    trainers: int = 1
    rewards: int = 1
    engine: str | None = None
    vllm: dict[str, Any] | None = None
    eta: int = 1
    lookahead: int = 1
    long_generators: int = 1
    torch_threads: int = 1
    cpu: float = 0.25
    max_batch: int = 512
    max_restarts: int = 3
    generator_tp: int = 1
    layout_degrees: list[int] = dataclasses.field(default_factory=list)
    layout_costs: dict[str, Any] | None = None
    layout_margin: float = 0.05


@dataclasses.dataclass(frozen=True)
class RunSection:
    """What the run writes: a folder under ``dir`` (named ``name``, default the time and the
    mode), the trainer's checkpoint every ``checkpoint_every`` batches (for restarts and
    ``--resume``), the policy as a Hugging Face folder every ``export_every`` batches (0: at the
    end only) when ``export`` is on; ``kill`` (``ROLE@STEP`` strings) kills role workers
    mid-run to show the run surviving it. ``mlflow`` (off when unset) logs the run to a local
    MLflow store too, in the experiment ``mlflow_experiment``: a folder (a SQLite store,
    ``mlflow.db`` and ``mlartifacts/``; relative to the working directory, like ``dir``),
    ``sqlite:///FILE.db``, or ``file:FOLDER`` (MLflow's folder store, which MLflow 3 opens only
    with ``MLFLOW_ALLOW_FILE_STORE=true``); ``--resume`` goes on with the same MLflow run."""

    dir: str = "runs"
    name: str | None = None
    checkpoint_every: int = 10
    export: bool = True
    export_every: int = 0
    kill: list[str] = dataclasses.field(default_factory=list)
    kill_seed: int = 0
    mlflow: str | None = None
    mlflow_experiment: str = "orchestr-rl"


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """One run: ``model``, ``data`` (a :class:`~._data.DataSpec`'s keys, or ``digits`` for the
    built-in digit task), ``reward`` (a list; none for the digit task's own), ``scoring``,
    ``algorithm``, ``schedule``, ``trainer``, ``layout``, ``run``. ``source`` is the file it
    was read from, for messages."""

    model: ModelSection
    data: dict[str, Any]
    reward: list[RewardSection] = dataclasses.field(default_factory=list)
    scoring: ScoringSection = dataclasses.field(default_factory=ScoringSection)
    algorithm: AlgorithmSection = dataclasses.field(default_factory=AlgorithmSection)
    schedule: ScheduleSection = dataclasses.field(default_factory=ScheduleSection)
    trainer: TrainerSection = dataclasses.field(default_factory=TrainerSection)
    layout: LayoutSection = dataclasses.field(default_factory=LayoutSection)
    run: RunSection = dataclasses.field(default_factory=RunSection)
    source: str = "<config>"


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "scoring": ScoringSection,
    "algorithm": AlgorithmSection,
    "schedule": ScheduleSection,
    "trainer": TrainerSection,
    "layout": LayoutSection,
    "run": RunSection,
}
TOP = ("model", "data", "reward", "scoring", "algorithm", "schedule", "trainer", "layout", "run")


def did_you_mean(key: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(sorted(choices))}"


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def section_from(cls: type, table: Any, where: str) -> Any:
    if not isinstance(table, dict):
        raise oc.ConfigError(f"{where} is a table of keys, got {table!r:.60}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in table.items():
        if key not in names:
            raise oc.ConfigError(f"{where}: unknown key {key!r}{did_you_mean(key, names)}")
        if not _type_ok(value, hints[key]):
            raise oc.ConfigError(
                f"{where}.{key} must be {_type_name(hints[key])}, got {value!r:.60}"
            )
        values[key] = float(value) if hints[key] is float else value
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise oc.ConfigError(f"{where}: {', '.join(missing)} must be given")
    return cls(**values)


def rl_config_from_dict(table: dict[str, Any], source: str = "<config>") -> RLConfig:
    """An :class:`RLConfig` from parsed TOML. Raises :class:`ConfigError` naming ``source``, the
    key and the fix."""
    for key in table:
        if key not in TOP:
            raise oc.ConfigError(f"{source}: unknown section {key!r}{did_you_mean(key, TOP)}")
    for key in ("model", "data"):
        if key not in table:
            raise oc.ConfigError(f"{source}: a run needs a [{key}] section")
    parts: dict[str, Any] = {
        name: section_from(cls, table[name], f"{source}: [{name}]")
        for name, cls in SECTIONS.items()
        if name in table
    }
    data = table["data"]
    if not isinstance(data, dict):
        raise oc.ConfigError(f"{source}: [data] is a table of keys")
    rewards = table.get("reward", [])
    if not isinstance(rewards, list):
        raise oc.ConfigError(f"{source}: reward is a list of tables: write [[reward]]")
    parts["reward"] = [
        section_from(RewardSection, r, f"{source}: [[reward]] #{i + 1}")
        for i, r in enumerate(rewards)
    ]
    for i, r in enumerate(parts["reward"]):
        if (r.function is None) == (r.model is None):
            raise oc.ConfigError(f"{source}: [[reward]] #{i + 1} needs one of function or model")
        if r.model is not None and r.args:
            raise oc.ConfigError(f"{source}: [[reward]] #{i + 1}: args are a function's")
    if sum(r.model is not None for r in parts["reward"]) > 1:
        raise oc.ConfigError(f"{source}: one [[reward]] model at most")
    model = parts["model"]
    if (model.path is None) == (model.tiny is None):
        raise oc.ConfigError(f"{source}: [model] needs one of path (a checkpoint folder) or tiny")
    return RLConfig(data=dict(data), source=source, **parts)


def apply_overrides(table: dict[str, Any], overrides: typing.Sequence[str]) -> dict[str, Any]:
    """``table`` with each ``section.key=value`` set (the value read as TOML, else as a
    string: ``--set schedule.steps=20 --set run.name=try1``). Raises :class:`ConfigError` for
    an override without a section or an ``=``."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in table.items()}
    for item in overrides:
        path, sep, raw = item.partition("=")
        keys = path.strip().split(".")
        if not sep or len(keys) < 2 or not all(keys):
            raise oc.ConfigError(f"--set {item!r}: write SECTION.KEY=VALUE, e.g. schedule.steps=20")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        node = out
        for key in keys[:-1]:
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            elif not isinstance(child, dict):
                raise oc.ConfigError(f"--set {item!r}: {key} is not a table")
            else:
                child = node[key] = dict(child)
            node = child
        node[keys[-1]] = value
    return out


def read_config_table(path: str, overrides: typing.Sequence[str] = ()) -> dict[str, Any]:
    """The TOML table at ``path`` with ``overrides`` applied. Relative paths the file gives for
    ``model.path`` and the data's files are taken from its folder (an override's, from the
    working directory). Raises :class:`ConfigError` naming the file when it is missing or
    unreadable."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise oc.ConfigError(f"{path}: no such config file") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise oc.ConfigError(f"{path}: not a readable TOML file: {exc}") from None
    base = os.path.dirname(os.path.abspath(path))
    for section, key in (("model", "path"), ("data", "path"), ("data", "held_out")):
        value = table.get(section, {}).get(key) if isinstance(table.get(section), dict) else None
        if isinstance(value, str) and not os.path.isabs(value):
            table[section] = {**table[section], key: os.path.join(base, value)}
    for reward in table.get("reward", []) if isinstance(table.get("reward"), list) else []:
        model = reward.get("model") if isinstance(reward, dict) else None
        if isinstance(model, str) and not os.path.isabs(model):
            reward["model"] = os.path.join(base, model)
    return apply_overrides(table, overrides)


def load_rl_config(path: str, overrides: typing.Sequence[str] = ()) -> RLConfig:
    """Read ``path`` (TOML) with ``overrides`` applied (:func:`read_config_table`). Raises
    :class:`ConfigError` naming the file for a missing or unreadable file and for any bad key
    or value."""
    return rl_config_from_dict(read_config_table(path, overrides), path)
