"""The generation pool's layout policy (OrchestrRL's adaptive compute scheduler), a pure
function: its cost model's closed forms, what it estimates of requests it cannot see the end
of, and its choices: a low degree for a compute-bound queue, a high one for a tail, the
current one when a change would not pay."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from orchestr.roles.rl import (
    LayoutCosts,
    LayoutView,
    choose_layout,
    expected_remaining,
)
from orchestr.roles.rl._layout import replica_s

#: reading the weights costs as much as 100 sequences' products at degree 1; all-reduces
#: cost a little; each doubling keeps 75% of the ideal speedup
COSTS = LayoutCosts(
    base_s=0.01,
    decode_s=1e-4,
    attention_s=1e-8,
    layers=4,
    row_bytes=1024,
    allreduce_alpha_s=2e-6,
    allreduce_byte_s=1e-11,
    device_bytes=80e9,
    weight_bytes=16e9,
    kv_bytes_per_token=1e5,
    reshard_s=1.0,
    scaling=0.75,
)


def view(requests: list[tuple[int, int]], degree: int = 1, **kw: object) -> LayoutView:
    fields: dict[str, object] = {
        "accelerators": 8, "degree": degree, "degrees": (1, 2, 4, 8),
        "requests": tuple(requests), "history": (100, 200, 400, 800, 4000),
        "max_tokens": 8000, **kw,
    }  # fmt: skip
    return LayoutView(**fields)


def test_an_iteration_costs_what_the_closed_form_says() -> None:
    assert COSTS.iteration_s(1, 10, 1000) == pytest.approx(0.01 + 10e-4 + 1e-5)
    speedup = 4 * 0.75**2
    rounds = 2 * 4 * 2 * 3 * (2e-6 + 10 * 1024 / 4 * 1e-11)
    assert COSTS.iteration_s(4, 10, 1000) == pytest.approx((0.01 + 10e-4 + 1e-5) / speedup + rounds)
    assert COSTS.kv_tokens(2) == pytest.approx((160e9 - 16e9) / 1e5)
    with pytest.raises(ValueError, match="LayoutCosts.base_s is a number >= 0"):
        LayoutCosts(**{**COSTS.__dict__, "base_s": -1.0})
    with pytest.raises(ValueError, match="LayoutCosts.layers is a number >= 0"):
        LayoutCosts(**{**COSTS.__dict__, "layers": True})


def one_at_a_time(degree: int, requests: Sequence[tuple[float, float]]) -> float:
    """A replica's seconds for ``requests`` (``(context, tokens)``), one iteration at a time,
    every request in the batch from the start (the KV fits)."""
    running = [[float(c), float(n)] for c, n in requests]
    seconds = 0.0
    while running:
        seconds += COSTS.iteration_s(degree, len(running), sum(c for c, _ in running))
        for r in running:
            r[0] += 1
            r[1] -= 1
        running = [r for r in running if r[1] > 0]
    return seconds


def test_a_replicas_time_is_the_sum_of_its_iterations() -> None:
    """The closed form between two ends against one iteration at a time."""
    requests = [(50.0, 7.0), (20.0, 3.0), (10.0, 12.0), (5.0, 1.0)]
    for degree in (1, 2, 4):
        want = one_at_a_time(degree, requests)
        assert replica_s(COSTS, degree, requests, math.inf) == pytest.approx(want)
    # room for one at a time: they run one after another
    alone = sum(replica_s(COSTS, 1, [r], math.inf) for r in requests)
    assert replica_s(COSTS, 1, requests, 1.0) == pytest.approx(alone)


def test_what_a_request_has_left_is_read_from_the_history() -> None:
    history = [100, 200, 400, 800]
    assert expected_remaining(history, 0, 10_000) == pytest.approx(375)
    assert expected_remaining(history, 300, 10_000) == pytest.approx(600 - 300)
    assert expected_remaining(history, 900, 10_000) == 450  # past all: half as much again
    assert expected_remaining(history, 900, 1000) == 100  # never past max_tokens
    assert expected_remaining([], 0, 1000) == 1


def test_a_compute_bound_queue_runs_at_degree_one_and_its_tail_at_a_higher_one() -> None:
    queue = [(100, 0)] * 2000  # 250 sequences a device: the products outweigh the weights
    short = (100, 120, 150, 200)  # and no long tail to shorten
    first = choose_layout(view(queue, phase="between_steps", history=short), COSTS)
    assert first.degree == 1 and not first.changes
    assert first.predicted_s[1] < min(first.predicted_s[d] for d in (2, 4, 8))
    tail = [(100, 3000), (100, 3500)]  # two long ones left: the weights' reads dominate
    late = choose_layout(view(tail), COSTS)
    assert late.degree > 1 and late.changes
    assert late.predicted_s[late.degree] < late.predicted_s[1]


def test_a_change_that_does_not_pay_is_not_made() -> None:
    tail = [(100, 3000), (100, 3500)]
    costly = LayoutCosts(**{**COSTS.__dict__, "reshard_s": 1e4})
    assert choose_layout(view(tail), costly).degree == 1
    # within the margin the current degree stays, however slightly another wins
    choice = choose_layout(view(tail), COSTS)
    kept = choose_layout(view(tail), COSTS, margin=0.99)
    assert kept.degree == 1 and choice.degree != 1


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"phase": "training"}, "phase is one of"),
        ({"degrees": (1, 3)}, "degrees must divide the 8 accelerators"),
        ({"degrees": (2, 4)}, "the current degree 1 is not among"),
        ({"max_tokens": 0}, "max_tokens >= 1"),
        ({"requests": ((-1, 0),)}, "token counts >= 0"),
    ],
)
def test_a_view_that_makes_no_sense_is_refused(change: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        view(**{"requests": [(1, 0)], **change})
