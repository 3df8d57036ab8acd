"""The GRPO job's settings (:class:`GRPOConfig`) and what it reports: a :class:`StepRecord` per
batch and the :class:`GRPOResult`."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import orchestr as oc
from orchestr.roles.trainer import SHARDING

from ._faults import parse_kill
from ._layout import LayoutCosts
from ._llama import Checkpoint
from ._reference import DEMO_CONFIG, LlamaModel, TrainConfig

Mode = Literal["sync", "stream", "stream+skew"]


MODES: tuple[str, ...] = ("sync", "stream", "stream+skew")

#: The model kinds that are Hugging Face checkpoints (run on ``paged`` or ``vllm``, exported).
CHECKPOINTED = (LlamaModel, Checkpoint)


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """The job: ``train`` (what the single-process reference runs too) plus how the roles are
    laid out and scheduled. ``eta`` and ``lookahead`` apply to the stream modes;
    ``long_generators`` to ``stream+skew``. ``torch_threads`` is each role's thread count;
    ``cpu`` the share of a node's CPUs each actor reserves. ``generator_nice`` lowers the
    generators' OS scheduling priority: where roles share cores, the trainer (the critical
    path) runs at full speed and generation takes the cycles it leaves; on a machine of
    their own it changes nothing. ``scorer`` is the reward mesh's function (``"module:function"``,
    see :mod:`orchestr.roles.reward._actor`; default: the task's own reward). ``ranker`` is
    stream+skew's length ranker (``"module:callable"`` returning an object with
    :class:`~._streaming.LengthRanker`'s ``observe`` and ``split``; default: that ranker), so
    another predictor (or an oracle, in a simulation) can be put in its place.

    ``engine`` is the generators' engine: a checkpoint model (:class:`~._reference.LlamaModel`)
    runs on ``paged`` (the default) or ``vllm`` (with ``vllm`` options, the ``vllm`` extra
    installed), a TinyLM on ``recompute``.

    Each role's members are restarted up to ``max_restarts`` times each when they die (see
    "Failures" in the module docstring); the trainer's state is checkpointed to
    ``checkpoint_dir`` (default: a temporary folder removed at the end) every
    ``checkpoint_every`` batches, and 0 means never, so a trainer's death fails the job.
    ``kill`` injects faults to test this: ``"ROLE[RANK]@STEP[:PHASE]"`` strings
    (:func:`~._faults.parse_kill`), drawn with ``kill_seed``, on a cluster on this machine.
    With ``export_dir`` (a :class:`LlamaModel` job) the trained policy is written there at the
    end as a Hugging Face folder (``transformers`` and ``orchestr serve`` load it), and with
    ``export_every`` also every that many batches, beside it (``model-00020/``).
    ``update_options`` are :class:`~orchestr.roles.UpdateConfig` fields beyond ``train``'s
    (the advantage estimator, clip-higher, loss aggregation, KL, micro-batches) and
    ``trainer_options`` the :class:`~orchestr.roles.Trainer`'s own (``dtype``,
    ``warmup_steps``, ``activation_checkpointing``). ``resume`` goes on from the last
    checkpoint in ``checkpoint_dir`` of a run that stopped (its controller killed, say): the
    trainer's weights and optimizer, the batches recorded, the position in the data (a
    function of the batch) and the reward functions' failure counts. ``dynamic_sampling``
    (DAPO) trains only on groups whose rewards differ, drawing more groups for the batch, up
    to ``max_draws`` batches' worth in all.

    ``generator_tp`` splits each generator over that many processes (tensor parallel; the
    ``paged`` engine). With ``layout_degrees`` the sync schedule re-shards the generator pool
    between batches (OrchestrRL's adaptive generation parallelism): its ``generators x
    generator_tp`` accelerators run as replicas of whichever of those degrees
    :func:`~._layout.choose_layout` picks from the next batch's prompts and the last
    batches' output lengths, priced by ``layout_costs`` (whose ``reshard_s`` the job
    replaces by what each change took), moving only for a gain of ``layout_margin``."""

    train: TrainConfig = DEMO_CONFIG
    mode: Mode = "sync"
    generators: int = 2
    trainers: int = 1
    rewards: int = 1
    eta: int = 1
    lookahead: int = 1
    long_generators: int = 1
    max_batch: int = 512
    torch_threads: int = 1
    cpu: float = 0.25
    generator_nice: int = 10
    scorer: str | None = None
    engine: str | None = None
    vllm: dict[str, Any] | None = None
    max_restarts: int = 3
    checkpoint_every: int = 10
    checkpoint_dir: str | None = None
    kill: tuple[str, ...] = ()
    kill_seed: int = 0
    ranker: str | None = None
    export_dir: str | None = None
    export_every: int = 0
    resume: bool = False
    dynamic_sampling: bool = False
    max_draws: int = 3
    generator_tp: int = 1
    layout_degrees: tuple[int, ...] = ()
    layout_costs: LayoutCosts | None = None
    layout_margin: float = 0.05
    update_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    trainer_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise oc.ConfigError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if min(self.generators, self.trainers, self.rewards, self.max_batch) < 1:
            raise oc.ConfigError("generators, trainers, rewards and max_batch must be >= 1")
        if self.eta < 0 or self.lookahead < 0:
            raise oc.ConfigError(f"eta ({self.eta}) and lookahead ({self.lookahead}) must be >= 0")
        if self.mode == "stream+skew" and not 1 <= self.long_generators < self.generators:
            raise oc.ConfigError(
                f"stream+skew needs 1 <= long_generators < generators, got "
                f"{self.long_generators} of {self.generators}"
            )
        checkpointed = isinstance(self.train.model, CHECKPOINTED)
        engines = ("paged", "vllm") if checkpointed else ("recompute",)
        if self.engine is not None and self.engine not in engines:
            raise oc.ConfigError(
                f"engine {self.engine!r} does not run this job's model; use one of "
                f"{', '.join(engines)}"
            )
        if self.ranker is not None and not (
            isinstance(self.ranker, str) and all(self.ranker.partition(":")[::2])
        ):
            raise oc.ConfigError(f"ranker is a 'module:callable' import path, got {self.ranker!r}")
        if self.export_dir is not None and not checkpointed:
            raise oc.ConfigError(
                "export_dir writes a Hugging Face folder: it needs a checkpoint model"
            )
        if self.vllm and self.engine != "vllm":
            raise oc.ConfigError("vllm options apply to engine='vllm'")
        if self.resume and not (
            self.checkpoint_dir and self.checkpoint_every and self.trainers == 1
        ):
            raise oc.ConfigError(
                "resume goes on from checkpoint_dir's last checkpoint: it needs checkpoint_dir, "
                "checkpoint_every > 0 and trainers=1"
            )
        if self.export_every and self.export_dir is None:
            raise oc.ConfigError("export_every writes beside export_dir: set it too")
        if (
            isinstance(self.max_draws, bool)
            or not isinstance(self.max_draws, int)
            or self.max_draws < 1
        ):
            raise oc.ConfigError(f"max_draws must be an integer >= 1, got {self.max_draws!r}")
        if self.dynamic_sampling and self.trainers > 1:
            raise oc.ConfigError(
                "dynamic_sampling trains batches of any number of groups: it needs trainers=1 "
                "(a data-parallel mesh splits whole groups evenly)"
            )
        for name in ("max_restarts", "checkpoint_every", "kill_seed", "export_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise oc.ConfigError(f"{name} must be a non-negative integer, got {value!r}")
        if isinstance(self.kill, str):
            raise oc.ConfigError(f"kill is a tuple of ROLE@STEP strings, got {self.kill!r}")
        kills = [parse_kill(k) for k in self.kill]
        phases = _SYNC_PHASES if self.mode == "sync" else _STREAM_PHASES
        for k in kills:
            if k.step >= self.train.steps:
                raise oc.ConfigError(f"kill {k}: the job trains batches 0-{self.train.steps - 1}")
            if k.phase is not None and k.phase not in phases:
                raise oc.ConfigError(
                    f"kill {k}: {self.mode} mode has no phase {k.phase!r} in a batch; say one "
                    f"of {', '.join(phases)}"
                )
            if k.phase == "eval" and not evaluates(self.train, k.step):
                raise oc.ConfigError(f"kill {k}: batch {k.step} ends without an evaluation")
        if any(k.role == "trainer" for k in kills) and not self.checkpoint_every:
            raise oc.ConfigError(
                "a killed trainer goes on from its last checkpoint: a trainer kill needs "
                "checkpoint_every > 0"
            )
        self._check_layout(checkpointed, kills)
        sharding = self.trainer_options.get("sharding", "none")
        if sharding not in SHARDING:
            raise oc.ConfigError(f"sharding must be one of {', '.join(SHARDING)}, got {sharding!r}")
        if sharding == "full" and self.trainers < 2:
            raise oc.ConfigError("sharding='full' shards over two or more trainers")
        if self.train.prompts_per_step % self.trainers:
            raise oc.ConfigError(
                f"prompts_per_step ({self.train.prompts_per_step}) must split evenly over "
                f"{self.trainers} trainers (each takes whole groups)"
            )

    def _check_layout(self, checkpointed: bool, kills: list[Any]) -> None:
        tp, degrees = self.generator_tp, self.layout_degrees
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise oc.ConfigError(f"generator_tp must be an integer >= 1, got {tp!r}")
        if (tp > 1 or degrees) and not (checkpointed and generator_engine(self) == "paged"):
            raise oc.ConfigError(
                "generator_tp and layout_degrees split a checkpoint model on the paged engine"
            )
        if not degrees:
            if self.layout_costs is not None:
                raise oc.ConfigError("layout_costs prices layout_degrees: set them too")
            return
        accelerators = self.generators * tp
        if isinstance(degrees, str | int) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 1 and accelerators % d == 0
            for d in degrees
        ):
            raise oc.ConfigError(
                f"layout_degrees must be degrees dividing the pool's {accelerators} "
                f"accelerators (generators x generator_tp), got {degrees!r}"
            )
        if tp not in degrees:
            raise oc.ConfigError(f"layout_degrees {degrees!r} must include generator_tp ({tp})")
        if self.mode != "sync":
            raise oc.ConfigError(
                "layout_degrees re-shards the pool between batches of the sync mode; the "
                "stream modes' generators never stop"
            )
        if not isinstance(self.layout_costs, LayoutCosts):
            raise oc.ConfigError("layout_degrees needs layout_costs (a LayoutCosts)")
        margin = self.layout_margin
        if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 <= margin < 1:
            raise oc.ConfigError(f"layout_margin is a fraction in [0, 1), got {margin!r}")
        if any(k.role == "generator" for k in kills):
            raise oc.ConfigError(
                "a generator kill names a member of a pool whose size changes with "
                "layout_degrees: kill another role, or fix the layout"
            )


#: The controller's phases within one batch, by mode (``wait``: for the channel's groups).
_SYNC_PHASES = ("generate", "score", "train", "sync", "eval")


_STREAM_PHASES = ("wait", "train", "sync", "eval")


def generator_engine(cfg: GRPOConfig) -> str:
    """The engine the job's generators run."""
    if cfg.engine is not None:
        return cfg.engine
    return "paged" if isinstance(cfg.train.model, CHECKPOINTED) else "recompute"


def evaluates(tc: TrainConfig, step: int) -> bool:
    """Whether batch ``step`` ends with a held-out evaluation."""
    return step + 1 == tc.steps or (step + 1) % tc.eval_every == 0


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One trained batch. ``version_lag`` is the mean over its samples of the trainer's
    version minus the sample's (oldest token's) version, ``max_lag`` the largest;
    ``samples_per_s`` counts trained samples over the run so far; ``accuracy`` is set on
    evaluation steps."""

    step: int
    version: int
    reward: float
    version_lag: float
    max_lag: int
    mean_length: float
    dropped: int
    samples_per_s: float
    wall_s: float
    loss: float
    clip_frac: float
    approx_kl: float
    entropy: float
    #: Mean |behaviour - trainer| log-prob per token, before the batch's first update.
    logprob_gap: float = 0.0
    accuracy: float | None = None
    #: Mean KL per token to the reference (starting) policy, when the penalty is on.
    kl: float = 0.0
    #: Groups scored for the batch but not trained on (dynamic sampling: all rewards equal).
    skipped: int = 0


@dataclasses.dataclass
class GRPOResult:
    config: GRPOConfig
    steps: list[StepRecord]
    evals: list[tuple[int, float, float]]  # (version, accuracy, wall_s)
    wall_s: float
    generator_idle_frac: float
    trainer_idle_frac: float
    #: ``seconds`` (median load time of one generator, first load excluded), ``bytes``
    #: and the ``transports`` the loads read over
    weight_sync: dict[str, Any]
    dropped_groups: int
    routed_long: int = 0
    #: Dynamic sampling: groups scored but left out (their rewards all equal).
    skipped_groups: int = 0
    #: trainer 0's weights digest at the end, and whether every trainer's was the same
    final_digest: str = ""
    trainer_digests_equal: bool = True
    #: What deaths cost: ``restarts`` per role, ``redrawn_groups`` (lost with a generator, or
    #: voided by a trainer's rollback, and generated again), ``rescored_samples`` (lost with
    #: a reward worker and scored again), ``rolled_back_batches`` (trained, then undone by
    #: a trainer's restart from its checkpoint), ``checkpoints`` and the ``kills`` injected.
    faults: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: The Hugging Face folder the trained policy was written to (``export_dir``), else "".
    exported: str = ""
    #: Reward functions' failures, per function and cause (``error``, ``timeout``).
    rewards: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    #: The generator pool's changes of layout (``layout_degrees``): each its ``step`` (the
    #: batch it came before), the ``from`` and ``to`` layouts (``"2xtp1"``), the seconds of
    #: each part (``drain_s``, ``stop_s``, ``spawn_s``, ``load_s``, ``total_s``) and the
    #: seconds the policy predicted for the batch's generation at each degree.
    layouts: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def mean_reward(self, last: int | None = None) -> float:
        rows = self.steps[-last:] if last else self.steps
        return sum(r.reward for r in rows) / len(rows)

    def time_to_reward(self, target: float, window: int = 10) -> float | None:
        """Seconds until the mean reward of the last ``window`` batches first reached
        ``target``; None if it never did."""
        for i in range(len(self.steps)):
            rows = self.steps[max(0, i + 1 - window) : i + 1]
            if len(rows) == window and sum(r.reward for r in rows) / window >= target:
                return self.steps[i].wall_s
        return None

    def summary(self) -> dict[str, Any]:
        """The figures the benchmark reports."""
        samples = sum(1 for _ in self.steps) * self.config.train.prompts_per_step
        samples *= self.config.train.group_size
        return {
            "samples_per_s": samples / self.wall_s if self.wall_s else 0.0,
            "time_to_reward_0_8_s": self.time_to_reward(0.8),
            "generator_idle_frac": self.generator_idle_frac,
            "trainer_idle_frac": self.trainer_idle_frac,
            "final_accuracy": self.evals[-1][1] if self.evals else None,
            "last50_reward": self.mean_reward(50),
            # the sampling engine's log-probs against the trainer's, per token: at lag 0 their
            # numerical mismatch alone; with stale samples, staleness too
            "logprob_gap": sum(r.logprob_gap for r in self.steps) / max(1, len(self.steps)),
            "dropped_groups": self.dropped_groups,
            "skipped_groups": self.skipped_groups,
            "routed_long": self.routed_long,
            "wall_s": self.wall_s,
            **self.faults,
        }
