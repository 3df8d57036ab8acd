"""OrchestrRL's adaptive generation parallelism: which tensor-parallel degree the generator
pool should run at, from what the controller sees.

A pool of ``accelerators`` runs ``accelerators / d`` replicas of degree ``d``. Early in a
step, the queue is long. Each replica's batch is large, and what matters is throughput:
more replicas of a low degree, since every all-reduce of a higher one costs. Late in a step,
a few long requests remain. Each decode iteration then reads the weights for a batch of one
or two, and a higher degree reads them faster: the tail ends sooner. OrchestrRL re-picks the
degree within and across steps (up to 1.42x on 64 H800s). :func:`choose_layout` is that
choice, as a pure function of a :class:`LayoutView`:

- the requests in flight or queued, each its prompt and the tokens it has produced;
- the output lengths of the last steps;
- the phase;
- the degree now.

It also takes :class:`LayoutCosts`. For each allowed degree, it predicts when the step's
generation would end. The requests' remaining tokens are drawn from the history: each
request is given a quantile of the lengths longer than what it has produced, the quantiles
spread evenly, so the predicted work has the history's tail. The requests are then dealt to
replicas, longest first. Each
replica decodes its batch with the iteration cost of :meth:`LayoutCosts.iteration_s`,
admitting requests while their KV fits. A degree other than the current one is charged
:attr:`LayoutCosts.reshard_s`. The choice is the fastest degree, and it moves only when the
gain beats the current degree by ``margin``. The live RL job and the simulator
(:mod:`orchestr.sim`) call the same function.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from collections.abc import Sequence

__all__ = ["LayoutChoice", "LayoutCosts", "LayoutView", "choose_layout", "expected_remaining"]

PHASES = ("generate", "between_steps")


@dataclasses.dataclass(frozen=True)
class LayoutCosts:
    """A replica's decode iteration at degree ``d``, ``b`` sequences and ``c`` context
    tokens in all: ``base_s / d`` (reading the weights) ``+ decode_s * b / d`` (each
    sequence's products) ``+ attention_s * c / d`` (reading the KV) ``+ 2 * layers * 2 (d -
    1) * (allreduce_alpha_s + b * row_bytes / d * allreduce_byte_s)`` (two ring all-reduces a
    layer of each sequence's hidden row, at degree > 1: ``2 (d - 1)`` rounds, each a
    latency and a ``1 / d`` share of the rows). The first three terms are divided not by
    ``d`` but by ``d * scaling ** log2(d)``: each doubling keeps ``scaling`` of the ideal
    speedup (smaller products run further from peak; ``1``: ideal). A device holds
    ``device_bytes``: its ``weight_bytes / d`` share and then KV at ``kv_bytes_per_token``.
    Changing the degree costs ``reshard_s``."""

    base_s: float
    decode_s: float
    attention_s: float
    layers: int
    row_bytes: float
    allreduce_alpha_s: float
    allreduce_byte_s: float
    device_bytes: float
    weight_bytes: float
    kv_bytes_per_token: float
    reshard_s: float
    scaling: float = 1.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"LayoutCosts.{f.name} is a number >= 0, got {value!r}")

    def iteration_s(self, degree: int, batch: int, context: float) -> float:
        """Seconds for one decode iteration of a replica of ``degree``."""
        speedup = degree * float(self.scaling ** math.log2(degree))
        t = (self.base_s + self.decode_s * batch + self.attention_s * context) / speedup
        if degree > 1:
            round_s = (
                self.allreduce_alpha_s + batch * self.row_bytes / degree * self.allreduce_byte_s
            )
            t += 2 * self.layers * 2 * (degree - 1) * round_s
        return t

    def iterations_s(self, degree: int, batch: int, context: float, m: float) -> float:
        """Seconds for ``m`` iterations of a replica of ``degree`` from ``context`` tokens, the
        context growing by ``batch`` (a token a sequence) each (summed in closed form)."""
        speedup = degree * float(self.scaling ** math.log2(degree))
        grow = self.attention_s * batch / speedup
        return float(m * self.iteration_s(degree, batch, context) + grow * m * (m - 1) / 2)

    def kv_tokens(self, degree: int) -> float:
        """The context tokens a replica of ``degree`` holds beside its weights."""
        return max(0.0, degree * self.device_bytes - self.weight_bytes) / self.kv_bytes_per_token


@dataclasses.dataclass(frozen=True)
class LayoutView:
    """What the controller sees: ``accelerators`` in the pool, the ``degree`` it runs now,
    the ``degrees`` it may take, the ``requests`` in flight or queued as ``(prompt_tokens,
    produced_tokens)``, the output ``history`` of the last steps, ``max_tokens`` a request
    may produce, and the ``phase`` (``"generate"``: within a step; ``"between_steps"``: the
    next step's queue, nothing produced yet)."""

    accelerators: int
    degree: int
    degrees: tuple[int, ...]
    requests: tuple[tuple[int, int], ...]
    history: tuple[int, ...]
    max_tokens: int
    phase: str = "generate"

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase is one of {PHASES}, got {self.phase!r}")
        if not self.degrees or any(
            not isinstance(d, int) or d < 1 or self.accelerators % d for d in self.degrees
        ):
            raise ValueError(
                f"degrees must divide the {self.accelerators} accelerators, got {self.degrees!r}"
            )
        if self.degree not in self.degrees:
            raise ValueError(f"the current degree {self.degree} is not among {self.degrees}")
        if self.max_tokens < 1 or any(p < 0 or g < 0 for p, g in self.requests):
            raise ValueError("max_tokens >= 1, and token counts >= 0")


@dataclasses.dataclass(frozen=True)
class LayoutChoice:
    """The ``degree`` to run (``current``: the one it runs now), and the predicted seconds to
    the step's end at each degree (the change charged where it is one)."""

    degree: int
    current: int
    predicted_s: dict[int, float]

    @property
    def changes(self) -> bool:
        return self.degree != self.current


def expected_remaining(history: Sequence[int], produced: int, max_tokens: int) -> float:
    """The tokens a request that has produced ``produced`` is expected to produce more: the
    mean of ``L - produced`` over the lengths ``L`` of ``history`` longer than
    ``produced``. Past every length seen, half as many again as it has. Never past
    ``max_tokens``, never below one."""
    return _Lengths(history).remaining(produced, max_tokens)


class _Lengths:
    """``history`` sorted, with its suffix sums: :func:`expected_remaining` in a bisection."""

    def __init__(self, history: Sequence[int]) -> None:
        self.ordered = sorted(history)
        self.suffix = [0.0] * (len(self.ordered) + 1)
        for i in range(len(self.ordered) - 1, -1, -1):
            self.suffix[i] = self.suffix[i + 1] + self.ordered[i]

    def remaining(self, produced: int, max_tokens: int) -> float:
        left = max(1, max_tokens - produced)
        at = bisect.bisect_right(self.ordered, produced)
        longer = len(self.ordered) - at
        if not longer:
            return float(min(left, max(1, produced // 2)))
        return float(min(left, max(1.0, self.suffix[at] / longer - produced)))

    def quantile(self, produced: int, q: float, max_tokens: int) -> float:
        """The ``q`` quantile of ``L - produced`` over the lengths longer than ``produced``
        (past every length seen, :meth:`remaining`'s guess)."""
        at = bisect.bisect_right(self.ordered, produced)
        longer = len(self.ordered) - at
        if not longer:
            return self.remaining(produced, max_tokens)
        pick = self.ordered[at + min(longer - 1, int(q * longer))]
        return float(min(max(1, max_tokens - produced), max(1, pick - produced)))


def finish_s(
    costs: LayoutCosts, degree: int, replicas: int, requests: Sequence[tuple[float, float]]
) -> float:
    """Seconds until every one of ``requests`` (``(context_tokens, remaining_tokens)``)
    ends, on ``replicas`` replicas of ``degree``: requests dealt longest first to the replica
    with the least work, each replica decoding its batch while the KV fits."""
    loads: list[tuple[float, int]] = [(0.0, r) for r in range(replicas)]
    shares: list[list[tuple[float, float]]] = [[] for _ in range(replicas)]
    for ctx, left in sorted(requests, key=lambda x: -x[1]):
        work, r = heapq.heappop(loads)
        shares[r].append((ctx, left))
        heapq.heappush(loads, (work + left, r))
    capacity = costs.kv_tokens(degree)
    return max((replica_s(costs, degree, s, capacity) for s in shares if s), default=0.0)


def replica_s(
    costs: LayoutCosts, degree: int, requests: Sequence[tuple[float, float]], capacity: float
) -> float:
    """One replica's seconds to finish ``requests``: the batch is every admitted request, in
    the given order, while their final contexts fit ``capacity``. Between two ends, the
    batch decodes with its context growing a token a sequence an iteration (summed in
    closed form)."""
    waiting = list(requests)
    waiting.reverse()
    running: list[tuple[float, float]] = []  # (the step it ends, its context at its start)
    done = 0.0  # iterations so far
    held = 0.0  # final contexts admitted
    context = 0.0
    elapsed = 0.0

    def admit() -> None:
        nonlocal held, context
        while waiting and (not running or held + waiting[-1][0] + waiting[-1][1] <= capacity):
            ctx, left = waiting.pop()
            held += ctx + left
            context += ctx
            heapq.heappush(running, (done + math.ceil(left), ctx + math.ceil(left)))

    admit()
    while running:
        end = running[0][0]
        m = end - done
        b = len(running)
        if m > 0:
            elapsed += costs.iterations_s(degree, b, context, m)
            context += b * m
            done = end
        while running and running[0][0] <= done:
            _, final = heapq.heappop(running)
            context -= final
            held -= final
        admit()
    return elapsed


def choose_layout(view: LayoutView, costs: LayoutCosts, *, margin: float = 0.05) -> LayoutChoice:
    """The degree the pool should run at (see the module docstring): the fastest predicted
    end, moving off the current degree only when it beats it by ``margin`` (a fraction)."""
    lengths = _Lengths(view.history)
    n = len(view.requests)
    # each request a quantile of its conditional length, spread evenly: the requests' remaining
    # work as a whole has the history's shape, its long tail included (the mean alone would
    # predict no tail, and the tail is what a higher degree shortens)
    remaining = [
        (float(p + g), lengths.quantile(g, (j + 0.5) / n, view.max_tokens))
        for j, (p, g) in enumerate(view.requests)
    ]
    predicted = {}
    for d in view.degrees:
        t = finish_s(costs, d, view.accelerators // d, remaining)
        predicted[d] = t + (costs.reshard_s if d != view.degree else 0.0)
    best = min(predicted, key=lambda d: (predicted[d], d))
    if best != view.degree and predicted[best] > (1 - margin) * predicted[view.degree]:
        best = view.degree
    return LayoutChoice(best, view.degree, predicted)
