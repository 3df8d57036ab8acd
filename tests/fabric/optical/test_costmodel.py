"""The fabric cost model: closed forms with exact numbers, the demand a collective puts on the
fabric, and the bottleneck-pair phase time."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestr.errors import ConfigError
from orchestr.fabric._optical._costmodel import (
    ReconfigCost,
    all_gather_s,
    all_to_all_s,
    broadcast_s,
    collective_demand,
    collective_s,
    phase_time,
    reduce_scatter_s,
    ring_all_reduce_s,
)

GB = 1e9
MiB = 1 << 20


def test_ring_all_reduce_closed_form() -> None:
    # 2(n-1)/n * S/B: 8 ranks, 1 GB each, 10 GB/s -> 2 * 7/8 * 0.1 s
    assert ring_all_reduce_s(8, GB, 10 * GB) == pytest.approx(0.175)
    assert ring_all_reduce_s(4, GB, 10 * GB, alpha_s=1e-5) == pytest.approx(0.15 + 6e-5)
    assert ring_all_reduce_s(1, GB, 10 * GB, alpha_s=1.0) == 0.0


def test_reduce_scatter_and_all_gather_are_half_an_all_reduce() -> None:
    assert reduce_scatter_s(8, 8 * GB, 10 * GB) == pytest.approx(0.7)
    assert all_gather_s(8, 8 * GB, 10 * GB, alpha_s=1e-3) == pytest.approx(0.707)
    assert 2 * reduce_scatter_s(16, GB, GB) == pytest.approx(ring_all_reduce_s(16, GB, GB))


def _chain(n: int, nbytes: float, bandwidth: float, chunk: float) -> float:
    """A step-by-step simulation of the chain broadcast, independent of the closed form."""
    sizes = [chunk] * int(nbytes // chunk) + ([nbytes % chunk] if nbytes % chunk else [])
    done = [0.0] * len(sizes)  # when each chunk has arrived at the current hop's sender
    for _hop in range(n - 1):
        link_free = 0.0
        for i, size in enumerate(sizes):
            link_free = max(link_free, done[i]) + size / bandwidth
            done[i] = link_free
    return done[-1]


@pytest.mark.parametrize(
    ("n", "nbytes", "chunk"),
    [
        (2, 8 * MiB, MiB),
        (4, 8 * MiB, MiB),
        (3, 2.5 * MiB, MiB),
        (9, 5 * MiB, 2 * MiB),
        (5, 0.5 * MiB, MiB),
    ],
)
def test_broadcast_is_a_pipelined_chain(n: int, nbytes: float, chunk: float) -> None:
    bandwidth = float(MiB)  # 1 MiB/s: times in chunk units
    assert broadcast_s(n, nbytes, bandwidth, chunk_bytes=chunk) == pytest.approx(
        _chain(n, nbytes, bandwidth, chunk)
    )


def test_broadcast_exact_numbers() -> None:
    # S/B + (n-2) c/B + (k+n-2) alpha: 8 chunks over 3 hops = 10 steps of 1 s
    assert broadcast_s(4, 8 * MiB, MiB, chunk_bytes=MiB) == pytest.approx(10.0)
    assert broadcast_s(4, 8 * MiB, MiB, 0.5, chunk_bytes=MiB) == pytest.approx(15.0)
    assert broadcast_s(2, GB, 10 * GB) == pytest.approx(0.1)  # one hop: S/B
    # large S: tends to S/B
    assert broadcast_s(64, 100 * GB, 10 * GB) == pytest.approx(10.0, rel=1e-3)


def test_all_to_all_member_links_or_bisection() -> None:
    assert all_to_all_s(8, 8 * GB, 10 * GB) == pytest.approx(0.7)  # (n-1)/n * S/B
    # full bisection, n/2 * B, never binds
    assert all_to_all_s(8, 8 * GB, 10 * GB, bisection=40 * GB) == pytest.approx(0.7)
    # one link's worth of bisection: 4 * 4 * S/n cross each way
    assert all_to_all_s(8, 8 * GB, 10 * GB, bisection=10 * GB) == pytest.approx(1.6)
    assert all_to_all_s(5, 5 * GB, 10 * GB, bisection=GB) == pytest.approx(6.0)  # 2 * 3 * 1 GB
    assert all_to_all_s(4, GB, GB, alpha_s=0.1) == pytest.approx(0.75 + 0.3)


def test_collective_s_dispatches_and_checks() -> None:
    assert collective_s("all_reduce", 4, GB, GB) == ring_all_reduce_s(4, GB, GB)
    assert collective_s("all_to_all", 4, GB, GB) == all_to_all_s(4, GB, GB)
    with pytest.raises(ConfigError, match="collective kind"):
        collective_s("gather", 4, GB, GB)
    with pytest.raises(ConfigError, match="at least one member"):
        ring_all_reduce_s(0, GB, GB)
    with pytest.raises(ConfigError, match="bandwidth"):
        ring_all_reduce_s(2, GB, 0.0)
    with pytest.raises(ConfigError, match="bytes per member"):
        all_gather_s(2, -1.0, GB)


def test_collective_demand_ring_edges_between_switches() -> None:
    members = {"a": 2, "b": 2, "idle": 0, "c": 4}  # n = 8, ring a -> b -> c -> a
    assert collective_demand("all_reduce", members, 8.0) == {
        ("a", "b"): 14.0,  # 2 * 7/8 * 8
        ("b", "c"): 14.0,
        ("c", "a"): 14.0,
    }
    assert collective_demand("reduce_scatter", members, 8.0)[("a", "b")] == 7.0
    assert collective_demand("all_gather", {"a": 1, "b": 1}, 8.0) == {
        ("a", "b"): 4.0,
        ("b", "a"): 4.0,
    }
    assert collective_demand("broadcast", members, 8.0) == {("a", "b"): 8.0, ("b", "c"): 8.0}
    assert collective_demand("all_reduce", {"a": 8}, 8.0) == {}  # all local


def test_collective_demand_all_to_all() -> None:
    assert collective_demand("all_to_all", {"a": 1, "b": 3}, 8.0) == {
        ("a", "b"): 6.0,  # 1 * 3 members, 8/4 bytes each
        ("b", "a"): 6.0,
    }
    with pytest.raises(ConfigError, match="collective kind"):
        collective_demand("scatter", {"a": 1}, 1.0)
    with pytest.raises(ConfigError, match="member count"):
        collective_demand("all_to_all", {"a": -1}, 1.0)


def test_phase_time_agrees_with_the_closed_forms() -> None:
    one_each = {f"s{i}": 1 for i in range(8)}
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        demand = collective_demand(kind, one_each, GB)
        assert phase_time(demand, lambda u, v: 10 * GB) == pytest.approx(
            collective_s(kind, 8, GB, 10 * GB)
        )
    # broadcast: the pipeline's bulk, S/B, without the fill of (n-2) chunks
    demand = collective_demand("broadcast", one_each, GB)
    fill = 6 * MiB / (10 * GB)
    assert phase_time(demand, lambda u, v: 10 * GB) == pytest.approx(
        broadcast_s(8, GB, 10 * GB) - fill
    )
    # all-to-all across two switches of 4: the pair between them is the bisection
    demand = collective_demand("all_to_all", {"a": 4, "b": 4}, 8 * GB)
    assert phase_time(demand, {("a", "b"): 10 * GB}) == pytest.approx(
        all_to_all_s(8, 8 * GB, 10 * GB, bisection=10 * GB)
    )


def test_phase_time_edges() -> None:
    assert phase_time({}, {}) == 0.0
    assert phase_time({("a", "a"): GB}, {}) == 0.0  # local
    assert phase_time({("a", "b"): GB}, {}) == math.inf
    # full duplex: the heavier direction decides; the mapping may name the pair either way
    assert phase_time({("a", "b"): 2 * GB, ("b", "a"): GB}, {("b", "a"): GB}) == 2.0
    with pytest.raises(ConfigError, match="demand"):
        phase_time({("a", "b"): -1.0}, {})
    with pytest.raises(ConfigError, match="capacity"):
        phase_time({("a", "b"): 1.0}, {("a", "b"): -1.0})


_names = st.sampled_from("abcdef")
_demand = st.dictionaries(st.tuples(_names, _names), st.floats(0, 1e12), max_size=20)
_caps = st.dictionaries(st.tuples(_names, _names), st.floats(0, 1e11), max_size=20)


@settings(max_examples=200, deadline=None)
@given(_demand, _caps, _caps)
def test_phase_time_is_monotone_in_capacity(
    demand: dict[tuple[str, str], float],
    base: dict[tuple[str, str], float],
    extra: dict[tuple[str, str], float],
) -> None:
    def lookup(caps: dict[tuple[str, str], float], u: str, v: str) -> float:
        return caps.get((u, v), 0.0) + caps.get((v, u), 0.0)

    before = phase_time(demand, lambda u, v: lookup(base, u, v))
    after = phase_time(demand, lambda u, v: lookup(base, u, v) + lookup(extra, u, v))
    assert after <= before


def test_reconfig_cost() -> None:
    cost = ReconfigCost(fixed_s=2.0, per_change_s=0.5)
    assert cost(0) == 0.0
    assert cost(4) == pytest.approx(4.0)
    with pytest.raises(ConfigError, match=">= 0"):
        ReconfigCost(fixed_s=-1.0)
