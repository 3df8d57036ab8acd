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

The phases declare their traffic to the cluster's fabric manager (``ctx.phase``): ``weight_sync``
the published weights from the trainer mesh to every generator, ``training`` (with more than one
trainer) an all-reduce of gradients as large as the weights over the trainer mesh;
``generation`` moves little (prompts and completions go through the controller) and declares
nothing.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import orchestr as oc

from . import _task
from ._engine import Completion, Request
from ._reference import DEMO_CONFIG, TrainConfig, group_requests, request_digits, step_requests
from ._streaming import LengthRanker, SampleChannel
from ._weights import WeightsRef
from .generator import Generator
from .reward import Reward
from .trainer import Trainer

__all__ = ["MODES", "GRPOConfig", "GRPOResult", "LengthRanker", "StepRecord", "run_grpo"]

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
    their own it changes nothing."""

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
        if self.train.prompts_per_step % self.trainers:
            raise oc.ConfigError(
                f"prompts_per_step ({self.train.prompts_per_step}) must split evenly over "
                f"{self.trainers} trainers (each takes whole groups)"
            )


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
            "wall_s": self.wall_s,
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

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, name: str) -> None:
        if name != self._phase:
            self._phase = name
            if self.on_phase is not None:
                self.on_phase(name)

    async def spawn(self) -> None:
        tc, cfg = self.tc, self.cfg
        model = dataclasses.asdict(tc.model)
        res = {"cpu": cfg.cpu}
        self.gens = await self.ctx.spawn(
            Generator,
            seed=tc.seed,
            max_batch=cfg.max_batch,
            model_kwargs=model,
            torch_threads=cfg.torch_threads,
            nice=cfg.generator_nice,
            n=cfg.generators,
            resources=res,
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
            torch_threads=cfg.torch_threads,
            n=cfg.trainers,
            resources=res,
        )
        self.rewards = await self.ctx.spawn(Reward, n=cfg.rewards, resources=res)
        if cfg.trainers > 1:
            await self.ctx.init_distributed(self.trainers)

    async def stop(self) -> None:
        for mesh in (self.gens, self.trainers, self.rewards):
            await self.ctx.stop(mesh)

    # -- shared pieces -----------------------------------------------------------------------
    async def sync_weights(self) -> int:
        """Publish the trainer's weights and load them into every generator."""
        return await self.load(await self.publish())

    async def publish(self) -> WeightsRef:
        self.phase = "sync"
        ref: WeightsRef = await self.trainers[0].publish.call_one()
        return ref

    async def load(self, ref: WeightsRef) -> int:
        self.weight_bytes = ref.nbytes
        # every generator reads the whole of the weights from the publishing trainer
        traffic = {(self.trainers.name, self.gens.name): ref.nbytes * len(self.gens)}
        async with self.ctx.phase("weight_sync", traffic=traffic):
            reports = await self.gens.sync_weights.call(ref)
        if ref.version > 0:  # the first load also allocates the loaders' buffers
            self.sync_times.extend(r["seconds"] for r in reports)
        self.sync_bytes = int(reports[0]["bytes"])
        self.sync_transports.update(t for r in reports for t in r["transports"])
        return int(ref.version)

    async def score(self, completions: Sequence[Completion]) -> list[float]:
        pairs = [[list(request_digits(c)), c.tokens] for c in completions]
        rewards: list[float] = await self.rewards.score.choose(pairs)
        return rewards

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
        last = record.step + 1 == self.tc.steps
        if last or (record.step + 1) % self.tc.eval_every == 0:
            record = dataclasses.replace(record, accuracy=await self.evaluate(record.version))
        self.steps.append(record)
        if self.on_step is not None:
            self.on_step(record)

    # -- sync --------------------------------------------------------------------------------
    async def run_sync(self) -> None:
        n_gen, size = self.cfg.generators, self.tc.group_size
        for step in range(self.tc.steps):
            groups = _groups(step_requests(self.tc, step), size)
            per = -(-len(groups) // n_gen)
            shares = [[r for g in groups[i * per : (i + 1) * per] for r in g] for i in range(n_gen)]
            self.phase = "generate"
            async with self.ctx.phase("generation"):
                done = await asyncio.gather(
                    *(self.gens[i].generate.call_one(s) for i, s in enumerate(shares) if s)
                )
            completions = [c for part in done for c in part]
            self.phase = "score"
            rewards = await self.score(completions)
            scored = _groups(list(zip(completions, rewards, strict=True)), size)
            stats = await self.train(scored)
            await self.sync_weights()
            await self.finish_step(self.record(step, stats, scored))

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

        def drop(group: list[tuple[Completion, float]]) -> None:
            nonlocal outstanding
            outstanding -= 1
            # the prompt is drawn again under newer weights, same keys
            c0 = group[0][0]
            step, index, _ = (int(x) for x in c0.id.split("/"))
            requeue.append(group_requests(tc, step, index))
            wake = asyncio.ensure_future(notify())
            wakers.add(wake)
            wake.add_done_callback(wakers.discard)

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
                if skew:
                    heads = [g[0] for g in batch]
                    long = ranker.split(heads, len(long_ids) / cfg.generators)
                    routes: dict[int, list[Request]] = collections.defaultdict(list)
                    for g, is_long in zip(batch, long, strict=True):
                        ids = long_ids if is_long else short_ids
                        routes[ids[turn % len(ids)]].extend(g)
                        turn += 1
                        self.routed_long += is_long
                else:
                    routes = collections.defaultdict(list)
                    for g in batch:
                        routes[turn % cfg.generators].extend(g)
                        turn += 1
                await asyncio.gather(
                    *(self.gens[i].submit.call_one(rs) for i, rs in routes.items())
                )

        async def load_then_release(ref: WeightsRef, groups: int) -> None:
            nonlocal outstanding
            await self.load(ref)
            async with room:  # new prompts start under the new weights
                outstanding -= groups
                room.notify_all()

        async def collect(i: int) -> None:
            while True:
                done = await self.gens[i].next_completed.call_one(4096, 1.0)
                if not done:
                    continue
                rewards = await self.score(done)
                for c, r in zip(done, rewards, strict=True):
                    ranker.observe(c.prompt, len(c.tokens))
                    key = c.id.rsplit("/", 1)[0]
                    group = pending.setdefault(key, [])
                    group.append((c, r))
                    if len(group) == size:
                        del pending[key]
                        group.sort(key=lambda s: int(s[0].id.rsplit("/", 1)[1]))
                        await channel.put(group)

        tasks = [asyncio.create_task(feed())]
        tasks += [asyncio.create_task(collect(i)) for i in range(cfg.generators)]
        loading: asyncio.Task[None] | None = None
        try:
            version = 0
            for step in range(tc.steps):
                self.phase = "wait"
                take = channel.take(per_step, version - cfg.eta, drop)
                groups = await _first(take, tasks)
                stats = await self.train(groups)
                if loading is not None:
                    await loading
                # the generators load while the trainer goes on: the weight sync is off the
                # trainer's critical path (the publisher keeps two versions; the next
                # publish waits for this load)
                ref = await self.publish()
                version = ref.version
                loading = asyncio.create_task(load_then_release(ref, len(groups)))
                record = self.record(step, stats, groups)
                await self.finish_step(dataclasses.replace(record, dropped=channel.dropped))
            if loading is not None:
                await loading
            self.dropped = channel.dropped
        finally:
            if loading is not None:
                tasks.append(loading)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _first(awaitable: Any, tasks: list[asyncio.Task[None]]) -> Any:
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
    ``score``, ``train``, ``sync``, ``eval``, ``wait``); ``GRPOResult`` carries the figures :mod:`bench.rl_throughput` reports."""
    job = _Job(ctx, config, on_step, on_phase)
    await job.spawn()
    try:
        await job.sync_weights()  # version 0 everywhere: generators start from the trainer's
        stats0 = await job.gens.stats.call()
        job.start = time.perf_counter()
        await job.evaluate(0)
        if config.mode == "sync":
            await job.run_sync()
        else:
            await job.run_stream(skew=config.mode == "stream+skew")
        wall = time.perf_counter() - job.start
        stats1 = await job.gens.stats.call()
        digests = [d["digest"] for d in await job.trainers.digest.call()]
    finally:
        await job.stop()
    busy = [b["busy_s"] - a["busy_s"] for a, b in zip(stats0, stats1, strict=True)]
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
    )
