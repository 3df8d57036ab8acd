"""The circuit planner: b-matching under budgets and wiring, the smallest change, the commit
rule with hysteresis, and dwell."""

from __future__ import annotations

import random
from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestr.errors import ConfigError
from orchestr.fabric._optical._circuits import Circuit, CircuitSet, Installed
from orchestr.fabric._optical._costmodel import ReconfigCost, collective_demand, phase_time
from orchestr.fabric._optical._plan import CommitPolicy, Plan, Planner, PlanRequest
from orchestr.fabric._optical._planner import GreedyPlanner, decide

GB = 1e9
GBPS = 1e9 / 8
CHEAP = ReconfigCost(fixed_s=0.0, per_change_s=0.0)
planner: Planner = GreedyPlanner()


def request(
    demand: Mapping[tuple[str, str], float],
    budgets: Mapping[str, int],
    **kw: object,
) -> PlanRequest:
    args: dict[str, object] = {
        "circuit_gbps": 400.0,
        "electrical_gbps": 100.0,
        "now": 1000.0,
        "reconfig_cost": CHEAP,
    }
    args.update(kw)
    return PlanRequest(demand=demand, budgets=budgets, **args)


def old(*pairs: tuple[str, str], since: float = 0.0) -> list[Installed]:
    return [Installed(Circuit(*p), since) for p in pairs]


def test_circuit_is_unordered_and_sets_are_multisets() -> None:
    assert Circuit("b", "a") == Circuit("a", "b") and Circuit("b", "a").a == "a"
    with pytest.raises(ConfigError, match="two different"):
        Circuit("a", "a")
    s = CircuitSet([("a", "b"), ("b", "a"), ("c", "a")])
    assert s.count("b", "a") == 2 and len(s) == 3 and s.ports() == {"a": 3, "b": 2, "c": 1}
    assert list(s) == [Circuit("a", "b"), Circuit("a", "b"), Circuit("a", "c")]
    t = CircuitSet([("a", "b")])
    assert s - t == CircuitSet([("a", "b"), ("a", "c")]) and (s & t) == t
    assert s - t + t == s and Circuit("a", "c") in s


def test_concentrated_demand_gets_that_pairs_circuits() -> None:
    budgets = {"a": 4, "b": 4, "c": 4, "d": 4}
    plan = planner.plan(request({("a", "b"): 10 * GB}, budgets))
    assert plan.target == CircuitSet([("a", "b")] * 4)
    assert plan.add == plan.target and not plan.remove and not plan.keep
    assert plan.predicted_s_static == pytest.approx(10 * GB / (100 * GBPS))
    assert plan.predicted_s_with == pytest.approx(10 * GB / (1700 * GBPS))
    assert plan.commit and plan.reason.startswith("commit")
    assert "the slowest pair left, a <-> b, gets no more: no free OCS port" in plan.reason


def test_circuits_go_where_pair_time_is_largest() -> None:
    # a-b carries 10x c-d: once a-b's time falls below c-d's, c-d gets a circuit too
    plan = planner.plan(request({("a", "b"): 10 * GB, ("d", "c"): GB}, dict.fromkeys("abcd", 4)))
    assert plan.target == CircuitSet([("a", "b")] * 4 + [("c", "d")])


def test_unchanged_demand_plans_zero_changes() -> None:
    rng = random.Random(7)
    names = [f"tor{i:02d}" for i in range(12)]
    demand = {(u, v): rng.random() * GB for u in names for v in names if u != v}
    budgets = dict.fromkeys(names, 3)
    first = planner.plan(request(demand, budgets))
    assert first.commit and len(first.add) > 0
    again = planner.plan(request(demand, budgets, current=old(*((c.a, c.b) for c in first.target))))
    assert not again.add and not again.remove and again.keep == first.target
    assert again.port_changes == 0 and again.reconfig_cost_s == 0.0 and not again.commit
    assert again.reason.startswith("no change")


def test_an_equally_good_circuit_in_place_is_kept() -> None:
    # a has one port and a-b, a-c are equal: neither circuit shortens the phase (the other
    # pair stays as slow), so a plan adds only d-e, and keeps a-c where it is in place
    demand = {("a", "b"): GB, ("a", "c"): GB, ("d", "e"): 3 * GB}
    budgets = dict.fromkeys("abcde", 1)
    fresh = planner.plan(request(demand, budgets))
    assert fresh.target == CircuitSet([("d", "e")])
    plan = planner.plan(request(demand, budgets, current=old(("a", "c"))))
    assert plan.keep == CircuitSet([("a", "c")]) and plan.add == CircuitSet([("d", "e")])
    assert not plan.remove and plan.port_changes == 2
    # only one choice helps: a-b is the slower; it takes a's port from a-c
    plan = planner.plan(request({**demand, ("a", "b"): 2 * GB}, budgets, current=old(("a", "c"))))
    assert plan.add == CircuitSet([("a", "b"), ("d", "e")])
    assert plan.remove == CircuitSet([("a", "c")])


def test_circuits_that_cannot_shorten_the_phase_are_not_added() -> None:
    # all-to-all over 4 ToRs loads all 6 pairs alike: with 2 ports each, 2 pairs stay
    # electrical and as slow, so circuits on the other 4 would be changes for nothing
    members = {"t0": 8, "t1": 8, "t2": 8, "t3": 8}
    demand = collective_demand("all_to_all", members, 4 * GB)
    plan = planner.plan(request(demand, dict.fromkeys(members, 2)))
    assert not plan.target and plan.reason.startswith("no change")
    plan = planner.plan(request(demand, dict.fromkeys(members, 3)))
    assert plan.target == CircuitSet(
        (u, v) for u in members for v in members if u < v
    )  # every pair: 3 ports each


def test_circuits_in_place_stay_when_their_ports_are_not_needed() -> None:
    budgets = dict.fromkeys("abcd", 2)
    plan = planner.plan(request({("c", "d"): GB}, budgets, current=old(("a", "b"), ("a", "b"))))
    assert plan.keep == CircuitSet([("a", "b")] * 2)
    assert plan.add == CircuitSet([("c", "d")] * 2) and not plan.remove
    # a port moved from one circuit to another is one change: a-b -> a-c touches a, b, c
    moved = planner.plan(
        request({("a", "c"): GB}, {"a": 1, "b": 1, "c": 1}, current=old(("a", "b")))
    )
    assert moved.add == CircuitSet([("a", "c")]) and moved.remove == CircuitSet([("a", "b")])
    assert moved.port_changes == 3


def test_circuits_in_place_with_no_traffic_between_switches() -> None:
    # only traffic inside one switch: nothing to plan, the circuits in place stay
    plan = planner.plan(request({("a", "a"): GB}, dict.fromkeys("ab", 1), current=old(("a", "b"))))
    assert plan.keep == CircuitSet([("a", "b")]) and not plan.add and not plan.remove
    assert not plan.commit


def test_commit_needs_saving_above_cost_with_hysteresis() -> None:
    # static 10 GB / 12.5 GB/s = 0.8 s; with one 400G circuit 10 / 62.5 = 0.16 s: saves 0.64 s
    demand, budgets = {("a", "b"): 10 * GB}, {"a": 1, "b": 1}
    cost = ReconfigCost(fixed_s=0.5, per_change_s=0.0)
    refused = planner.plan(
        request(demand, budgets, reconfig_cost=cost, policy=CommitPolicy(hysteresis=0.5))
    )
    assert refused.saving_s == pytest.approx(0.64) and refused.reconfig_cost_s == 0.5
    assert not refused.commit and refused.add == CircuitSet([("a", "b")])
    assert "does not exceed" in refused.reason and "hysteresis 0.5" in refused.reason
    # above the cost alone is not enough: 0.64 > 0.5 but < 0.5 * 1.5
    assert refused.saving_s > refused.reconfig_cost_s
    lower = planner.plan(
        request(demand, budgets, reconfig_cost=cost, policy=CommitPolicy(hysteresis=0.2))
    )
    assert lower.commit
    margin = planner.plan(
        request(
            demand,
            budgets,
            reconfig_cost=cost,
            policy=CommitPolicy(hysteresis=0.2, margin_s=0.1),
        )
    )
    assert not margin.commit and "margin 0.1" in margin.reason
    twice = planner.plan(request(demand, budgets, reconfig_cost=cost, repeats=2.0))
    assert twice.saving_s == pytest.approx(1.28) and twice.commit


def test_a_young_circuit_stays_within_its_dwell() -> None:
    demand, budgets = {("a", "c"): 10 * GB}, {"a": 1, "b": 1, "c": 1}
    policy = CommitPolicy(min_dwell_s=30.0)
    young = planner.plan(
        request(demand, budgets, policy=policy, current=old(("a", "b"), since=990.0))
    )
    assert young.keep == CircuitSet([("a", "b")]) and not young.add and not young.commit
    assert "dwell" in young.reason
    aged = planner.plan(
        request(demand, budgets, policy=policy, current=old(("a", "b"), since=960.0))
    )
    assert aged.add == CircuitSet([("a", "c")]) and aged.remove == CircuitSet([("a", "b")])
    assert aged.commit
    # a circuit set up this instant is young under any dwell above zero, however small
    # against the clock (1000 - 1e-120 rounds to 1000)
    tiny = CommitPolicy(min_dwell_s=1e-120)
    now = planner.plan(request(demand, budgets, policy=tiny, current=old(("a", "b"), since=1000.0)))
    assert now.keep == CircuitSet([("a", "b")]) and not now.remove
    # decide refuses a target from any planner that takes a young circuit down
    forced = decide(
        request(demand, budgets, policy=policy, current=old(("a", "b"), since=990.0)),
        CircuitSet([("a", "c")]),
    )
    assert not forced.commit and "min_dwell_s" in forced.reason


def test_frozen_ports_are_not_used() -> None:
    plan = planner.plan(request({("a", "b"): GB}, {"a": 3, "b": 3}, frozen_ports={"a": 2}))
    assert plan.target == CircuitSet([("a", "b")])


def test_wiring_limits_the_pairs() -> None:
    demand = {("a", "b"): 10 * GB, ("a", "c"): GB}
    budgets = dict.fromkeys("abc", 2)
    plan = planner.plan(request(demand, budgets, allowed={("c", "a")}))
    # a-b is the bottleneck and no OCS joins it: no circuit can shorten the phase
    assert not plan.target and "no OCS joins it" in plan.reason
    plan = planner.plan(request(demand, budgets, allowed=lambda u, v: "c" in (u, v)))
    assert not plan.target
    plan = planner.plan(request({("a", "c"): GB}, budgets, allowed={("c", "a")}))
    assert plan.target == CircuitSet([("a", "c")] * 2)


def test_collective_demand_feeds_the_planner() -> None:
    members = {"t0": 8, "t1": 8, "t2": 8, "t3": 8}
    demand = collective_demand("all_reduce", members, 4 * GB)
    plan = planner.plan(request(demand, dict.fromkeys(members, 2)))
    assert plan.target == CircuitSet([("t0", "t1"), ("t1", "t2"), ("t2", "t3"), ("t0", "t3")])


def test_inconsistent_input_is_refused() -> None:
    budgets = {"a": 1, "b": 1, "c": 1}
    with pytest.raises(ConfigError, match="over its 1 usable"):
        planner.plan(request({}, budgets, current=old(("a", "b"), ("a", "c"))))
    with pytest.raises(ConfigError, match="not allowed"):
        planner.plan(request({}, budgets, allowed=set(), current=old(("a", "b"))))
    with pytest.raises(ConfigError, match="circuit_gbps"):
        planner.plan(request({}, budgets, circuit_gbps=0.0))
    with pytest.raises(ConfigError, match="demand"):
        planner.plan(request({("a", "b"): -1.0}, budgets))
    with pytest.raises(ConfigError, match="over its 1 usable"):
        decide(request({}, budgets), CircuitSet([("a", "b"), ("a", "b")]))
    with pytest.raises(ConfigError, match="no OCS reaches"):
        decide(request({}, budgets, allowed=set()), CircuitSet([("a", "b")]))


def _check(plan: Plan, req: PlanRequest) -> None:
    target = plan.target
    for switch, ports in target.ports().items():
        assert ports <= req.budgets.get(switch, 0) - req.frozen_ports.get(switch, 0)
    assert isinstance(req.allowed, set)
    for c in target:
        assert (c.a, c.b) in req.allowed or (c.b, c.a) in req.allowed
    current = CircuitSet(i.circuit for i in req.current)
    assert plan.keep + plan.remove == current and plan.keep + plan.add == target
    young = CircuitSet(i.circuit for i in req.current if req.now - i.since < req.policy.min_dwell_s)
    assert young - target == CircuitSet()

    def capacity(circuits: CircuitSet) -> dict[tuple[str, str], float]:
        caps = {(u, v): 100 * GBPS for u, v in req.demand}
        for c in circuits:
            caps[(c.a, c.b)] = caps.get((c.a, c.b), 100 * GBPS) + 400 * GBPS
        return caps

    assert plan.predicted_s_static == pytest.approx(phase_time(req.demand, capacity(current)))
    assert plan.predicted_s_with == pytest.approx(phase_time(req.demand, capacity(target)))
    if plan.commit:
        assert plan.saving_s > plan.reconfig_cost_s * (1 + req.policy.hysteresis)


_NAMES = "abcdefg"


@st.composite
def requests(draw: st.DrawFn) -> PlanRequest:
    budgets = {n: draw(st.sampled_from([0, 1, 2, 2, 3, 4])) for n in _NAMES}
    pairs = [(u, v) for i, u in enumerate(_NAMES) for v in _NAMES[i + 1 :]]
    allowed = set(draw(st.lists(st.sampled_from(pairs), min_size=3, unique=True)))
    # mostly wired pairs, either direction, so that circuits can help
    wired = st.sampled_from(sorted(allowed) or pairs)
    anywhere = st.tuples(st.sampled_from(_NAMES), st.sampled_from(_NAMES))
    keys = st.one_of(wired, wired, wired.map(lambda p: (p[1], p[0])), anywhere)
    demand = draw(st.dictionaries(keys, st.floats(1, 1e11), min_size=1, max_size=25))
    used = dict.fromkeys(_NAMES, 0)
    current = []
    for u, v in draw(st.lists(st.sampled_from(sorted(allowed) or pairs), max_size=12)):
        if (u, v) in allowed and used[u] < budgets[u] and used[v] < budgets[v]:
            used[u] += 1
            used[v] += 1
            current.append(Installed(Circuit(u, v), draw(st.floats(900.0, 1000.0))))
    frozen = {n: draw(st.integers(0, budgets[n] - used[n])) for n in _NAMES}
    return request(
        demand,
        budgets,
        allowed=allowed,
        current=current,
        frozen_ports=frozen,
        reconfig_cost=ReconfigCost(fixed_s=draw(st.floats(0, 2)), per_change_s=0.01),
        policy=CommitPolicy(hysteresis=0.3, min_dwell_s=draw(st.floats(0, 100))),
    )


@settings(max_examples=150, deadline=None)
@given(requests())
def test_plans_keep_budgets_wiring_and_dwell(req: PlanRequest) -> None:
    _check(planner.plan(req), req)


@pytest.mark.parametrize("switches", [512, 1024])
def test_dense_demand_at_scale(switches: int) -> None:
    rng = random.Random(switches)
    names = [f"s{i:04d}" for i in range(switches)]
    demand = {(u, names[j]): rng.random() * GB for i, u in enumerate(names) for j in range(i)}
    plan = planner.plan(request(demand, dict.fromkeys(names, 16), reconfig_cost=ReconfigCost()))
    assert 0 < len(plan.target) <= 8 * switches
    assert max(plan.target.ports().values()) <= 16
    assert plan.predicted_s_with < plan.predicted_s_static
