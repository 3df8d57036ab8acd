"""The flow-level network: max-min fair shares, rates that change as flows come and go, and
(L0 of the simulator's validation) collectives moved as flows over a fat tree reproducing the
cost model's closed forms on links nothing else crosses."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestr.fabric.optical import (
    all_gather_s,
    all_to_all_s,
    broadcast_s,
    fat_tree,
    reduce_scatter_s,
    ring_all_reduce_s,
)
from orchestr.sim import Engine, FlowNet, collective_time, max_min_rates, ns

GBPS = 400.0
B = GBPS * 1e9 / 8  # a NIC's bytes/s
TREE = fat_tree(4, hosts_per_tor=8, nic_gbps=GBPS, tor_agg_gbps=GBPS)
UNDER_ONE_TOR = [f"p0-t0-h{i}" for i in range(8)]
#: the virtual clock counts whole nanoseconds: each flow on the critical path may end up to
#: one nanosecond late
NS_PER_FLOW = 1e-9


def test_max_min_shares_a_bottleneck_and_gives_the_rest_to_whom_it_can() -> None:
    capacity = {"ab": 10.0, "bc": 4.0, "bd": 100.0}
    rates = max_min_rates([["ab", "bc"], ["ab", "bc"], ["ab", "bd"], []], capacity)  # type: ignore[list-item]
    assert rates == [2.0, 2.0, 6.0, math.inf]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True), max_size=12),
    st.lists(st.floats(0.5, 100), min_size=6, max_size=6),
)
def test_max_min_rates_are_feasible_and_every_flow_has_a_full_link(
    paths: list[list[int]], caps: list[float]
) -> None:
    capacity = {(i, i + 1): c for i, c in enumerate(caps)}
    links = [[(i, i + 1) for i in p] for p in paths]
    rates = max_min_rates(links, capacity)
    load = dict.fromkeys(capacity, 0.0)
    for path, rate in zip(links, rates, strict=True):
        for link in path:
            load[link] += rate
    assert all(load[k] <= capacity[k] * (1 + 1e-9) for k in capacity)
    for path, rate in zip(links, rates, strict=True):
        # max-min: some link of the path is full and no flow on it gets more than this one
        assert any(
            load[k] >= capacity[k] * (1 - 1e-9)
            and all(r <= rate * (1 + 1e-9) for p, r in zip(links, rates, strict=True) if k in p)
            for k in path
        )


def test_a_flow_speeds_up_when_the_one_it_shared_with_ends() -> None:
    engine = Engine()
    net = FlowNet(engine, {("a", "b"): 100.0})
    ended: dict[str, int] = {}
    net.start([("a", "b")], 100.0, lambda: ended.setdefault("small", engine.now))
    net.start([("a", "b")], 300.0, lambda: ended.setdefault("big", engine.now))
    engine.run()
    # both at 50 B/s until the small one ends at 2 s; the big one then has 200 left at 100 B/s
    assert ended == {"small": ns(2), "big": ns(4)}
    assert net.finished == 2 and not net.flows


def test_measured_sharing_takes_what_flows_leave_unused_off_a_link() -> None:
    engine = Engine()
    # two flows carry 0.8 of a link together, three or more 0.6
    net = FlowNet(engine, {("a", "b"): 100.0, ("b", "c"): 100.0}, sharing=[1.0, 0.8, 0.6])
    ended: dict[str, int] = {}
    net.start([("a", "b")], 80.0, lambda: ended.setdefault("small", engine.now))
    net.start([("a", "b"), ("b", "c")], 240.0, lambda: ended.setdefault("big", engine.now))
    engine.run()
    # 40 B/s each until the small one ends at 2 s; the big one, alone on both links, then
    # moves its last 160 at the full 100 B/s (one flow a link: sharing[0])
    assert ended == {"small": ns(2), "big": ns(3.6)}
    engine = Engine()
    net = FlowNet(engine, {("a", "b"): 100.0}, sharing=[0.9, 0.6])
    for _ in range(4):  # past the list: its last entry
        net.start([("a", "b")], 15.0, lambda: ended.setdefault("four", engine.now))
    engine.run()
    assert ended["four"] == ns(1.0)  # 60 B/s over four flows of 15
    # flows both ways: each direction carries reverse_sharing, one way sharing (none: all)
    engine = Engine()
    net = FlowNet(engine, {("a", "b"): 100.0, ("b", "a"): 100.0}, reverse_sharing=[0.5])
    net.start([("a", "b")], 50.0, lambda: ended.setdefault("ab", engine.now))
    net.start([("b", "a")], 100.0, lambda: ended.setdefault("ba", engine.now))
    engine.run()
    # 50 B/s each way until a->b ends at 1 s; b->a then has 50 left alone, at 100 B/s
    assert (ended["ab"], ended["ba"]) == (ns(1.0), ns(1.5))
    for bad in ([], [0.0], [1.0, 1.2], [float("nan")]):
        with pytest.raises(ValueError, match=r"fractions in \(0, 1\]"):
            FlowNet(engine, {("a", "b"): 1.0}, sharing=bad)
        with pytest.raises(ValueError, match="reverse_sharing"):
            FlowNet(engine, {("a", "b"): 1.0}, reverse_sharing=bad)


def test_a_circuit_takes_the_flows_between_its_tors() -> None:
    engine = Engine()
    net = FlowNet.of_topology(engine, TREE)
    electrical = net.path("p0-t0-h0", "p1-t0-h0")
    assert len(electrical) == 6  # NIC, ToR-agg, agg-core, core-agg, agg-ToR, NIC
    net.set_circuits({("p0-tor0", "p1-tor0"): 800.0})
    assert net.path("p0-t0-h0", "p1-t0-h0") == (
        ("p0-t0-h0", "p0-tor0"),
        ("ocs", "p0-tor0", "p1-tor0"),
        ("p1-tor0", "p1-t0-h0"),
    )
    net.set_circuits({})
    assert net.path("p0-t0-h0", "p1-t0-h0") == electrical
    with pytest.raises(ValueError, match="must be > 0"):
        net.set_circuits({("p0-tor0", "p1-tor0"): 0.0})


@pytest.mark.parametrize("alpha", [0.0, 3e-6])
@pytest.mark.parametrize(
    ("kind", "form", "flows_on_path"),
    [
        ("all_reduce", ring_all_reduce_s, 14),
        ("reduce_scatter", reduce_scatter_s, 7),
        ("all_gather", all_gather_s, 7),
        ("broadcast", broadcast_s, 17),  # 11 chunks, 7 hops: 11 + 7 - 1 chunk-hops
    ],
)
def test_l0_collectives_as_flows_give_the_closed_forms(
    kind: str, form: object, flows_on_path: int, alpha: float
) -> None:
    nbytes = 10.5e6  # not a whole number of 1 MiB chunks
    got = collective_time(TREE, kind, UNDER_ONE_TOR, nbytes, alpha=alpha)
    want = form(8, nbytes, B, alpha)  # type: ignore[operator]
    assert want <= got <= want + flows_on_path * NS_PER_FLOW


def test_l0_all_to_all_is_bound_by_the_member_links_or_the_bisection() -> None:
    nbytes = 8e6
    alone = collective_time(TREE, "all_to_all", UNDER_ONE_TOR, nbytes)
    assert alone == pytest.approx(all_to_all_s(8, nbytes, B), abs=NS_PER_FLOW)
    # four hosts under each of two ToRs: on the tree's one path every cross pair rides one
    # ToR-agg link, 400 Gbit/s per direction, which binds
    halves = [f"p0-t0-h{i}" for i in range(4)] + [f"p0-t1-h{i}" for i in range(4)]
    split = collective_time(TREE, "all_to_all", halves, nbytes, ecmp=False)
    want = all_to_all_s(8, nbytes, B, bisection=B)
    assert want > all_to_all_s(8, nbytes, B)
    assert split == pytest.approx(want, abs=NS_PER_FLOW)
    # spread over both aggregation switches (ECMP), the pairs share two uplinks: faster, but
    # no faster than a bisection of both (a hash need not split them evenly)
    spread = collective_time(TREE, "all_to_all", halves, nbytes)
    assert all_to_all_s(8, nbytes, B, bisection=2 * B) - 1e-9 <= spread < split


def test_bad_flows_and_collectives_are_refused() -> None:
    engine = Engine()
    net = FlowNet(engine, {("a", "b"): 1.0})
    with pytest.raises(ValueError, match="bytes >= 0"):
        net.start([("a", "b")], -1, print)
    with pytest.raises(KeyError, match="no link"):
        net.start([("b", "a")], 1, print)
    with pytest.raises(ValueError, match="capacities are > 0"):
        FlowNet(engine, {("a", "b"): 0.0})
    with pytest.raises(ValueError, match="one of all_reduce"):
        collective_time(TREE, "gossip", UNDER_ONE_TOR, 1.0)
    assert collective_time(TREE, "all_reduce", UNDER_ONE_TOR[:1], 1e9) == 0.0


def test_ecmp_spreads_pairs_over_equal_cost_paths_and_keeps_each_pair_on_one() -> None:
    tree = fat_tree(8)
    net = FlowNet.of_topology(Engine(), tree)
    single = FlowNet.of_topology(Engine(), tree, ecmp=False)
    src = [f"p0-t0-h{i}" for i in range(4)]
    dst = [f"p{p}-t{t}-h{h}" for p in (1, 2, 3) for t in range(4) for h in range(4)]
    uplinks = set()
    for a in src:
        for b in dst:
            path = net.path(a, b)
            assert len(path) == len(single.path(a, b)) == 6  # host, tor, agg, core, agg, tor
            assert path == net.path(a, b)  # one path per pair
            uplinks.add(path[1])
    assert len(uplinks) == 4  # the ToR's four uplinks all carry some pairs
    assert len({single.path(a, b)[1] for a in src for b in dst}) == 1
