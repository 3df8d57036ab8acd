"""How long a schedule takes: a deterministic timing model, and each schedule's closed form.

:func:`run` executes a schedule in virtual time (the model of ``_engine``: ranks run their
lists in order, an operation waits for its input, a send waits for room on its link) with a
duration per kind of pass and a latency per item sent. The bubble is the share of the ranks'
time spent idle: ``1 - sum(busy) / (ranks * makespan)``.

:func:`bubble_theory` gives that share in closed form for the default costs, with its
sources. No I/O here.
"""

from __future__ import annotations

import dataclasses
import math

from ._builders import validate
from ._check import structure
from ._engine import execute
from ._ops import Op, Pass, Schedule

__all__ = ["Cost", "Timing", "bubble_theory", "run"]


@dataclasses.dataclass(frozen=True)
class Cost:
    """How long each kind of pass takes on one stage (every stage alike), and how long an
    item takes from one rank to the next. Raises ``ValueError`` for a negative or infinite
    value."""

    f: float = 1.0
    b: float = 2.0
    bi: float = 1.0
    bw: float = 1.0
    latency: float = 0.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ValueError(f"cost {field.name} must be a finite number >= 0, got {value!r}")

    def of(self, kind: Pass) -> float:
        """The duration of a pass of ``kind``."""
        return {Pass.F: self.f, Pass.B: self.b, Pass.BI: self.bi, Pass.BW: self.bw}[kind]


@dataclasses.dataclass(frozen=True)
class Timing:
    """One execution of a schedule: ``starts[r][i]`` and ``ends[r][i]`` are when rank ``r``
    ran its ``i``-th operation; ``busy[r]`` is its computing time; ``bubble`` the share of
    ``ranks * makespan`` spent idle (0 when nothing takes time)."""

    makespan: float
    busy: tuple[float, ...]
    bubble: float
    starts: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]

    @classmethod
    def of(
        cls,
        schedule: Schedule,
        cost: Cost,
        starts: tuple[tuple[float, ...], ...],
        ends: tuple[tuple[float, ...], ...],
    ) -> Timing:
        """The timing of ``schedule`` whose operations ran from ``starts`` to ``ends``, each
        pass taking what ``cost`` says: the makespan, busy times and bubble follow."""
        makespan = max((e[-1] for e in ends if e), default=0.0)
        busy = tuple(sum(cost.of(op.kind) for op in ops) for ops in schedule.ops)
        total = makespan * schedule.ranks
        bubble = (total - sum(busy)) / total if total > 0 else 0.0
        return cls(makespan, busy, bubble, starts, ends)


def run(schedule: Schedule, cost: Cost | None = None, *, capacity: int | None = 1) -> Timing:
    """Execute ``schedule`` in virtual time under ``cost`` (default :class:`Cost`), with links
    holding ``capacity`` items before a send blocks (as :func:`check`). Deterministic and pure;
    raises ``ValueError`` for a schedule :func:`check` refuses."""
    cost = Cost() if cost is None else cost
    structure(schedule)
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity must be >= 0 or None, got {capacity}")

    def duration(op: Op) -> float:
        return cost.of(op.kind)

    done = execute(schedule, duration, latency=cost.latency, capacity=capacity)
    return Timing.of(schedule, cost, done.starts, done.ends)


def bubble_theory(kind: str, ranks: int, microbatches: int, chunks: int = 1) -> float:
    """The bubble of schedule ``kind`` (one of :data:`SCHEDULES`) at ``p`` ranks, ``m``
    micro-batches and ``v`` chunks, in closed form. Pure; raises ``ValueError`` for the sizes
    :func:`build` refuses.

    Under the default costs (a forward takes 1, a whole backward 2, each half of a split
    backward 1, sending nothing) each rank computes ``3 * m * v`` and idles ``3 * (p - 1)``
    (ZB-H1: ``p - 1``); the bubble is idle over idle plus compute:

    - GPipe and 1F1B: ``(p - 1) / (m + p - 1)``. Huang et al. 2019 ("GPipe",
      arXiv:1811.06965) give GPipe's bubble as ``O((K - 1) / (M + K - 1))`` and PipeDream-Flush
      keeps it; Narayanan et al. 2021 (arXiv:2104.04473, section 2.2.1) write it as
      ``(p - 1) / m`` of the ideal time: the same idle time over another denominator.
    - Interleaved 1F1B with ``v`` chunks: ``(p - 1) / (v * m + p - 1)``. Narayanan et al. 2021
      (section 2.2.2) give the bubble time as ``(p - 1) * (t_f + t_b) / v`` against an ideal
      ``m * (t_f + t_b)``, ``t_f`` and ``t_b`` being a whole rank's passes; here each chunk's
      pass takes the default costs, so ``t_f = v`` and ``t_b = 2 * v``.
    - ZB-H1: ``(p - 1) / (3 * m + p - 1)``. Qi et al. 2024 ("Zero Bubble Pipeline Parallelism",
      arXiv:2401.10241, section 2.1) give its bubble as ``(p - 1) * (T_F + T_B - T_W)``, against
      1F1B's ``(p - 1) * (T_F + T_B + T_W)``: with the three passes equal, a third of the idle
      time (``(p - 1) / (3 * m)`` of the ideal time).

    :func:`run` gives these exactly with the default costs and one-slot links (the tests sweep
    1 to 8 ranks and 1 to ``4p`` micro-batches, wherever the builder takes them).
    """
    validate(kind, ranks, microbatches, chunks)
    p, m = ranks, microbatches
    if kind == "zb_h1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (chunks * m + p - 1)
