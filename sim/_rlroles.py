"""The RL job's roles as models on virtual time, for the job's own code to drive.

Each stands in for a role's actor on a :class:`~._cluster.SimCluster`, answering the calls the
GRPO job makes with what they return and taking the time they take:

- :class:`GeneratorModel`: ``generate`` runs the requests through the generator's own
  scheduler (:class:`~._generation.SimGenerator`, steps timed by a
  :class:`~._generation.StepTimeModel`), each to the output length :class:`OutputLengths`
  draws for it; ``sync_weights`` reads the published weights from the trainer's host over the
  flow network;
- :class:`TrainerModel`: ``train_step`` charges compute per token of its shard, then joins
  the mesh's gradient all-reduce over the flow network; ``publish`` makes a new version;
- :class:`RewardModel`: ``score`` charges per sample and draws each reward.

What a run costs is in :class:`RLCosts`. Tokens are not computed: a completion's ``tokens`` is
a ``range`` of its length (nothing the job reads needs their values).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import math
import random
from collections.abc import Sequence
from typing import Any

from orchestr.roles.generator import Completion, Generator, Request
from orchestr.roles.reward import Reward
from orchestr.roles.rl import LengthRanker
from orchestr.roles.trainer import Trainer

from ._cluster import Role, SimMember
from ._cpu import nice_weight
from ._generation import RequestTimes, SimGenerator, StepTimeModel

__all__ = [
    "LENGTHS",
    "GeneratorModel",
    "OracleRanker",
    "OutputLengths",
    "RLCosts",
    "RandomRanker",
    "RewardModel",
    "TrainerModel",
    "rl_roles",
]


@dataclasses.dataclass(frozen=True)
class OutputLengths:
    """Output tokens of a sample: ``per_prompt_token`` times its prompt's tokens, times a
    log-normal factor of mean 1 and shape ``sigma`` drawn for the prompt (some prompts lead
    to long answers: the tail StreamRL's skew-aware dispatch is for; 0: none), times one of
    shape ``sample_sigma`` drawn for the sample; at least 1 and at most ``cap``. Drawn from
    the prompt, the sample's key and ``seed``, so a sample drawn again has the same length,
    and a prompt length's mean is what a ranker that learns by prompt length can learn.

    ``requested``: every sample runs to its request's ``max_new_tokens`` instead (a task whose
    answers stop at a known length, as the digit tasks' do), and the draw is not used."""

    per_prompt_token: float = 4.0
    sigma: float = 0.0
    cap: int = 1 << 15
    seed: int = 0
    sample_sigma: float = 0.0
    requested: bool = False

    def __post_init__(self) -> None:
        if not self.per_prompt_token > 0 or not self.sigma >= 0 or not self.sample_sigma >= 0:
            raise ValueError("OutputLengths: per_prompt_token > 0, sigma and sample_sigma >= 0")
        if isinstance(self.cap, bool) or not isinstance(self.cap, int) or self.cap < 1:
            raise ValueError(f"OutputLengths.cap is a positive integer, got {self.cap!r}")

    def expected(self, prompt: Sequence[int]) -> float:
        """A prompt's expected length before the cap (what an oracle ranker knows)."""
        base = self.per_prompt_token * len(prompt)
        if self.sigma:
            rng = random.Random(f"{list(prompt)}/{self.seed}")  # stable: seeded by sha512
            base *= math.exp(rng.gauss(-(self.sigma**2) / 2, self.sigma))
        return base

    def draw(self, request: Request) -> int:
        if self.requested:
            return max(1, request.max_new_tokens)
        length = self.expected(request.prompt)
        if self.sample_sigma:
            rng = random.Random(f"{request.seed}/{request.id}/{self.seed}")
            length *= math.exp(rng.gauss(-(self.sample_sigma**2) / 2, self.sample_sigma))
        return max(1, min(self.cap, round(length)))


#: The lengths of the simulation in progress, for the rankers below.
LENGTHS: contextvars.ContextVar[OutputLengths] = contextvars.ContextVar("orchestr_sim_lengths")


class OracleRanker(LengthRanker):
    """stream+skew's ranker knowing each prompt's expected length (``GRPOConfig(ranker=
    "orchestr.sim:OracleRanker")``, in a simulation): the best a predictor can do."""

    def __init__(self) -> None:
        super().__init__()
        self.lengths = LENGTHS.get()

    def predict(self, prompt: Sequence[int], max_new_tokens: int) -> float:
        return min(float(self.lengths.cap), self.lengths.expected(prompt))


class RandomRanker(LengthRanker):
    """stream+skew's ranker with no idea: random predictions, so random groups go to the
    long generators (``GRPOConfig(ranker="orchestr.sim:RandomRanker")``)."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(LENGTHS.get().seed)

    def predict(self, prompt: Sequence[int], max_new_tokens: int) -> float:
        return self.rng.random()


@dataclasses.dataclass(frozen=True)
class RLCosts:
    """What an RL step's roles cost. ``generation``: each generator's step time; the
    generator's scheduler holds ``num_blocks`` blocks of ``block_size`` tokens and
    ``token_budget`` tokens a step (its batch limit is the job's ``max_batch``). A trainer
    step: ``train_step_s`` plus ``train_token_s`` per token (prompt and output) of the
    trainer's shard, then an all-reduce of ``weight_bytes`` over the trainer mesh. A weight
    load: ``publish_s`` on the trainer, ``weight_bytes`` from its host, then ``load_s``.
    Scoring: ``score_s`` per sample; rewards are 1 with probability ``reward_p``. A held-out
    evaluation: ``eval_s``. ``engine``: the generators' (``paged``, or ``recompute``: each
    step timed as the recompute engine runs it, see
    :func:`~._generation.recompute_features`). An actor call (``generate``, ``score``,
    ``train_step``) costs ``call_s`` plus ``call_item_s`` per request, pair or sample it
    carries beyond its work (serialising them both ways), charged before it. Compute is
    charged to the host's cores when the cluster models them (a generator's steps and loads
    at its ``nice``; calls at nice 0)."""

    generation: StepTimeModel
    weight_bytes: int
    train_token_s: float
    train_step_s: float = 0.0
    load_s: float = 0.0
    score_s: float = 0.0
    eval_s: float = 0.0
    publish_s: float = 0.0
    call_s: float = 0.0
    call_item_s: float = 0.0
    reward_p: float = 0.5
    num_blocks: int = 1 << 16
    block_size: int = 16
    token_budget: int = 8192
    engine: str = "paged"

    def __post_init__(self) -> None:
        if self.engine not in ("paged", "recompute"):
            raise ValueError(f"RLCosts.engine is paged or recompute, got {self.engine!r}")
        for name in (
            "train_token_s",
            "train_step_s",
            "load_s",
            "score_s",
            "eval_s",
            "publish_s",
            "call_s",
            "call_item_s",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"RLCosts.{name} is seconds >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.reward_p <= 1:
            raise ValueError(f"RLCosts.reward_p is a probability, got {self.reward_p!r}")
        if isinstance(self.weight_bytes, bool) or not self.weight_bytes >= 0:
            raise ValueError(f"RLCosts.weight_bytes is >= 0, got {self.weight_bytes!r}")

    def to_json(self) -> dict[str, Any]:
        """A profile: the generators' step-time model under ``step_time`` (where a
        ``[profile] file`` of a scenario reads it) and the rest under ``rl_costs``."""
        rest = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {"step_time": rest.pop("generation").to_json(), "rl_costs": rest}

    @classmethod
    def from_json(cls, data: Any) -> RLCosts:
        """The costs :meth:`to_json` wrote; ``ValueError`` names a missing, unknown or bad
        field."""
        if not isinstance(data, dict) or not isinstance(data.get("rl_costs"), dict):
            raise ValueError("an RL profile is a JSON object with rl_costs and step_time")
        known = {f.name for f in dataclasses.fields(cls)} - {"generation"}
        unknown = sorted(set(data["rl_costs"]) - known)
        if unknown:
            raise ValueError(f"unknown rl_costs field(s) {unknown}; known: {sorted(known)}")
        if "weight_bytes" not in data["rl_costs"]:
            raise ValueError("rl_costs needs weight_bytes")
        generation = StepTimeModel.from_json(data.get("step_time", {}))
        try:
            return cls(generation=generation, **data["rl_costs"])
        except TypeError as exc:
            raise ValueError(f"rl_costs: {exc}") from None

    @classmethod
    def load(cls, path: str) -> RLCosts:
        """The costs in the profile at ``path``; ``OSError``, or ``ValueError`` naming what
        is wrong."""
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except ValueError as exc:
                raise ValueError(f"not JSON ({exc})") from None
        return cls.from_json(data)


async def charge_call(member: SimMember, costs: RLCosts, items: int) -> None:
    """What an actor call carrying ``items`` costs beyond its work (:class:`RLCosts`)."""
    seconds = costs.call_s + costs.call_item_s * items
    if seconds:
        await member.cluster.compute(member.host, seconds)


@dataclasses.dataclass(frozen=True)
class Weights:
    """A published version, as the job sees one: its number, size and where it is."""

    version: int
    nbytes: int
    host: str


class GeneratorModel:
    """A generator: the real scheduler on virtual time."""

    concurrent = frozenset({"generate", "stats", "sync_weights"})

    def __init__(
        self,
        member: SimMember,
        costs: RLCosts,
        lengths: OutputLengths,
        max_batch: int,
        nice: int = 0,
    ) -> None:
        self.member = member
        self.costs, self.lengths = costs, lengths
        self.weight = nice_weight(nice)
        self.engine = SimGenerator(
            member.cluster.engine,
            costs.generation,
            num_blocks=costs.num_blocks,
            block_size=costs.block_size,
            max_batch=max_batch,
            token_budget=costs.token_budget,
            done=self._done,
            cache_outputs=False,  # placeholder outputs: every sample of a group would share
            recompute=costs.engine == "recompute",
            cpu=member.cluster.cpu.get(member.host),
            weight=self.weight,
        )
        self.version = 0
        self.generated = 0
        self._waiting: dict[str, asyncio.Future[RequestTimes]] = {}
        self._ids = 0

    def _done(self, times: RequestTimes) -> None:
        self._waiting.pop(times.id).set_result(times)

    async def generate(self, requests: list[Request]) -> list[Completion]:
        await charge_call(self.member, self.costs, len(requests))
        loop = asyncio.get_running_loop()
        version = self.version
        runs = []
        for r in requests:
            self._ids += 1
            key = f"{r.id}#{self._ids}"  # a request drawn again is a new one here
            self._waiting[key] = future = loop.create_future()
            self.engine.submit(key, r.prompt, self.lengths.draw(r))
            runs.append(future)
        out = []
        for r, times in zip(requests, await asyncio.gather(*runs), strict=True):
            n = times.output_tokens
            self.generated += n
            tokens: Any = range(n)  # the length is what the job reads
            done = Completion(
                id=r.id,
                prompt=r.prompt,
                tokens=tokens,
                logprobs=[],
                sample_logprobs=[],
                versions=[],
                version=version,
                finish_reason="length",
                queue_s=0.0,
                ttft_s=times.ttft,
                latency_s=times.end - times.arrival,
                steps=0,
            )
            out.append(done)
        return out

    async def sync_weights(self, ref: Weights) -> dict[str, Any]:
        start = self.member.cluster.engine.seconds
        await self.member.cluster.transfer(ref.host, self.member.host, ref.nbytes)
        if self.costs.load_s:
            await self.member.cluster.compute(self.member.host, self.costs.load_s, self.weight)
        self.version = ref.version
        seconds = self.member.cluster.engine.seconds - start
        return {"seconds": seconds, "bytes": ref.nbytes, "transports": ["sim"]}

    async def stats(self) -> dict[str, Any]:
        return {
            "busy_s": self.engine.busy_s,
            "steps": self.engine.steps,
            "generated_tokens": self.generated,
        }


class TrainerModel:
    """A trainer rank: compute per token of its shard, then the mesh's all-reduce."""

    concurrent = frozenset({"digest"})

    def __init__(self, member: SimMember, costs: RLCosts) -> None:
        self.member, self.costs = member, costs
        self.version = 0
        self.busy_s = 0.0

    async def train_step(
        self, samples: Sequence[tuple[Completion, float]], group_size: int, advantage_scale: float
    ) -> dict[str, Any]:
        cluster = self.member.cluster
        await charge_call(self.member, self.costs, len(samples))
        start = cluster.engine.seconds
        tokens = sum(len(c.prompt) + len(c.tokens) for c, _ in samples)
        work = self.costs.train_step_s + self.costs.train_token_s * tokens
        await cluster.compute(self.member.host, work)
        if self.member.size > 1:
            key = ("grads", self.member.mesh, self.version)
            hosts = self.member.hosts
            await cluster.collective(key, "all_reduce", hosts, self.costs.weight_bytes)
        self.version += 1
        busy = cluster.engine.seconds - start
        self.busy_s += busy
        zero = {k: 0.0 for k in ("loss", "clip_frac", "approx_kl", "entropy", "logprob_gap")}
        return {"version": self.version, "busy_s": busy, **zero}

    async def publish(self) -> Weights:
        if self.costs.publish_s:
            await self.member.cluster.compute(self.member.host, self.costs.publish_s)
        return Weights(self.version, self.costs.weight_bytes, self.member.host)

    async def greedy(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[list[int]]:
        await self.member.cluster.compute(self.member.host, self.costs.eval_s)
        return [[] for _ in prompts]

    async def digest(self) -> dict[str, Any]:
        return {"digest": f"sim-v{self.version}"}


class RewardModel:
    """A reward worker: ``score_s`` per sample, rewards drawn from the engine's seed."""

    concurrent = frozenset({"score"})

    def __init__(self, member: SimMember, costs: RLCosts) -> None:
        self.member, self.costs = member, costs

    async def score(self, pairs: list[Any]) -> list[float]:
        await charge_call(self.member, self.costs, len(pairs))
        await self.member.cluster.compute(self.member.host, self.costs.score_s * len(pairs))
        rng = self.member.cluster.engine.rng
        return [float(rng.random() < self.costs.reward_p) for _ in pairs]


def rl_roles(
    costs: RLCosts,
    lengths: OutputLengths,
    *,
    generator: dict[str, float] | None = None,
    trainer: dict[str, float] | None = None,
    reward: dict[str, float] | None = None,
) -> dict[type, Role]:
    """The GRPO job's three roles on a simulated cluster, each member taking the resources
    given (default: one ``gpu`` for a generator or trainer, one ``cpu`` for a reward)."""

    def make_generator(member: SimMember, *args: Any, **kwargs: Any) -> GeneratorModel:
        max_batch = int(kwargs.get("max_batch", 256))
        return GeneratorModel(member, costs, lengths, max_batch, int(kwargs.get("nice", 0)))

    return {
        Generator: Role(make_generator, generator or {"gpu": 1}),
        Trainer: Role(lambda m, *a, **k: TrainerModel(m, costs), trainer or {"gpu": 1}),
        Reward: Role(lambda m, *a, **k: RewardModel(m, costs), reward or {"cpu": 1}),
    }
