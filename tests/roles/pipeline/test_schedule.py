"""The pipeline schedules: each builder's lists pass the checker, time to their closed form over
a grid of sizes, keep the memory they promise; the checker refuses what cannot run."""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestr.roles.pipeline import (
    SCHEDULES,
    Cost,
    Op,
    Pass,
    Schedule,
    bubble_theory,
    build,
    check,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    run,
    zb_h1,
)

RANKS = range(2, 9)


def sizes(kind: str) -> list[tuple[int, int, int]]:
    """(ranks, microbatches, chunks): p in 2..8, m in p..4p, v in 1..3 where it applies (the
    interleaved schedule takes multiples of p when v > 1)."""
    chunks = (1, 2, 3) if kind == "interleaved_1f1b" else (1,)
    return [
        (p, m, v)
        for p in RANKS
        for m in range(p, 4 * p + 1)
        for v in chunks
        if v == 1 or m % p == 0
    ]


@pytest.mark.parametrize("kind", SCHEDULES)
def test_the_timed_bubble_is_the_closed_form(kind: str) -> None:
    for p, m, v in sizes(kind):
        schedule = build(kind, p, m, v)
        timing = run(schedule)
        # integer durations: both sides are the same rational, rounded once
        assert timing.bubble == bubble_theory(kind, p, m, v), (p, m, v)
        per_rank = 3 * m * v
        assert timing.busy == (per_rank,) * p
        idle = p - 1 if kind == "zb_h1" else 3 * (p - 1)
        assert timing.makespan == per_rank + idle


@pytest.mark.parametrize("kind", SCHEDULES)
def test_every_schedule_passes_the_checker(kind: str) -> None:
    for p, m, v in sizes(kind)[::3]:
        report = check(build(kind, p, m, v))
        # each micro-batch crosses p*v - 1 stage boundaries forwards and as many backwards
        assert report.sends == 2 * m * (p * v - 1)


def test_peak_activations_in_flight() -> None:
    for p, m, _ in sizes("1f1b"):
        assert check(gpipe(p, m)).peak_in_flight[0] == m
        assert check(one_f_one_b(p, m)).peak_in_flight == tuple(min(p - r, m) for r in range(p))
        # ZB-H1 keeps every rank at 1F1B's peak: its weight passes trail, holding the inputs
        assert check(zb_h1(p, m)).peak_in_flight == (p,) * p
    for p, m, v in sizes("interleaved_1f1b"):
        # counted in chunks, each 1/v of a stage: p + (p - 1) / v stages' worth past m = p
        peak = 2 * (p - 1) + (v - 1) * p + 1 if m > p and v > 1 else min(p, m) * v
        assert check(interleaved_1f1b(p, m, v)).peak_in_flight[0] == peak


def test_zero_bubble_idles_a_third_of_1f1b() -> None:
    for p, m, _ in sizes("zb_h1"):
        idle_1f1b = run(one_f_one_b(p, m)).makespan - 3 * m
        idle_zb = run(zb_h1(p, m)).makespan - 3 * m
        assert idle_1f1b == 3 * idle_zb == 3 * (p - 1)


def test_interleaving_divides_the_bubble_time_by_the_chunks() -> None:
    p, m = 4, 8
    plain = run(one_f_one_b(p, m), Cost(f=3, b=6))  # a whole stage's passes
    chunked = run(interleaved_1f1b(p, m, 3))  # each of the 3 chunks a third of it
    assert plain.makespan - 9 * m == 3 * (chunked.makespan - 9 * m)


def test_one_chunk_is_1f1b_and_one_rank_has_no_bubble() -> None:
    assert interleaved_1f1b(4, 6, 1).ops == one_f_one_b(4, 6).ops
    for kind in SCHEDULES:
        for v in (1, 2, 3) if kind == "interleaved_1f1b" else (1,):
            assert run(build(kind, 1, 5, v)).bubble == bubble_theory(kind, 1, 5, v) == 0


def test_fewer_microbatches_than_ranks() -> None:
    for p in RANKS:
        for m in range(1, p):
            for schedule in (gpipe(p, m), one_f_one_b(p, m)):
                assert run(schedule).bubble == bubble_theory(schedule.name, p, m)
                assert max(check(schedule).peak_in_flight) == m


def test_a_schedule_prints_as_its_lists() -> None:
    assert str(one_f_one_b(2, 3)) == "rank 0: F0 F1 B0 F2 B1 B2\nrank 1: F0 B0 F1 B1 F2 B2"
    assert str(zb_h1(2, 2)).splitlines()[1] == "rank 1: F0 BI0 F1 BI1 BW0 BW1"
    first = str(interleaved_1f1b(2, 4, 2)).splitlines()[0]
    assert first == "rank 0: F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3"


def test_timing_under_other_costs() -> None:
    schedule = one_f_one_b(4, 8)
    base = run(schedule)
    slow_links = run(schedule, Cost(latency=0.5))
    assert slow_links.makespan > base.makespan and slow_links.busy == base.busy
    for starts, ends, ops in zip(base.starts, base.ends, schedule.ops, strict=True):
        assert len(starts) == len(ops)
        spans = zip(starts, ends, ops, strict=True)
        assert all(e - s == (1 if op.kind is Pass.F else 2) for s, e, op in spans)
        assert all(b >= a for a, b in zip(ends[:-1], starts[1:], strict=True))
    assert run(schedule, Cost(f=0, b=0)).bubble == 0.0
    # GPipe's order runs even over rendezvous links; 1F1B's needs a slot per link
    assert run(gpipe(4, 8), capacity=0).bubble == base.bubble
    assert run(schedule, capacity=None).makespan == base.makespan


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: gpipe(0, 4), "ranks must be at least 1, got 0"),
        (lambda: one_f_one_b(4, 0), "microbatches must be at least 1, got 0"),
        (lambda: interleaved_1f1b(4, 8, 0), "chunks must be at least 1, got 0"),
        (lambda: zb_h1(True, 4), "ranks must be an integer, got True"),
        (lambda: interleaved_1f1b(4, 6, 2), r"multiple of ranks \(4\), such as 4 or 8"),
        (lambda: interleaved_1f1b(4, 3, 2), r"multiple of ranks \(4\), such as 4$"),
        (lambda: zb_h1(4, 3), r"microbatches \(3\) < ranks \(4\)"),
        (lambda: build("dualpipe", 4, 8), "unknown schedule 'dualpipe'"),
        (lambda: build("zb_h1", 4, 8, 2), "only interleaved_1f1b has chunks"),
        (lambda: bubble_theory("zb_h1", 4, 2), r"microbatches \(2\) < ranks \(4\)"),
        (lambda: bubble_theory("interleaved_1f1b", 0, 8, 2), "ranks must be at least 1"),
        (lambda: Schedule("x", 2, 1, 1, ((),)), "one list of operations per rank"),
        (lambda: Cost(b=-1), "cost b must be a finite number >= 0"),
        (lambda: check(gpipe(2, 2), capacity=-1), "capacity must be >= 0 or None"),
    ],
)
def test_bad_inputs_are_refused(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def edited(schedule: Schedule, rank: int, ops: list[Op]) -> Schedule:
    lists = list(schedule.ops)
    lists[rank] = tuple(ops)
    return dataclasses.replace(schedule, ops=tuple(lists))


def test_the_checker_refuses_broken_schedules() -> None:
    s = one_f_one_b(2, 2)  # rank 0: F0 F1 B0 B1; rank 1: F0 B0 F1 B1
    r0 = list(s.ops[0])
    cases = [
        (edited(s, 0, [*r0, Op(Pass.F, 0, 1)]), "micro-batch 1 on stage 0 .* has 2 forwards"),
        (edited(s, 0, r0[:-1]), "micro-batch 1 on stage 0 .* has 0 B, 0 BI and 0 BW"),
        (edited(s, 0, [*r0[:-1], Op(Pass.B, 1, 1)]), "rank 0's item 3 is B1 of rank 1"),
        (edited(s, 0, [*r0[:-1], Op(Pass.B, 0, 5)]), "outside 2 micro-batches"),
        (edited(s, 0, [r0[2], r0[0], r0[1], r0[3]]), "rank 0 runs B0 before its forward"),
        (edited(s, 0, [r0[1], r0[0], *r0[2:]]), "activations from rank 0 to rank 1 are out of"),
        (
            edited(s, 1, [Op(Pass.F, 1, 0), Op(Pass.F, 1, 1), Op(Pass.B, 1, 0), Op(Pass.B, 1, 1)]),
            None,  # the last rank may hold both: still a valid (GPipe-like) order
        ),
    ]
    for schedule, message in cases:
        if message is None:
            check(schedule)
            continue
        with pytest.raises(ValueError, match=message):
            check(schedule)
        with pytest.raises(ValueError, match=message):
            run(schedule)
    split = zb_h1(2, 2)
    swapped = list(split.ops[1])  # F0 BI0 F1 BI1 BW0 BW1
    swapped[1], swapped[4] = swapped[4], swapped[1]
    with pytest.raises(ValueError, match="rank 1 runs BW0 before the input gradient"):
        check(edited(split, 1, swapped))


def test_the_checker_finds_deadlocks() -> None:
    s = one_f_one_b(2, 2)
    # rank 0 waits for micro-batch 0's gradient before sending micro-batch 1 forward, while
    # rank 1 wants micro-batch 1 forward before it sends that gradient
    stuck = edited(s, 0, [Op(Pass.F, 0, 0), Op(Pass.B, 0, 0), Op(Pass.F, 0, 1), Op(Pass.B, 0, 1)])
    stuck = edited(
        stuck, 1, [Op(Pass.F, 1, 0), Op(Pass.F, 1, 1), Op(Pass.B, 1, 0), Op(Pass.B, 1, 1)]
    )
    with pytest.raises(ValueError, match="deadlocks: rank 0 waits for the gradient"):
        check(stuck, capacity=None)
    # rendezvous links: 1F1B's separate sends and receives block each other
    for kind in ("1f1b", "zb_h1"):
        with pytest.raises(ValueError, match="deadlocks: rank 0 blocks sending"):
            check(build(kind, 4, 8), capacity=0)
    check(gpipe(4, 8), capacity=0)


def test_the_schedules_are_sans_io() -> None:
    import orchestr.roles.pipeline as pipeline

    folder = Path(pipeline.__file__).parent
    allowed = {"__future__", "collections", "dataclasses", "enum", "math", "collections.abc"}
    for path in folder.glob("*.py"):
        if path.name in ("__init__.py", "_stage.py", "_driver.py", "_passes.py"):  # torch, actors
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = set() if node.level else {node.module or ""}
            else:
                continue
            assert names <= allowed, (path.name, names)
