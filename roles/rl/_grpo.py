"""A GRPO job over the roles: generators, a reward mesh and trainers, on one of three schedules.

:func:`run_grpo` spawns the roles on the job's cluster and trains the digit-reversal policy
(:mod:`._task`) for ``config.train.steps`` batches of ``prompts_per_step`` groups:

``sync``
    generate the step's groups on every generator, score, train, sync weights, repeat. The
    samples, their order and the update are the single-process reference's
    (:func:`~._reference.train`), so the run reproduces it up to float rounding between batch
    shapes.
``stream``
    generators run ahead by ``lookahead`` batches; completions are scored as they finish and
    whole groups queue in a channel that the trainer draws each batch from, oldest first. The
    channel enforces the staleness bound η: a group whose oldest token's policy version is
    below ``trainer version - eta`` is dropped (counted) and its prompt drawn again later, so
    every trained sample satisfies ``version >= trainer version - eta``. Weights reach the
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
  the current weights before it gets work. In sync mode the redrawn samples are the same ones
  (they are keyed by seed, step, prompt and sample), so the run is the run without the death.
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

import asyncio
import collections
import contextlib
import dataclasses
import math
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import structlog

import orchestr as oc
from orchestr.roles._common._weights import WeightsRef
from orchestr.roles.generator import Completion, Generator, Request
from orchestr.roles.reward import DEFAULT_SCORER, Reward
from orchestr.roles.trainer import Trainer

from . import _task
from ._faults import ROLES, FaultInjector, MemberWatch, lost_during, parse_kill
from ._reference import DEMO_CONFIG, TrainConfig, group_requests, request_digits, step_requests
from ._streaming import LengthRanker, SampleChannel

__all__ = ["MODES", "GRPOConfig", "GRPOResult", "LengthRanker", "StepRecord", "run_grpo"]

log = structlog.get_logger("orchestr.roles.grpo")

Mode = Literal["sync", "stream", "stream+skew"]
MODES: tuple[str, ...] = ("sync", "stream", "stream+skew")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """The job: ``train`` (what the single-process reference runs too) plus how the roles are
    laid out and scheduled. ``eta`` and ``lookahead`` apply to the stream modes;
    ``long_generators`` to ``stream+skew``. ``torch_threads`` is each role's thread count;
    ``cpu`` the share of a node's CPUs each actor reserves. ``generator_nice`` lowers the
    generators' OS scheduling priority: where roles share cores, the trainer (the critical
    path) runs at full speed and generation takes the cycles it leaves; on a machine of
    their own it changes nothing. ``scorer`` is the reward mesh's function (``"module:function"``,
    see :mod:`orchestr.roles.reward._actor`).

    Each role's members are restarted up to ``max_restarts`` times each when they die (see
    "Failures" in the module docstring); the trainer's state is checkpointed to
    ``checkpoint_dir`` (default: a temporary folder removed at the end) every
    ``checkpoint_every`` batches, and 0 means never, so a trainer's death fails the job.
    ``kill`` injects faults to test this: ``"ROLE[RANK]@STEP[:PHASE]"`` strings
    (:func:`~._faults.parse_kill`), drawn with ``kill_seed``, on a cluster on this machine."""

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
    scorer: str = DEFAULT_SCORER
    max_restarts: int = 3
    checkpoint_every: int = 10
    checkpoint_dir: str | None = None
    kill: tuple[str, ...] = ()
    kill_seed: int = 0

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
        for name in ("max_restarts", "checkpoint_every", "kill_seed"):
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
            if k.phase == "eval" and not _evaluates(self.train, k.step):
                raise oc.ConfigError(f"kill {k}: batch {k.step} ends without an evaluation")
        if any(k.role == "trainer" for k in kills) and self.trainers > 1:
            raise oc.ConfigError(
                "a data-parallel trainer mesh is not restarted (its process group cannot be "
                "joined again yet), so a kill of a trainer needs trainers=1"
            )
        if self.train.prompts_per_step % self.trainers:
            raise oc.ConfigError(
                f"prompts_per_step ({self.train.prompts_per_step}) must split evenly over "
                f"{self.trainers} trainers (each takes whole groups)"
            )


#: The controller's phases within one batch, by mode (``wait``: for the channel's groups).
_SYNC_PHASES = ("generate", "score", "train", "sync", "eval")
_STREAM_PHASES = ("wait", "train", "sync", "eval")


def _evaluates(tc: TrainConfig, step: int) -> bool:
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
    accuracy: float | None = None


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
    #: trainer 0's weights digest at the end, and whether every trainer's was the same
    final_digest: str = ""
    trainer_digests_equal: bool = True
    #: What deaths cost: ``restarts`` per role, ``redrawn_groups`` (lost with a generator, or
    #: voided by a trainer's rollback, and generated again), ``rescored_samples`` (lost with
    #: a reward worker and scored again), ``rolled_back_batches`` (trained, then undone by
    #: a trainer's restart from its checkpoint), ``checkpoints`` and the ``kills`` injected.
    faults: dict[str, Any] = dataclasses.field(default_factory=dict)

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
            "dropped_groups": self.dropped_groups,
            "routed_long": self.routed_long,
            "wall_s": self.wall_s,
            **self.faults,
        }


def _groups(samples: Sequence[Any], size: int) -> list[list[Any]]:
    return [list(samples[i : i + size]) for i in range(0, len(samples), size)]


class _Job:
    def __init__(
        self,
        ctx: oc.JobContext,
        config: GRPOConfig,
        on_step: Callable[[StepRecord], None] | None,
        on_phase: Callable[[str], None] | None,
    ) -> None:
        self.ctx = ctx
        self.cfg = config
        self.tc = config.train
        self.on_step = on_step
        self.on_phase = on_phase
        self._phase = "starting"
        self.steps: list[StepRecord] = []
        self.evals: list[tuple[int, float, float]] = []
        self.sync_times: list[float] = []
        self.sync_bytes = 0
        #: Bytes of the published weights (the parameters'), known from the first publish.
        self.weight_bytes = 0
        self.sync_transports: set[str] = set()
        self.trainer_busy = 0.0
        self.held_out = _task.eval_prompts(self.tc.eval_size, self.tc.lengths)
        self.start = 0.0
        self.trained_samples = 0
        self.dropped = 0  # stream modes: groups past the staleness bound
        self.routed_long = 0  # stream+skew: groups sent to the long pool
        # -- failures
        sizes = {"generator": config.generators, "trainer": config.trainers}
        sizes["reward"] = config.rewards
        self.watch = {role: [MemberWatch() for _ in range(sizes[role])] for role in ROLES}
        self.trainer_watch = self.watch["trainer"][0]
        self.recovery = asyncio.Lock()  # one recovery at a time
        #: The weights every generator should hold: the last published ref, and the trainer's
        #: epoch it was published under.
        self.current_ref: WeightsRef | None = None
        self.ref_epoch = 0
        self.restarts = dict.fromkeys(ROLES, 0)
        self.redrawn = 0
        self.rescored = 0
        self.rolled_back = 0
        self.checkpoints = 0
        #: Stream modes: puts the groups of these keys ("step/index") back in the queue.
        self.requeue_keys: Callable[[list[str]], None] | None = None
        #: Stream modes: drops everything scored and not trained (a rollback voids it).
        self.void_scored: Callable[[], None] | None = None
        self.background: set[asyncio.Task[None]] = set()
        self.failure: BaseException | None = None
        self.failed = asyncio.Event()
        self.checkpoint_dir = config.checkpoint_dir
        self.own_checkpoint_dir = False
        self.checkpoint_base = ""
        #: The last checkpoint known to hold the job's trainer state.
        self.checkpoint_path: str | None = None
        self.step_epoch = 0  # the trainer's epoch when the batch in progress began
        self.digests: list[str] = []  # every trainer's at the end
        kills = [parse_kill(k) for k in config.kill]
        self.injector = FaultInjector(ctx, kills, config.kill_seed) if kills else None

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, name: str) -> None:
        if name != self._phase:
            self._phase = name
            if self.on_phase is not None:
                self.on_phase(name)
            if self.injector is not None:
                self.injector.on_phase(name)

    def begin_step(self, step: int) -> None:
        if self.injector is not None:
            self.injector.on_step(step)

    @property
    def trainer_restarts(self) -> bool:
        return self.cfg.trainers == 1 and self.cfg.checkpoint_every > 0

    async def spawn(self) -> None:
        tc, cfg = self.tc, self.cfg
        model = dataclasses.asdict(tc.model)
        res = {"cpu": cfg.cpu}
        policy = oc.RestartPolicy(max_restarts=cfg.max_restarts)
        self.gens = await self.ctx.spawn(
            Generator,
            seed=tc.seed,
            max_batch=cfg.max_batch,
            model_kwargs=model,
            torch_threads=cfg.torch_threads,
            nice=cfg.generator_nice,
            n=cfg.generators,
            resources=res,
            restart=policy,
            supervise=self._hook("generator"),
        )
        self.trainers = await self.ctx.spawn(
            Trainer,
            model_kwargs=model,
            seed=tc.seed,
            lr=tc.lr,
            betas=tc.betas,
            weight_decay=tc.weight_decay,
            update=dataclasses.asdict(tc.update),
            max_staleness=cfg.eta if cfg.mode != "sync" else 0,
            pad_id=_task.PAD,
            eos_id=_task.EOS,
            torch_threads=cfg.torch_threads,
            n=cfg.trainers,
            resources=res,
            restart=policy if self.trainer_restarts else None,
            supervise=self._hook("trainer") if self.trainer_restarts else _trainer_cannot_restart,
        )
        self.rewards = await self.ctx.spawn(
            Reward,
            cfg.scorer,
            n=cfg.rewards,
            resources=res,
            restart=policy,
            supervise=self._hook("reward"),
        )
        if cfg.trainers > 1:
            await self.ctx.init_distributed(self.trainers)
        if self.injector is not None:
            meshes = {"generator": self.gens, "trainer": self.trainers, "reward": self.rewards}
            self.injector.meshes = meshes
        for i, watch in enumerate(self.watch["generator"]):
            watch.token = (await self.gens[i].reset.call_one())["token"]
        if self.trainer_restarts:
            self.checkpoint_base = self._checkpoint_base()
            while self.checkpoint_path is None:  # a restarted trainer starts from version 0 too
                epoch = self.trainer_watch.epoch
                try:
                    await self.checkpoint(0, epoch)
                except oc.OrchestrError as exc:
                    if not await lost_during([self.trainer_watch], [epoch], exc):
                        raise

    def _checkpoint_base(self) -> str:
        if self.checkpoint_dir is None:
            self.checkpoint_dir = tempfile.mkdtemp(prefix="orchestr-grpo-")
            self.own_checkpoint_dir = True
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        return os.path.join(os.path.abspath(self.checkpoint_dir), "trainer")

    async def stop(self) -> None:
        for task in self.background:
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        if self.injector is not None:
            await self.injector.aclose()
        for mesh in (self.gens, self.trainers, self.rewards):
            await self.ctx.stop(mesh)
        if self.own_checkpoint_dir and self.checkpoint_dir is not None:
            shutil.rmtree(self.checkpoint_dir, ignore_errors=True)

    def faults(self) -> dict[str, Any]:
        return {
            "restarts": dict(self.restarts),
            "redrawn_groups": self.redrawn,
            "rescored_samples": self.rescored,
            "rolled_back_batches": self.rolled_back,
            "checkpoints": self.checkpoints,
            "kills": list(self.injector.done) if self.injector is not None else [],
        }

    # -- failures ----------------------------------------------------------------------------
    def _hook(self, role: str) -> Callable[[oc.Failure], None]:
        """The ``supervise`` hook of ``role``'s mesh: it runs as the death is heard, before the
        restart is asked for, and leaves the decision to the restart policy."""

        def on_failure(failure: oc.Failure) -> None:
            self.watch[role][failure.rank].lost()
            if not failure.can_restart:
                return  # the policy escalates: the job fails with the death
            self.restarts[role] += 1
            if role == "generator":
                self._background(self.recover_generator(failure.rank))

        return on_failure

    def _background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()
            self.failed.set()

    async def ready(self, watch: MemberWatch) -> None:
        """Wait until ``watch``'s member is up to date (its recovery done); raises the error
        of a recovery that failed."""
        while not watch.up.is_set():
            if self.failure is not None:
                raise self.failure
            waits = [
                asyncio.ensure_future(watch.up.wait()),
                asyncio.ensure_future(self.failed.wait()),
            ]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        if self.failure is not None:
            raise self.failure

    async def recover_generator(self, i: int) -> None:
        watch = self.watch["generator"][i]
        epoch = watch.epoch
        async with self.recovery:
            if watch.epoch == epoch:  # else it died again: the newer recovery does it
                await self.renew_generator(i, epoch)

    async def renew_generator(self, i: int, epoch: int) -> None:
        """Bring generator ``i`` (whose work since ``epoch`` began is void) up to date: its
        groups are drawn again, it drops what it holds and loads the current weights."""
        watch, trainer = self.watch["generator"][i], self.trainer_watch
        async with watch.lock:  # no submit or weight load to it in flight
            lost = list(watch.assigned)
            watch.assigned.clear()
            if lost and self.requeue_keys is not None:
                self.requeue_keys(lost)
                self.redrawn += len(lost)
            while watch.epoch == epoch:
                ref, ref_epoch = self.current_ref, self.ref_epoch
                try:
                    # the first call waits for the restarted worker
                    watch.token = (await self.gens[i].reset.call_one())["token"]
                    if ref is not None:
                        await self.gens[i].sync_weights.call_one(ref)
                    break
                except Exception as exc:
                    if watch.epoch != epoch:
                        return  # it died again: the next recovery does it
                    if isinstance(exc, oc.ActorDiedError):
                        await asyncio.sleep(0.5)  # still being restarted
                        continue
                    if ref is not self.current_ref or await lost_during(
                        [trainer], [ref_epoch], exc
                    ):
                        break  # the weights' publisher died: the rollback loads them all
                    raise
            if watch.epoch == epoch:
                watch.up.set()

    async def rollback(self, step: int) -> int:
        """The trainer died: restore it from its last checkpoint, void every sample made
        since (each generator drops what it holds and loads the restored weights, the stream
        modes' scored groups are drawn again) and forget the batches after the checkpoint.
        Returns the restored version: the batch to go on from."""
        trainer = self.trainer_watch
        async with self.recovery:
            while True:
                epoch = trainer.epoch
                try:
                    path = self.checkpoint_path
                    version = int(await self.trainers[0].restore.call_one(path))
                    ref = await self.trainers[0].publish.call_one()
                except Exception as exc:
                    if isinstance(exc, oc.ActorDiedError) or trainer.epoch != epoch:
                        await asyncio.sleep(0.5)  # still being restarted, or died again
                        continue
                    raise
                self.current_ref, self.ref_epoch = ref, epoch
                # every generator's work is void from here, all at once: no group made under
                # the undone versions reaches the channel after it is emptied
                epochs = [watch.lost() for watch in self.watch["generator"]]
                if self.void_scored is not None:
                    self.void_scored()
                for i, generator_epoch in enumerate(epochs):
                    await self.renew_generator(i, generator_epoch)
                if trainer.epoch == epoch:
                    break
        undone = sum(1 for r in self.steps if r.step >= version)
        self.rolled_back += undone
        self.steps = [r for r in self.steps if r.step < version]
        self.evals = [e for e in self.evals if e[0] <= version]
        log.warning("trainer restored from its checkpoint", version=version, undone=undone)
        return version

    async def checkpoint(self, version: int, epoch: int) -> None:
        """Checkpoint the trainer at ``version`` to a file of its own. It becomes the one a
        restart restores only when the trainer lived through the call (``epoch``): a call
        that reached a restarted trainer wrote that one's state, which is not the job's."""
        path = f"{self.checkpoint_base}-v{version}.pt"
        await self.trainers[0].checkpoint.call_one(path)
        if self.trainer_watch.epoch != epoch:
            return
        previous, self.checkpoint_path = self.checkpoint_path, path
        self.checkpoints += 1
        if previous is not None and previous != path:
            await asyncio.to_thread(_remove, previous)

    async def generator_stats(self) -> list[dict[str, Any]]:
        """Every generator's counters, asked again of one that dies meanwhile."""

        async def one(i: int) -> dict[str, Any]:
            watch = self.watch["generator"][i]
            while True:
                await self.ready(watch)
                epoch = watch.epoch
                try:
                    stats: dict[str, Any] = await self.gens[i].stats.call_one()
                    return stats
                except oc.OrchestrError as exc:
                    if not await lost_during([watch], [epoch], exc):
                        raise

        return list(await asyncio.gather(*(one(i) for i in range(self.cfg.generators))))

    # -- shared pieces -----------------------------------------------------------------------
    async def sync_weights(self) -> int:
        """Publish the trainer's weights and load them into every generator."""
        return await self.load(await self.publish())

    async def publish(self) -> WeightsRef:
        self.phase = "sync"
        ref: WeightsRef = await self.trainers[0].publish.call_one()
        # from the trainer the batch began with, unless it died meanwhile (then the batch is
        # rolled back, and loads of this ref count as lost)
        self.current_ref, self.ref_epoch = ref, self.step_epoch
        return ref

    async def load(self, ref: WeightsRef) -> int:
        self.weight_bytes = ref.nbytes
        # every generator reads the whole of the weights from the publishing trainer
        traffic = {(self.trainers.name, self.gens.name): ref.nbytes * len(self.gens)}
        async with self.ctx.phase("weight_sync", traffic=traffic):
            loads = [self.load_one(i, ref) for i in range(self.cfg.generators)]
            reports = [r for r in await asyncio.gather(*loads) if r is not None]
        if ref.version > 0:  # the first load also allocates the loaders' buffers
            self.sync_times.extend(r["seconds"] for r in reports)
        if reports:
            self.sync_bytes = int(reports[0]["bytes"])
        self.sync_transports.update(t for r in reports for t in r["transports"])
        return int(ref.version)

    async def load_one(self, i: int, ref: WeightsRef) -> dict[str, Any] | None:
        """Load ``ref`` into generator ``i``; None when it or the trainer died meanwhile (its
        recovery, or the rollback, loads the current weights)."""
        watch = self.watch["generator"][i]
        trainer_epoch = self.ref_epoch  # the publisher's
        async with watch.lock:
            if not watch.up.is_set() or ref is not self.current_ref:
                # being recovered, it loads the current weights itself; or a newer ref (or
                # the trainer's restored one) replaced this one meanwhile
                return None
            epochs = [watch.epoch, trainer_epoch]
            try:
                report: dict[str, Any] = await self.gens[i].sync_weights.call_one(ref)
            except Exception as exc:
                if await lost_during([watch, self.trainer_watch], epochs, exc):
                    return None
                raise
            return report

    async def score(self, completions: Sequence[Completion]) -> list[float]:
        pairs = [[list(request_digits(c)), c.tokens] for c in completions]
        watches = self.watch["reward"]
        while True:
            epochs = [w.epoch for w in watches]
            try:
                rewards: list[float] = await self.rewards.score.choose(pairs)
                return rewards
            except Exception as exc:
                if not await lost_during(watches, epochs, exc):
                    raise
                # scoring is pure: the same pairs again, on the restarted worker
                self.rescored += len(pairs)

    async def train(self, groups: list[list[tuple[Completion, float]]]) -> dict[str, Any]:
        self.phase = "train"
        n = self.cfg.trainers
        per = len(groups) // n
        shards = [[s for g in groups[i * per : (i + 1) * per] for s in g] for i in range(n)]
        grads = oc.Collective("all_reduce", self.trainers.name, self.weight_bytes)
        async with self.ctx.phase("training", traffic=grads if n > 1 else None):
            stats = await asyncio.gather(
                *(
                    self.trainers[i].train_step.call_one(
                        shards[i], self.tc.group_size, self.tc.advantage_scale
                    )
                    for i in range(n)
                )
            )
        self.trainer_busy += max(s["busy_s"] for s in stats)
        return dict(stats[0])

    async def evaluate(self, version: int) -> float:
        self.phase = "eval"
        prompts = [_task.encode_prompt(p) for p in self.held_out]
        caps = [_task.max_new_tokens(p) for p in self.held_out]
        completions = await self.trainers[0].greedy.call_one(prompts, caps)
        hits = sum(_task.accuracy(p, c) for p, c in zip(self.held_out, completions, strict=True))
        accuracy = hits / len(self.held_out)
        self.evals.append((version, accuracy, time.perf_counter() - self.start))
        return accuracy

    def record(
        self, step: int, stats: dict[str, Any], groups: list[list[tuple[Completion, float]]]
    ) -> StepRecord:
        samples = [s for g in groups for s in g]
        version = int(stats["version"]) - 1  # the trainer's version when it took the batch
        lags = [version - c.version for c, _ in samples]
        self.trained_samples += len(samples)
        wall = time.perf_counter() - self.start
        return StepRecord(
            step=step,
            version=int(stats["version"]),
            reward=sum(r for _, r in samples) / len(samples),
            version_lag=sum(lags) / len(lags),
            max_lag=max(lags),
            mean_length=sum(len(c.tokens) for c, _ in samples) / len(samples),
            dropped=0,
            samples_per_s=self.trained_samples / wall,
            wall_s=wall,
            loss=float(stats["loss"]),
            clip_frac=float(stats["clip_frac"]),
            approx_kl=float(stats["approx_kl"]),
            entropy=float(stats["entropy"]),
        )

    async def finish_step(self, record: StepRecord) -> None:
        version = record.step + 1  # the trainer's, after this batch
        if _evaluates(self.tc, record.step):
            record = dataclasses.replace(record, accuracy=await self.evaluate(version))
        self.steps.append(record)
        if self.on_step is not None:
            self.on_step(record)
        # after the record: a restore from this checkpoint goes on with the next batch
        if self.trainer_restarts and version % self.cfg.checkpoint_every == 0:
            await self.checkpoint(version, self.step_epoch)

    async def run_steps(self, body: Callable[[int], Awaitable[None]]) -> None:
        """Run ``body`` for each batch; when the trainer dies during one, roll back to its
        checkpoint and go on from there."""
        step = 0
        trainer = self.trainer_watch
        while True:
            while step < self.tc.steps:
                epoch = self.step_epoch = trainer.epoch
                self.begin_step(step)
                try:
                    await body(step)
                except oc.OrchestrError as exc:  # what a death causes; anything else is a bug
                    if not self.trainer_restarts or not await lost_during([trainer], [epoch], exc):
                        raise
                if trainer.epoch != epoch:  # also when the batch went to the new one
                    step = await self.rollback(step)
                    continue
                step += 1
            # the final weights, from the trainer that trained the last batch
            try:
                self.digests = [d["digest"] for d in await self.trainers.digest.call()]
            except oc.OrchestrError as exc:
                if not self.trainer_restarts or not await lost_during(
                    [trainer], [self.step_epoch], exc
                ):
                    raise
            if trainer.epoch == self.step_epoch:
                return
            step = await self.rollback(step)

    # -- sync --------------------------------------------------------------------------------
    async def run_sync(self) -> None:
        n_gen, size = self.cfg.generators, self.tc.group_size

        async def one_step(step: int) -> None:
            groups = _groups(step_requests(self.tc, step), size)
            per = -(-len(groups) // n_gen)
            shares = [[r for g in groups[i * per : (i + 1) * per] for r in g] for i in range(n_gen)]
            self.phase = "generate"
            async with self.ctx.phase("generation"):
                done = await asyncio.gather(
                    *(self.generate_on(i, s) for i, s in enumerate(shares) if s)
                )
            completions = [c for part in done for c in part]
            self.phase = "score"
            rewards = await self.score(completions)
            scored = _groups(list(zip(completions, rewards, strict=True)), size)
            stats = await self.train(scored)
            await self.sync_weights()
            await self.finish_step(self.record(step, stats, scored))

        await self.run_steps(one_step)

    async def generate_on(self, i: int, requests: list[Request]) -> list[Completion]:
        """Generator ``i``'s completions of ``requests``, drawn again while it dies."""
        watch = self.watch["generator"][i]
        while True:
            await self.ready(watch)
            epoch = watch.epoch
            try:
                done: list[Completion] = await self.gens[i].generate.call_one(requests)
            except Exception as exc:
                if not await lost_during([watch], [epoch], exc):
                    raise
                done = []
            if watch.epoch == epoch and done:
                return done
            self.redrawn += -(-len(requests) // self.tc.group_size)

    # -- stream ------------------------------------------------------------------------------
    async def run_stream(self, skew: bool) -> None:
        cfg, tc = self.cfg, self.tc
        size, per_step = tc.group_size, tc.prompts_per_step
        channel = SampleChannel()
        ranker = LengthRanker()
        requeue: collections.deque[list[Request]] = collections.deque()
        room = asyncio.Condition()
        outstanding = 0  # groups submitted and neither trained on nor dropped
        budget = per_step * (1 + cfg.lookahead)
        pending: dict[str, list[tuple[Completion, float]]] = {}
        long_ids = list(range(cfg.long_generators)) if skew else []
        short_ids = [i for i in range(cfg.generators) if i not in long_ids]
        turn = 0
        wakers: set[asyncio.Future[None]] = set()

        def requeue_keys(keys: list[str]) -> None:
            """Draw these groups ("step/index") again under newer weights, same keys."""
            nonlocal outstanding
            for key in keys:
                outstanding -= 1
                pending.pop(key, None)
                step, index = (int(x) for x in key.split("/"))
                requeue.append(group_requests(tc, step, index))
            wake = asyncio.ensure_future(notify())
            wakers.add(wake)
            wake.add_done_callback(wakers.discard)

        def drop(group: list[tuple[Completion, float]]) -> None:
            requeue_keys([_group_key(group[0][0].id)])

        def void_scored() -> None:
            keys = [_group_key(g[0][0].id) for g in channel.drain()]
            requeue_keys(keys)
            self.redrawn += len(keys)

        self.requeue_keys = requeue_keys
        self.void_scored = void_scored

        async def notify() -> None:
            async with room:
                room.notify_all()

        def has_room() -> bool:
            return outstanding + per_step <= budget or bool(requeue)

        async def feed() -> None:
            nonlocal outstanding, turn
            next_step = 0
            while True:
                async with room:
                    await room.wait_for(has_room)
                    if requeue:
                        batch = [requeue.popleft()]
                    else:
                        batch = _groups(step_requests(tc, next_step), size)
                        next_step += 1
                    outstanding += len(batch)
                routes: dict[int, list[list[Request]]] = collections.defaultdict(list)
                if skew:
                    heads = [g[0] for g in batch]
                    long = ranker.split(heads, len(long_ids) / cfg.generators)
                    for g, is_long in zip(batch, long, strict=True):
                        ids = long_ids if is_long else short_ids
                        routes[ids[turn % len(ids)]].append(g)
                        turn += 1
                        self.routed_long += is_long
                else:
                    for g in batch:
                        routes[turn % cfg.generators].append(g)
                        turn += 1
                await asyncio.gather(*(submit(i, gs) for i, gs in routes.items()))

        async def submit(i: int, groups: list[list[Request]]) -> None:
            watch = self.watch["generator"][i]
            while True:
                await self.ready(watch)
                async with watch.lock:
                    if not watch.up.is_set():
                        continue  # lost while this waited for the lock
                    epoch = watch.epoch
                    for g in groups:  # before the call: a death during it redraws them
                        watch.assigned[_group_key(g[0].id)] = epoch
                    try:
                        await self.gens[i].submit.call_one([r for g in groups for r in g])
                    except Exception as exc:
                        if not await lost_during([watch], [epoch], exc):
                            raise
                    return

        async def load_then_release(ref: WeightsRef, groups: int) -> None:
            nonlocal outstanding
            try:
                await self.load(ref)
            except Exception:
                if ref is self.current_ref:
                    raise  # else a rollback replaced it: its loads do not matter
            finally:
                async with room:  # new prompts start under the new weights
                    outstanding -= groups
                    room.notify_all()

        async def collect(i: int) -> None:
            watch = self.watch["generator"][i]
            while True:
                await self.ready(watch)
                epoch, token = watch.epoch, watch.token
                try:
                    # the token: a call that reaches a reset or restarted generator takes
                    # nothing meant for the work given to it since
                    done = await self.gens[i].next_completed.call_one(4096, 1.0, token)
                except Exception as exc:
                    if not await lost_during([watch], [epoch], exc):
                        raise
                    continue
                if not done or watch.epoch != epoch:
                    continue  # nothing, or the dead incarnation's: its groups are redrawn
                rewards = await self.score(done)
                for c, r in zip(done, rewards, strict=True):
                    key = _group_key(c.id)
                    if watch.epoch != epoch or watch.assigned.get(key) != epoch:
                        continue  # voided while it was scored (a death or a rollback)
                    ranker.observe(c.prompt, len(c.tokens))
                    group = pending.setdefault(key, [])
                    group.append((c, r))
                    if len(group) == size:
                        del pending[key]
                        del watch.assigned[key]
                        group.sort(key=lambda s: int(s[0].id.rsplit("/", 1)[1]))
                        await channel.put(group)

        tasks = [asyncio.create_task(feed())]
        tasks += [asyncio.create_task(collect(i)) for i in range(cfg.generators)]
        loading: asyncio.Task[None] | None = None

        async def one_step(step: int) -> None:
            nonlocal loading, outstanding
            self.phase = "wait"
            # the trainer's version is the number of batches trained: ``step``
            take = channel.take(per_step, step - cfg.eta, drop)
            groups = await _first(take, tasks)
            try:
                stats = await self.train(groups)
                if loading is not None:
                    await loading
                # the generators load while the trainer goes on: the weight sync is off the
                # trainer's critical path (the publisher keeps two versions; the next
                # publish waits for this load)
                ref = await self.publish()
            except BaseException:
                async with room:  # not trained: the groups leave the budget, undrawn
                    outstanding -= len(groups)
                    room.notify_all()
                raise
            loading = asyncio.create_task(load_then_release(ref, len(groups)))
            record = self.record(step, stats, groups)
            await self.finish_step(dataclasses.replace(record, dropped=channel.dropped))

        try:
            await self.run_steps(one_step)
            if loading is not None:
                await loading
            self.dropped = channel.dropped
        finally:
            if loading is not None:
                tasks.append(loading)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _group_key(request_id: str) -> str:
    """A request's group: ``"step/index"`` of ``"step/index/sample"``."""
    return request_id.rsplit("/", 1)[0]


def _trainer_cannot_restart(failure: oc.Failure) -> None:
    raise oc.ConfigError(
        "a data-parallel trainer mesh is not restarted (its process group cannot be joined "
        "again yet), nor a trainer without checkpoints (checkpoint_every=0)"
    )


async def _first(awaitable: Any, tasks: Sequence[asyncio.Task[None]]) -> Any:
    """Await ``awaitable``, raising at once if a background task failed meanwhile."""
    main = asyncio.ensure_future(awaitable)
    while True:
        await asyncio.wait([main, *tasks], return_when=asyncio.FIRST_COMPLETED)
        if main.done():
            return main.result()
        for t in tasks:
            if t.done():
                main.cancel()
                t.result()  # raises the task's error
                raise RuntimeError("a stream task ended early")


async def run_grpo(
    ctx: oc.JobContext,
    config: GRPOConfig,
    on_step: Callable[[StepRecord], None] | None = None,
    *,
    on_phase: Callable[[str], None] | None = None,
) -> GRPOResult:
    """Spawn the roles on ``ctx``'s cluster, run ``config`` to the end, stop the roles and
    return the history. ``on_step`` sees each batch as it is trained on (its evaluation
    included) and ``on_phase`` each change of the controller's phase (``generate``,
    ``score``, ``train``, ``sync``, ``eval``, ``wait``); ``GRPOResult`` carries the figures
    :mod:`bench.rl_throughput` reports, and what deaths of the roles' workers cost."""
    job = _Job(ctx, config, on_step, on_phase)
    try:
        await job.spawn()
        await job.sync_weights()  # version 0 everywhere: generators start from the trainer's
        stats0 = await job.generator_stats()
        job.start = time.perf_counter()
        await job.evaluate(0)
        if config.mode == "sync":
            await job.run_sync()
        else:
            await job.run_stream(skew=config.mode == "stream+skew")
        wall = time.perf_counter() - job.start
        stats1 = await job.generator_stats()
        digests = job.digests
        if job.injector is not None:
            job.injector.check()
    finally:
        await job.stop()
    # a restarted generator counts from zero again
    busy = [
        b["busy_s"] - (a["busy_s"] if b["busy_s"] >= a["busy_s"] else 0.0)
        for a, b in zip(stats0, stats1, strict=True)
    ]
    sync = sorted(job.sync_times)
    return GRPOResult(
        config=config,
        steps=job.steps,
        evals=job.evals,
        wall_s=wall,
        generator_idle_frac=max(0.0, 1 - sum(busy) / (len(busy) * wall)),
        trainer_idle_frac=max(0.0, 1 - job.trainer_busy / wall),
        weight_sync={
            "seconds": sync[len(sync) // 2] if sync else math.nan,
            "bytes": job.sync_bytes,
            "transports": sorted(job.sync_transports),
        },
        dropped_groups=job.dropped,
        routed_long=job.routed_long,
        final_digest=digests[0],
        trainer_digests_equal=len(set(digests)) == 1,
        faults=job.faults(),
    )
