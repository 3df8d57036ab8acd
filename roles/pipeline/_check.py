"""The checker: does a schedule make a pipeline, and how much does each rank keep in memory?

A schedule passes when every (micro-batch, stage) has its forward and its backward (whole, or
split into ``BI`` and ``BW``) exactly once, on the rank holding the stage; each rank's own
order provides what it reads from memory (a backward after its forward, ``BW`` after its
``BI``, a stage after the previous one of the same rank); both ends of every link agree on the
order of its items; and the ranks, running their lists in order with blocking sends and
receives over links of the given capacity, all finish (see ``_engine``). No I/O here.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from ._engine import execute, links
from ._ops import Op, Pass, Schedule

__all__ = ["Report", "check", "structure"]

_SHOWN = 5  # problems listed in one error; the rest are counted


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`check` found in a schedule that passed.

    ``peak_in_flight[r]`` is the most micro-batches whose activations rank ``r`` holds at once
    (counted per chunk: a forward adds one, its ``B`` or its ``BW`` frees it; the weight
    gradient reads the stage's stored inputs, so a split backward frees them only after
    ``BW``). ``sends`` is how many items cross between ranks in one step."""

    peak_in_flight: tuple[int, ...]
    sends: int


def _fail(what: str, problems: list[str]) -> None:
    if problems:
        more = len(problems) - _SHOWN
        shown = "; ".join(problems[:_SHOWN]) + (f"; and {more} more" if more > 0 else "")
        raise ValueError(f"{what}: {shown}")


def _counts(s: Schedule) -> None:
    problems = []
    seen: Counter[tuple[Pass, int, int]] = Counter()
    for r, ops in enumerate(s.ops):
        for i, op in enumerate(ops):
            if not isinstance(op, Op) or not isinstance(op.kind, Pass):
                problems.append(f"rank {r}'s item {i} is not an Op of a Pass: {op!r:.60}")
            elif op.rank != r:
                problems.append(f"rank {r}'s item {i} is {op} of rank {op.rank}")
            elif not 0 <= op.microbatch < s.microbatches or not 0 <= op.chunk < s.chunks:
                problems.append(
                    f"rank {r}'s {op} is outside {s.microbatches} micro-batches and "
                    f"{s.chunks} chunks"
                )
            else:
                seen[op.kind, op.microbatch, s.stage(op)] += 1
    _fail("the schedule's lists are malformed", problems)
    for stage in range(s.stages):
        rank, chunk = s.placement(stage)
        for m in range(s.microbatches):
            n = {kind: seen[kind, m, stage] for kind in Pass}
            where = f"micro-batch {m} on stage {stage} (rank {rank}, chunk {chunk})"
            if n[Pass.F] != 1:
                problems.append(f"{where} has {n[Pass.F]} forwards")
            if (n[Pass.B], n[Pass.BI], n[Pass.BW]) not in ((1, 0, 0), (0, 1, 1)):
                problems.append(
                    f"{where} has {n[Pass.B]} B, {n[Pass.BI]} BI and {n[Pass.BW]} BW: a "
                    f"backward is one B, or one BI and one BW"
                )
    _fail("each forward and backward must run exactly once", problems)


def _local_order(s: Schedule) -> None:
    problems = []
    for r, ops in enumerate(s.ops):
        done: set[tuple[str, int, int]] = set()  # (forward or backward input, micro-batch, stage)
        for op in ops:
            stage, m = s.stage(op), op.microbatch
            needs = []
            if op.kind is Pass.F:
                if stage > 0 and (stage - 1) % s.ranks == r:
                    needs.append(("F", m, stage - 1))
            elif op.kind is Pass.BW:
                needs.append(("BI", m, stage))
            else:
                needs.append(("F", m, stage))
                if stage < s.stages - 1 and (stage + 1) % s.ranks == r:
                    needs.append(("BI", m, stage + 1))
            for need in needs:
                if need not in done:
                    what = "its forward" if need[0] == "F" else "the input gradient"
                    problems.append(
                        f"rank {r} runs {op} before {what} (micro-batch {m}, stage {need[2]})"
                    )
            # a whole backward also provides the input gradient a split one would
            done.add(("BI" if op.kind in (Pass.B, Pass.BI) else str(op.kind), m, stage))
    _fail("a rank's order must provide what it reads from its own memory", problems)


def structure(s: Schedule) -> None:
    """Raise ``ValueError`` unless ``s`` has each pass exactly once, on its stage's rank, in an
    order each rank can run from its own memory. Pure."""
    if not isinstance(s, Schedule):
        raise ValueError(f"expected a Schedule, got {type(s).__name__}")
    _counts(s)
    _local_order(s)


def _in_flight(ops: tuple[Op, ...]) -> int:
    held = peak = 0
    for op in ops:
        if op.kind is Pass.F:
            held += 1
            peak = max(peak, held)
        elif op.kind is not Pass.BI:
            held -= 1
    return peak


def check(s: Schedule, *, capacity: int | None = 1) -> Report:
    """Check that ``s`` is a pipeline its ranks can run, and report its memory.

    ``capacity`` is how many items a link between two ranks holds before its sender blocks
    (1 by default, the least that lets the 1F1B family run with separate sends and receives;
    ``0`` is a rendezvous, under which only GPipe's order finishes; ``None``: unbounded).
    Pure and idempotent; raises ``ValueError`` naming the first problems found (a pass missing
    or repeated, on the wrong rank, run before what it reads, links in disagreeing orders, or
    a deadlock with where each rank waits)."""
    structure(s)
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity must be >= 0 or None, got {capacity}")
    execute(s, lambda op: 1.0, capacity=capacity)
    _, sends = links(s)
    return Report(tuple(_in_flight(ops) for ops in s.ops), len(sends))
