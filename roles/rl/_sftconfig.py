"""``SFTConfig``: one supervised fine-tuning run as a TOML file, read with ``--set`` overrides
and checked before any process starts.

The sections are the dataclasses below and two of the RL config's (:mod:`._rlconfig`):
``[trainer]`` (:class:`~._rlconfig.TrainerSection`) and ``[run]``
(:class:`~._rlconfig.RunSection`, only its :attr:`SFTConfig.RUN_KEYS`: an SFT run writes no
checkpoints and kills no workers). A key no section has is refused with the closest one it
might have meant; a value of the wrong type, with the type it needs; a setting out of range,
naming the section.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar

import orchestr as oc
from orchestr.roles.trainer import SHARDING, UpdateConfig, scheduled_lr

from ._rlconfig import RunSection, TrainerSection, did_you_mean, read_config_table, section_from
from ._sft_data import SFTDataSpec

__all__ = [
    "SFT_SECTIONS",
    "SFTConfig",
    "SFTLayoutSection",
    "SFTModelSection",
    "SFTScheduleSection",
    "load_sft_config",
    "sft_config_from_dict",
]

#: The Trainer's ``dtype`` choices.
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class SFTModelSection:
    """The model to fine-tune: ``path``, a Hugging Face checkpoint folder (``config.json``,
    safetensors weights, ``tokenizer.json``; any family orchestr loads: Llama, Qwen2,
    Qwen2-MoE), e.g. one ``orchestr rl sft`` or ``orchestr rl train`` wrote as ``RUN/model``."""

    path: str


@dataclasses.dataclass(frozen=True)
class SFTScheduleSection:
    """How long and how fast: ``steps`` optimizer steps of ``batch_size`` rows (the mean over
    their response tokens); the rate ``lr`` after ``warmup_steps``, then ``constant``,
    ``cosine`` or ``linear`` down to ``min_lr_ratio`` of it; AdamW's ``betas`` and
    ``weight_decay``; gradients clipped to ``max_grad_norm``; the held-out loss every
    ``eval_every`` steps, before the first and after the last; ``seed`` draws the held-out
    rows and the order."""

    steps: int = 100
    batch_size: int = 16
    lr: float = 1e-5
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    eval_every: int = 20
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class SFTLayoutSection:
    """Where it runs: ``trainers`` replicas (data parallel: each step's rows split among them,
    gradients summed), each with ``torch_threads`` threads and a ``cpu`` share of its node."""

    trainers: int = 1
    torch_threads: int = 1
    cpu: float = 0.5


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """One run: ``model``, ``data`` (:class:`~._sft_data.SFTDataSpec`), ``schedule``,
    ``trainer``, ``layout``, ``run``. ``source`` is the file it was read from, for messages."""

    model: SFTModelSection
    data: SFTDataSpec
    schedule: SFTScheduleSection = dataclasses.field(default_factory=SFTScheduleSection)
    trainer: TrainerSection = dataclasses.field(default_factory=TrainerSection)
    layout: SFTLayoutSection = dataclasses.field(default_factory=SFTLayoutSection)
    run: RunSection = dataclasses.field(default_factory=RunSection)
    source: str = "<config>"

    #: The ``[run]`` keys an SFT run takes; the RL run's others (checkpoints, fault
    #: injection, ...) are refused: it writes no checkpoints and kills no workers (yet).
    RUN_KEYS: ClassVar[tuple[str, ...]] = ("dir", "name", "export", "export_every")

    def update_options(self) -> dict[str, Any]:
        """The trainer's :class:`~orchestr.roles.UpdateConfig` fields an SFT step uses."""
        return {
            "max_grad_norm": self.schedule.max_grad_norm,
            "micro_batch_tokens": self.trainer.micro_batch_tokens or None,
        }


#: The sections of an SFT config, in the order a file writes them.
SFT_SECTIONS: dict[str, type] = {
    "model": SFTModelSection,
    "data": SFTDataSpec,
    "schedule": SFTScheduleSection,
    "trainer": TrainerSection,
    "layout": SFTLayoutSection,
    "run": RunSection,
}


def _section(name: str, table: Any, source: str) -> Any:
    where = f"{source}: [{name}]"
    if name == "run" and isinstance(table, dict):
        rl_only = {f.name for f in dataclasses.fields(RunSection)} - set(SFTConfig.RUN_KEYS)
        for key in table:
            if key in rl_only:
                raise oc.ConfigError(
                    f"{where}: {key} is an RL run's; an SFT run takes "
                    f"{', '.join(SFTConfig.RUN_KEYS)}: drop it"
                )
    try:
        return section_from(SFT_SECTIONS[name], table, where)
    except oc.ConfigError as exc:
        if str(exc).startswith(where):
            raise
        raise oc.ConfigError(f"{where} {exc}") from None  # a __post_init__'s check


def _check(config: SFTConfig) -> None:
    s, lay, source = config.schedule, config.layout, config.source

    def fail(section: str, message: str) -> oc.ConfigError:
        return oc.ConfigError(f"{source}: [{section}] {message}")

    for name in ("steps", "batch_size", "eval_every"):
        if getattr(s, name) < 1:
            raise fail("schedule", f"{name} must be >= 1, got {getattr(s, name)}")
    if not s.lr > 0 or not s.max_grad_norm > 0 or s.weight_decay < 0:
        raise fail("schedule", "lr and max_grad_norm must be positive, weight_decay >= 0")
    if len(s.betas) != 2 or not all(0.0 <= b < 1.0 for b in s.betas):
        raise fail("schedule", f"betas must be two numbers in [0, 1), got {s.betas}")
    try:
        scheduled_lr(s.lr, 0, s.lr_schedule, s.steps, s.min_lr_ratio, warmup=s.warmup_steps)
    except ValueError as exc:
        raise fail("schedule", str(exc)) from None
    if config.trainer.dtype not in DTYPES:
        raise fail(
            "trainer", f"dtype must be one of {', '.join(DTYPES)}, got {config.trainer.dtype!r}"
        )
    if config.trainer.sharding not in SHARDING:
        raise fail(
            "trainer",
            f"sharding must be one of {', '.join(SHARDING)}, got {config.trainer.sharding!r}",
        )
    if config.trainer.sharding == "full" and config.layout.trainers < 2:
        raise fail("trainer", "sharding='full' shards over two or more layout.trainers")
    if config.trainer.micro_batch_tokens < 0:
        raise fail("trainer", "micro_batch_tokens must be >= 0 (0: the whole batch at once)")
    try:
        UpdateConfig(**config.update_options())
    except ValueError as exc:
        raise fail("trainer", str(exc)) from None
    if lay.trainers < 1 or lay.torch_threads < 1 or not lay.cpu > 0:
        raise fail("layout", "trainers and torch_threads must be >= 1, cpu positive")
    if s.batch_size < lay.trainers:
        raise fail(
            "layout",
            f"{lay.trainers} trainers need at least as many rows a step; raise "
            f"schedule.batch_size (now {s.batch_size}) or lower trainers",
        )
    if config.run.export_every < 0:
        raise fail("run", f"export_every must be >= 0, got {config.run.export_every}")


def sft_config_from_dict(table: dict[str, Any], source: str = "<config>") -> SFTConfig:
    """An :class:`SFTConfig` from parsed TOML, its settings checked. Raises
    :class:`ConfigError` naming ``source``, the section, the key and the fix."""
    for key in table:
        if key not in SFT_SECTIONS:
            raise oc.ConfigError(
                f"{source}: unknown section {key!r}{did_you_mean(key, SFT_SECTIONS)}"
            )
    for key in ("model", "data"):
        if key not in table:
            raise oc.ConfigError(f"{source}: an SFT run needs a [{key}] section")
    parts = {name: _section(name, table[name], source) for name in SFT_SECTIONS if name in table}
    config = SFTConfig(source=source, **parts)
    _check(config)
    return config


def load_sft_config(path: str, overrides: typing.Sequence[str] = ()) -> SFTConfig:
    """Read ``path`` (TOML) with ``overrides`` (``section.key=value``) applied
    (:func:`~._rlconfig.read_config_table`: relative paths from the file's folder). Raises
    :class:`ConfigError` naming the file for a missing or unreadable file and for any bad key
    or value."""
    return sft_config_from_dict(read_config_table(path, overrides), path)
