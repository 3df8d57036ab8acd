"""Generation on virtual time: the generator's own scheduler, with a step-time model for the
model's work.

:class:`SimGenerator` holds the real :class:`orchestr.roles.generator.Scheduler` over a real
block pool (continuous batching, chunked prefill, the prefix cache, preemption: the objects
the paged engine runs) and charges each step the seconds a :class:`StepTimeModel` gives for
what the step computes, so queueing, batching and cache hits come from the real code and only
the matrix work is modelled. Tokens are not computed: a request ends at its ``max_tokens``
(its output length is the workload's), which is what a benchmark with ``ignore_eos`` does.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from orchestr.roles.generator import BlockPool, Scheduler, Seq, Step

from ._engine import NS, Engine

__all__ = ["RequestTimes", "SimGenerator", "StepTimeModel", "fit_step_model"]

FEATURES = ("steps", "tokens", "sequences", "context_tokens")


@dataclasses.dataclass(frozen=True)
class StepTimeModel:
    """Seconds for one engine step: ``base_s`` + ``token_s`` per token computed (prefill and
    decode alike: the weights' products) + ``sequence_s`` per sequence in the step (sampling,
    bookkeeping) + ``context_s`` per key a step's queries attend to (the attention over the
    cache, summed over sequences). ``machine`` says where it was measured."""

    base_s: float
    token_s: float
    sequence_s: float = 0.0
    context_s: float = 0.0
    machine: str = ""

    def __post_init__(self) -> None:
        for name in ("base_s", "token_s", "sequence_s", "context_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0):
                raise ValueError(f"StepTimeModel.{name} is seconds >= 0, got {value!r}")

    def seconds(self, tokens: int, sequences: int, context_tokens: int) -> float:
        return (
            self.base_s
            + self.token_s * tokens
            + self.sequence_s * sequences
            + self.context_s * context_tokens
        )

    def step_seconds(self, step: Step) -> float:
        """The model's time for ``step`` (what a scheduler's ``schedule()`` returned)."""
        return self.seconds(*features(step))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepTimeModel:
        """A model from :meth:`to_json`'s dict; ``ValueError`` names a missing, unknown or bad
        field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a step-time profile is a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown step-time field(s) {unknown}; known: {sorted(known)}")
        for name in ("base_s", "token_s"):
            if name not in data:
                raise ValueError(f"a step-time profile needs {name}")
        return cls(**dict(data))

    @classmethod
    def load(cls, path: str) -> StepTimeModel:
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except ValueError as exc:
                raise ValueError(f"{path}: not JSON ({exc})") from None
        try:
            return cls.from_json(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None


def features(step: Step) -> tuple[int, int, int]:
    """``(tokens, sequences, context_tokens)`` of a step: tokens computed, sequences in it,
    and keys attended (each sequence's cache after the step, counted once per sequence)."""
    tokens = sequences = context = 0
    for seq, n in step.scheduled:
        tokens += n
        sequences += 1
        context += seq.num_computed + n
    return tokens, sequences, context


def fit_step_model(
    samples: Sequence[tuple[int, int, int, float]], machine: str = ""
) -> StepTimeModel:
    """Least squares over measured steps ``(tokens, sequences, context_tokens, seconds)``:
    coefficients that come out negative are dropped (held at 0) and the rest fitted again.
    Raises ``ValueError`` with fewer samples than coefficients."""
    names = ["base_s", "token_s", "sequence_s", "context_s"]
    rows = [[1.0, float(t), float(s), float(c)] for t, s, c, _ in samples]
    ys = [float(y) for *_, y in samples]
    active = list(range(4))
    while True:
        if len(rows) < len(active):
            raise ValueError(f"{len(rows)} measured steps cannot fit {len(active)} coefficients")
        coef = _least_squares([[r[i] for i in active] for r in rows], ys)
        negative = [i for i, c in zip(active, coef, strict=True) if c < 0]
        if not negative:
            break
        active = [i for i in active if i not in negative]
    values = dict.fromkeys(names, 0.0)
    for i, c in zip(active, coef, strict=True):
        values[names[i]] = c
    return StepTimeModel(**values, machine=machine or platform.node())


def _least_squares(x: list[list[float]], y: list[float]) -> list[float]:
    """Solve the normal equations (columns scaled to 1 first, for conditioning)."""
    k = len(x[0])
    scale = [max(abs(r[j]) for r in x) or 1.0 for j in range(k)]
    xs = [[r[j] / scale[j] for j in range(k)] for r in x]
    a = [[sum(r[i] * r[j] for r in xs) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * v for r, v in zip(xs, y, strict=True)) for i in range(k)]
    for col in range(k):  # Gaussian elimination with partial pivoting
        pivot = max(range(col, k), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) < 1e-12:
            raise ValueError("the measured steps do not vary enough to fit the step-time model")
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for i in range(col + 1, k):
            f = a[i][col] / a[col][col]
            for j in range(col, k):
                a[i][j] -= f * a[col][j]
            b[i] -= f * b[col]
    out = [0.0] * k
    for i in reversed(range(k)):
        out[i] = (b[i] - sum(a[i][j] * out[j] for j in range(i + 1, k))) / a[i][i]
    return [o / s for o, s in zip(out, scale, strict=True)]


@dataclasses.dataclass
class RequestTimes:
    """One request's life in virtual seconds: arrival, first token, end, and tokens out."""

    id: str
    arrival: float
    prompt_tokens: int
    first_token: float = -1.0
    end: float = -1.0
    output_tokens: int = 0
    cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 for a single token)."""
        n = self.output_tokens - 1
        return (self.end - self.first_token) / n if n > 0 else 0.0


class SimGenerator:
    """A generator on ``engine``'s clock: the real scheduler (``num_blocks`` blocks of
    ``block_size`` tokens, ``max_batch`` sequences and ``token_budget`` tokens a step), steps
    timed by ``model``. ``done(times)`` is called for each request that ends."""

    def __init__(
        self,
        engine: Engine,
        model: StepTimeModel,
        *,
        num_blocks: int = 4096,
        block_size: int = 16,
        max_batch: int = 256,
        token_budget: int = 2048,
        done: Callable[[RequestTimes], None] | None = None,
    ) -> None:
        self.engine, self.model = engine, model
        self.scheduler = Scheduler(
            BlockPool(num_blocks, block_size), max_batch=max_batch, token_budget=token_budget
        )
        self.done = done
        self.times: dict[str, RequestTimes] = {}
        self.finished: list[RequestTimes] = []
        self.steps = 0
        self.busy_s = 0.0
        self._stepping = False

    @property
    def load(self) -> tuple[int, int]:
        """``(running, waiting)`` sequences."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def submit(self, request_id: str, prompt: Sequence[int], max_tokens: int) -> None:
        """A request arriving now: ``prompt``'s tokens (their values matter only to the prefix
        cache) and ``max_tokens`` out. Raises ``ValueError`` for one the scheduler refuses
        (an empty prompt, or one that could never fit) and for a repeated id."""
        if request_id in self.times:
            raise ValueError(f"request {request_id!r} is already here")
        self.scheduler.add(Seq(request_id, list(prompt), max_tokens))
        self.times[request_id] = RequestTimes(request_id, self.engine.now / NS, len(prompt))
        if not self._stepping:
            self._stepping = True
            self.engine.at(self.engine.now, self._step, name="generator step")

    def _step(self) -> None:
        step = self.scheduler.schedule()
        if not step.scheduled:
            self._stepping = False
            return
        seconds = self.model.step_seconds(step)
        self.steps += 1
        self.busy_s += seconds
        self.engine.after(seconds, self._finish, step, name="generator step done")

    def _finish(self, step: Step) -> None:
        now = self.engine.now / NS
        sampled = {}
        for seq, n in step.scheduled:
            if step.samples(seq, n):
                sampled[seq.id] = 0
                times = self.times[seq.id]
                if times.first_token < 0:
                    times.first_token = now
                    times.cached_tokens = seq.cached_tokens
                times.output_tokens += 1
        for seq in self.scheduler.update(step, sampled):
            times = self.times.pop(seq.id)
            times.end = now
            times.output_tokens = len(seq.output)
            self.finished.append(times)
            if self.done is not None:
                self.done(times)
        self._step()
