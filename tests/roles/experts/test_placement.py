"""Expert placement: DeepSeek's EPLB reproduced on its own README example, the stable mode's
promise (as balanced, fewer experts moved), and the shapes it refuses."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestr.roles.experts import balancedness, experts_moved, host_loads, rebalance

LOAD = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]


def test_eplb_reproduces_its_readme_example() -> None:
    placement = rebalance(LOAD, 16, 4, 2, 8)
    assert placement.phy_to_log == [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
    assert placement.replicas[0] == [1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1]
    assert placement.log_to_phy[0][1] == [13, 15]
    assert placement.experts_on(1, 0) == [7, 10]


def test_eplb_keeps_a_group_on_one_node() -> None:
    placement = rebalance(LOAD, 16, 4, 2, 8)
    for layer in range(2):
        for group in range(4):
            experts = range(group * 3, group * 3 + 3)
            nodes = {slot // 8 for e in experts for slot in placement.log_to_phy[layer][e]}
            assert len(nodes) == 1


def test_groups_that_do_not_divide_over_nodes_balance_globally() -> None:
    # 3 groups on 2 nodes: one pass over all experts and hosts, as one group on one node
    assert rebalance(LOAD, 16, 3, 2, 8) == rebalance(LOAD, 16, 1, 1, 8)
    assert rebalance(LOAD, 16, 3, 2, 8) != rebalance(LOAD, 16, 4, 2, 8)


def _zipf(rng: random.Random, experts: int, s: float, tokens: int = 10_000) -> list[float]:
    ranks = list(range(1, experts + 1))
    rng.shuffle(ranks)
    weights = [1.0 / r**s for r in ranks]
    total = sum(weights)
    return [round(tokens * w / total) for w in weights]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    shape=st.sampled_from([(8, 8, 1, 1, 2), (8, 12, 4, 2, 4), (16, 24, 4, 2, 8), (6, 9, 2, 1, 3)]),
    mode=st.sampled_from(["eplb", "stable"]),
)
def test_every_placement_is_whole(seed: int, shape: tuple[int, ...], mode: str) -> None:
    experts, replicas, groups, nodes, hosts = shape
    rng = random.Random(seed)
    load = [_zipf(rng, experts, rng.uniform(0.0, 2.0)) for _ in range(3)]
    current = rebalance(
        [_zipf(rng, experts, 1.0) for _ in range(3)], replicas, groups, nodes, hosts
    )
    placement = rebalance(load, replicas, groups, nodes, hosts, mode=mode, current=current)
    for layer in range(3):
        assert sorted(placement.phy_to_log[layer]) == sorted(
            e for e in range(experts) for _ in range(placement.replicas[layer][e])
        )
        assert all(n >= 1 for n in placement.replicas[layer])
        for e, slots in enumerate(placement.log_to_phy[layer]):
            assert all(placement.phy_to_log[layer][p] == e for p in slots)
    loads = host_loads(placement, load)
    assert all(abs(sum(h) - sum(row)) < 1e-6 for h, row in zip(loads, load, strict=True))
    assert experts_moved(placement, placement) == 0


def test_stable_moves_fewer_experts_and_balances_as_well() -> None:
    rng = random.Random(7)
    moved = {"eplb": 0, "stable": 0}
    balance = {"eplb": 0.0, "stable": 0.0}
    rounds = 40
    for _ in range(rounds):
        before = [_zipf(rng, 16, 1.2) for _ in range(4)]
        # the popularity drifts: a few experts swap ranks
        after = [list(row) for row in before]
        for row in after:
            i, j = rng.sample(range(16), 2)
            row[i], row[j] = row[j], row[i]
        now = rebalance(before, 32, 4, 2, 8)
        for mode in moved:
            new = rebalance(after, 32, 4, 2, 8, mode=mode, current=now)
            moved[mode] += experts_moved(now, new)
            balance[mode] += balancedness(new, after) / rounds
    assert moved["stable"] < moved["eplb"] / 2
    assert balance["stable"] >= balance["eplb"] - 0.02


def test_stable_with_the_same_load_moves_nothing() -> None:
    now = rebalance(LOAD, 16, 4, 2, 8)
    assert experts_moved(now, rebalance(LOAD, 16, 4, 2, 8, mode="stable", current=now)) == 0


def test_stable_without_a_placement_starts_from_eplb() -> None:
    assert rebalance(LOAD, 16, 4, 2, 8, mode="stable") == rebalance(LOAD, 16, 4, 2, 8)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((LOAD, 10, 4, 2, 8), "cannot hold 12 experts"),
        ((LOAD, 16, 4, 2, 6), "divide evenly"),
        ((LOAD, 16, 4, 3, 8), "divide evenly"),
        ((LOAD, 16, 5, 2, 8), "equal groups"),
        ((LOAD, 16, 4, 0, 8), "at least 1"),
        (([], 16, 4, 2, 8), "no layers"),
        (([[1, 2], [1]], 4, 1, 1, 2), "same number"),
        (([[1, -2]], 4, 1, 1, 2), "negative"),
    ],
)
def test_bad_shapes_are_refused(args: tuple, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=match):
        rebalance(*args)


def test_bad_mode_and_mismatched_current_are_refused() -> None:
    with pytest.raises(ValueError, match="not one of"):
        rebalance(LOAD, 16, 4, 2, 8, mode="greedy")
    other = rebalance(LOAD, 24, 4, 2, 8)
    with pytest.raises(ValueError, match="current placement"):
        rebalance(LOAD, 16, 4, 2, 8, mode="stable", current=other)
