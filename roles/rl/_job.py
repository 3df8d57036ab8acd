"""The GRPO job's controller state: its roles' meshes, what each member holds, the steps it has
recorded, and the calls every schedule makes (spawn, weights, scoring, training, evaluation),
with the hooks that hear of each role's deaths."""

from __future__ import annotations

import asyncio
import collections
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orchestr as oc
from orchestr import clock
from orchestr.roles._common._weightref import AnyWeightsRef
from orchestr.roles.generator import Completion
from orchestr.roles.trainer import call_trainer, publish_weights
from orchestr.tasks import TaskOwner

from ._config import GRPOConfig, StepRecord
from ._faults import ROLES, FaultInjector, MemberWatch, lost_during, parse_kill
from ._recovery import ready, recover_generator
from ._source import DigitSource, Source
from ._spawn import spawn_roles

__all__ = ["Job", "first_of", "group_key", "groups_of"]


def groups_of(samples: Sequence[Any], size: int) -> list[list[Any]]:
    return [list(samples[i : i + size]) for i in range(0, len(samples), size)]


class Job:
    def __init__(
        self,
        ctx: oc.JobContext,
        config: GRPOConfig,
        on_step: Callable[[StepRecord], None] | None,
        on_phase: Callable[[str], None] | None,
        source: Source | None = None,
    ) -> None:
        self.ctx = ctx
        self.source = source if source is not None else DigitSource(config.train, config.scorer)
        self.cfg = config
        # the roles' meshes, once spawned (_spawn)
        self.gens: oc.Mesh
        self.trainers: oc.Mesh
        self.rewards: oc.Mesh
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
        #: A checkpoint model's folder, made at spawn and removed at the end.
        self.model_dir: str | None = None
        self.start = 0.0
        #: The first batch to train: 0, or where a resumed run's last checkpoint was.
        self.first_step = 0
        self.resumed_wall = 0.0
        self.trained_samples = 0
        self.dropped = 0  # stream modes: groups past the staleness bound
        self.routed_long = 0  # stream+skew: groups sent to the long pool
        self.skipped_groups = 0  # dynamic sampling: scored, not trained on
        # -- the generator pool's layout (it changes with layout_degrees)
        self.gen_tp = config.generator_tp
        #: How the generators are spawned (beside ``n`` and ``tp``), for a pool re-sharded.
        self.gen_spawn: dict[str, Any] = {}
        self.layout_costs = config.layout_costs
        #: Output lengths of the last batches' completions: the layout policy's history.
        per_batch = config.train.prompts_per_step * config.train.group_size
        self.lengths: collections.deque[int] = collections.deque(maxlen=4 * per_batch)
        self.layouts: list[dict[str, Any]] = []
        #: The generators' busy seconds so far: ``busy_base`` per member of the pool now (its
        #: counters at the start), and accelerator-seconds of pools re-sharded away.
        self.busy_base: list[float] = []
        self.busy_retired = 0.0
        # -- failures
        sizes = {"generator": config.generators, "trainer": config.trainers}
        sizes["reward"] = config.rewards
        self.watch = {role: [MemberWatch() for _ in range(sizes[role])] for role in ROLES}
        #: The trainer's (a group's: member 0's, which every death of the group moves on).
        self.trainer_watch = self.watch["trainer"][0]
        #: A data-parallel group lost a member and is not formed again yet.
        self.trainer_group_lost = False
        self.trainer_groups = 0  # groups formed again
        #: How the trainers are spawned (beside ``n``), for a group formed again.
        self.trainer_spawn: dict[str, Any] = {}
        self.recovery = asyncio.Lock()  # one recovery at a time
        #: The weights every generator should hold: the last published ref, and the trainer's
        #: epoch it was published under.
        self.current_ref: AnyWeightsRef | None = None
        self.ref_epoch = 0
        self.restarts = dict.fromkeys(ROLES, 0)
        self.redrawn = 0
        self.rescored = 0
        self.rolled_back = 0
        self.checkpoints = 0
        #: Stream modes: the generators take their work from a graph, which sends a group
        #: again when its generator dies (so a restarted one is not reset).
        self.generators_in_graph = False
        #: Stream modes: ends the graph's run, whose groups a rollback voids (the next run
        #: draws them again).
        self.void_scored: Callable[[], Awaitable[None]] | None = None
        self.background = TaskOwner()  # recoveries, ended by stop()
        self.failure: BaseException | None = None
        self.failed = asyncio.Event()
        self.checkpoint_dir = config.checkpoint_dir
        self.own_checkpoint_dir = False
        self.checkpoint_base = ""
        #: The last checkpoint known to hold the job's trainer state.
        self.checkpoint_path: str | None = None
        self.step_epoch = 0  # the trainer's epoch when the batch in progress began
        self.digests: list[str] = []  # every trainer's at the end
        self.reference: Any = None  # the KL penalty's frozen policy, when it has one
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

    async def on_trainer(self, endpoint: str, *args: Any) -> Any:
        """The trainer's answer: member 0's, asked of every member when they are sharded."""
        return await call_trainer(self.trainers, self.sharded, endpoint, *args)

    @property
    def trainer_restarts(self) -> bool:
        return self.cfg.checkpoint_every > 0

    @property
    def sharded(self) -> bool:
        return bool(self.cfg.trainer_options.get("sharding") == "full")

    async def spawn(self) -> None:
        """Spawn the roles (and start from the checkpoint a resumed run goes on from)."""
        await spawn_roles(self)

    def checkpoint_base_path(self) -> str:
        """Where the trainer's checkpoints go (a temporary folder unless the config names one)."""
        if self.checkpoint_dir is None:
            self.checkpoint_dir = tempfile.mkdtemp(prefix="orchestr-grpo-")
            self.own_checkpoint_dir = True
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        return os.path.join(os.path.abspath(self.checkpoint_dir), "trainer")

    async def stop(self) -> None:
        await self.background.aclose()
        if self.injector is not None:
            await self.injector.aclose()
        for role in ("gens", "trainers", "rewards", "reference"):  # those spawned
            mesh = getattr(self, role, None)
            if mesh is not None:
                await self.ctx.stop(mesh)
        if self.own_checkpoint_dir and self.checkpoint_dir is not None:
            shutil.rmtree(self.checkpoint_dir, ignore_errors=True)
        if self.model_dir is not None:
            shutil.rmtree(self.model_dir, ignore_errors=True)

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
    def hook(self, role: str) -> Callable[[oc.Failure], None]:
        """The ``supervise`` hook of ``role``'s mesh: it runs as the death is heard, before the
        restart is asked for, and leaves the decision to the restart policy."""

        def on_failure(failure: oc.Failure) -> None:
            self.watch[role][failure.rank].lost()
            if not failure.can_restart:
                return  # the policy escalates: the job fails with the death
            self.restarts[role] += 1
            if role == "generator":
                self._background(recover_generator(self, failure.rank))

        return on_failure

    def _background(self, coro: Any) -> None:
        if self.background.closed:  # a death heard as the job stops: nothing to recover for
            coro.close()
            return
        task = self.background.start(coro)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()
            self.failed.set()

    async def generator_stats(self) -> list[dict[str, Any]]:
        """Every generator's counters, asked again of one that dies meanwhile."""

        async def one(i: int) -> dict[str, Any]:
            watch = self.watch["generator"][i]
            while True:
                await ready(self, watch)
                epoch = watch.epoch
                try:
                    stats: dict[str, Any] = await self.gens[i].stats.call_one()
                    return stats
                except oc.OrchestrError as exc:
                    if not await lost_during([watch], [epoch], exc):
                        raise

        return list(await asyncio.gather(*(one(i) for i in range(len(self.gens)))))

    def busy_since_base(self, stats: Sequence[dict[str, Any]]) -> float:
        """Accelerator-seconds the pool now was busy since :attr:`busy_base` (a restarted
        generator counts from zero again)."""
        busy = [
            float(s["busy_s"]) - (b if s["busy_s"] >= b else 0.0)
            for b, s in zip(self.busy_base, stats, strict=True)
        ]
        return sum(busy) * self.gen_tp

    # -- shared pieces -----------------------------------------------------------------------
    async def sync_weights(self) -> int:
        """Publish the trainer's weights and load them into every generator."""
        return await self.load(await self.publish())

    async def publish(self) -> AnyWeightsRef:
        self.phase = "sync"
        ref = await publish_weights(self.trainers, self.sharded)
        # from the trainer the batch began with, unless it died meanwhile (then the batch is
        # rolled back, and loads of this ref count as lost)
        self.current_ref, self.ref_epoch = ref, self.step_epoch
        return ref

    async def load(self, ref: AnyWeightsRef) -> int:
        self.weight_bytes = ref.nbytes
        # every generator reads the whole of the weights from the publishing trainer
        traffic = {(self.trainers.name, self.gens.name): ref.nbytes * len(self.gens)}
        async with self.ctx.phase("weight_sync", traffic=traffic):
            loads = [self.load_one(i, ref) for i in range(len(self.gens))]
            reports = [r for r in await asyncio.gather(*loads) if r is not None]
        if ref.version > 0:  # the first load also allocates the loaders' buffers
            self.sync_times.extend(r["seconds"] for r in reports)
        if reports:
            self.sync_bytes = int(reports[0]["bytes"])
        self.sync_transports.update(t for r in reports for t in r["transports"])
        return int(ref.version)

    async def load_one(self, i: int, ref: AnyWeightsRef) -> dict[str, Any] | None:
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
        payload = self.source.reward_payload(completions)
        rewards = self.source.rewards(await self.score_payload(payload))
        return self.source.shape(completions, rewards)

    async def score_payload(self, payload: list[Any]) -> Any:
        """The reward mesh's answer for ``payload``, asked again of a restarted worker."""
        watches = self.watch["reward"]
        endpoint = getattr(self.rewards, self.source.reward_endpoint)
        while True:
            epochs = [w.epoch for w in watches]
            try:
                return await endpoint.choose(payload)
            except Exception as exc:
                if not await lost_during(watches, epochs, exc):
                    raise
                # scoring is pure: the same samples again, on the restarted worker
                self.rescored += len(payload)

    async def with_reference(self, groups: list[list[tuple[Completion, float]]]) -> list[list[Any]]:
        """``groups``' samples as dicts carrying the reference policy's log-probs of their
        tokens (the KL penalty's), asked again of a restarted reference."""
        samples = [c for g in groups for c, _ in g]
        for attempt in range(self.cfg.max_restarts + 1):
            try:
                ref: list[list[float]] = await self.reference.completion_logprobs.call_one(samples)
                break
            except oc.ActorDiedError:
                if attempt == self.cfg.max_restarts:
                    raise
                await asyncio.sleep(0.5)  # being restarted: it holds nothing to lose
        logprobs = iter(ref)
        return [[_with_ref(c, r, next(logprobs)) for c, r in g] for g in groups]

    async def train(self, groups: list[list[tuple[Completion, float]]]) -> dict[str, Any]:
        self.phase = "train"
        n = self.cfg.trainers
        per = len(groups) // n
        batch: list[list[Any]] = list(groups)
        if self.reference is not None:
            batch = await self.with_reference(groups)
        shards = [[s for g in batch[i * per : (i + 1) * per] for s in g] for i in range(n)]
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

    async def export(self, version: int) -> str:
        """The trainer's weights as a Hugging Face folder beside the final one's
        (``model-00020/`` for version 20)."""
        assert self.cfg.export_dir is not None
        folder = f"{self.cfg.export_dir.rstrip(os.sep)}-{version:05d}"
        exported: str = await self.on_trainer("export_hf", folder, None, True)
        return exported

    async def evaluate(self, version: int) -> float:
        self.phase = "eval"
        prompts, caps = self.source.held_out()
        completions = await self.on_trainer("greedy", prompts, caps)
        payload = self.source.held_out_payload(completions)
        rewards = None
        if payload is not None:
            rewards = self.source.rewards(await self.score_payload(payload), held_out=True)
        accuracy = self.source.held_out_score(completions, rewards)
        self.evals.append((version, accuracy, clock.perf_counter() - self.start))
        return accuracy


def _with_ref(c: Completion, reward: float, ref: list[float]) -> dict[str, Any]:
    return {
        "prompt": c.prompt,
        "tokens": c.tokens,
        "sample_logprobs": c.sample_logprobs,
        "version": c.version,
        "finish_reason": c.finish_reason,
        "reward": reward,
        "ref_logprobs": ref,
    }


def group_key(request_id: str) -> str:
    """A request's group: ``"step/index"`` of ``"step/index/sample"``."""
    return request_id.rsplit("/", 1)[0]


async def first_of(awaitable: Any, tasks: Sequence[asyncio.Task[None]]) -> Any:
    """Await ``awaitable``, raising at once if a background task failed meanwhile."""
    async with TaskOwner() as owner:  # a failure cancels ``awaitable`` on the way out
        main = owner.start(awaitable)
        while True:
            await asyncio.wait([main, *tasks], return_when=asyncio.FIRST_COMPLETED)
            if main.done():
                return main.result()
            for t in tasks:
                if t.done():
                    t.result()  # raises the task's error
                    raise RuntimeError("a stream task ended early")
