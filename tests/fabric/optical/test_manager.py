"""The fabric manager over a simulated OCS: hints become plans, worthwhile plans are applied
through the transaction, everything lands in the history."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestr.errors import ConfigError
from orchestr.fabric._optical._circuits import CircuitSet
from orchestr.fabric._optical._costmodel import ReconfigCost
from orchestr.fabric._optical._fattree import OcsLayer, fat_tree
from orchestr.fabric._optical._manager import FabricManager, Hint, hint_demand
from orchestr.fabric._optical._ocs_sim import SimOcs
from orchestr.fabric._optical._plan import CommitPolicy
from orchestr.fabric._optical._routing import RecordingRouter
from orchestr.fabric._optical._topology_file import load_topology

PLAN = Path(__file__).resolve().parents[3] / "examples" / "fabric" / "small.toml"
GB = 1e9


def manager(sim: SimOcs, router: RecordingRouter, **kw: object) -> FabricManager:
    args: dict[str, object] = {
        "policy": CommitPolicy(hysteresis=0.5, min_dwell_s=0.0),
        "reconfig_cost": ReconfigCost(fixed_s=0.01, per_change_s=0.0),
    }
    args.update(kw)
    return FabricManager(load_topology(PLAN), {"ocs0": sim}, router, **args)


def test_hint_demand_from_meshes_and_collectives() -> None:
    members: dict[str, list[str | None]] = {
        "trainer": ["tor0", "tor0"],
        "gen": ["tor1", None],  # the second generator is off the managed fabric
    }
    assert hint_demand({("trainer", "gen"): 8 * GB}, members) == {("tor0", "tor1"): 8 * GB}
    ring = hint_demand(("all_reduce", "both", GB), {"both": ["tor0", "tor1"]})
    assert ring == {("tor0", "tor1"): GB, ("tor1", "tor0"): GB}  # 2(n-1)/n * S each way
    assert hint_demand(None, members) == {}
    with pytest.raises(ConfigError, match="mesh 'critic', which this job has not spawned"):
        hint_demand({("trainer", "critic"): GB}, members)


async def test_a_worthwhile_hint_is_applied_and_a_repeat_changes_nothing() -> None:
    sim, router = SimOcs(8, latency=1e-5, rng=1), RecordingRouter()
    fm = manager(sim, router)
    record = await fm.hint(Hint("job-1", "weight_sync", {("tor0", "tor1"): 50 * GB}))
    assert record.commit and record.status == "applied", record.reason
    assert record.add == (("tor0", "tor1", 1),)  # tor1 has one OCS uplink
    assert record.port_changes == 2
    assert record.predicted_s_with < record.predicted_s_static
    assert set(record.timings) >= {"reserve", "program", "verify", "undrain"}
    assert fm.circuits() == CircuitSet([("tor0", "tor1")])
    generation, live = await sim.circuits()
    assert generation == record.generation and len(live) == 1
    assert router.calls[-1] == ("undrain", frozenset({("tor0", "tor1")}))
    again = await fm.hint(Hint("job-1", "weight_sync", {("tor0", "tor1"): 50 * GB}))
    assert (again.commit, again.status, again.add, again.remove) == (False, "skipped", (), ())
    assert [r.seq for r in fm.history] == [1, 2]
    shown = fm.show()
    assert shown["generation"] == record.generation
    assert shown["ocs"][0]["circuits"] == [[0, 2, "tor0", "tor1"]]


async def test_a_small_saving_is_not_worth_a_reconfiguration() -> None:
    sim = SimOcs(8, latency=1e-5, rng=1)
    fm = manager(sim, RecordingRouter(), reconfig_cost=ReconfigCost(fixed_s=5.0))
    record = await fm.hint(Hint("job-1", "generation", {("tor0", "tor1"): GB}))
    assert not record.commit and record.status == "skipped"
    assert "saving" in record.reason
    assert (await sim.circuits())[1] == frozenset()  # the switch was never touched


async def test_a_failed_program_rolls_back_and_is_recorded() -> None:
    sim = SimOcs(8, latency=1e-5, rng=1)
    fm = manager(sim, RecordingRouter())
    sim.fail_next_program()
    record = await fm.hint(Hint("job-1", "weight_sync", {("tor0", "tor1"): 50 * GB}))
    assert record.commit and record.status == "rolled_back"
    assert fm.circuits() == CircuitSet()
    assert any(e.startswith("rollback") for e in record.events)


async def test_bad_hints_and_missing_drivers_are_refused() -> None:
    fm = manager(SimOcs(8, latency=1e-5), RecordingRouter())
    with pytest.raises(ConfigError, match="switches an OCS reaches"):
        await fm.hint(Hint("job-1", "x", {("tor0", "core9"): GB}))
    with pytest.raises(ConfigError, match="no driver for OCS ocs0"):
        FabricManager(load_topology(PLAN), {}, RecordingRouter())
    assert fm.host_endpoint("h2") == "tor1"


FAULTS = ("none", "fail_next_program", "drop_next_ack", "delay_next_ack", "fail_port")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    hints=st.lists(
        st.tuples(
            st.dictionaries(
                st.tuples(st.integers(0, 7), st.integers(0, 7)).filter(lambda p: p[0] != p[1]),
                st.floats(0, 5e12),
                max_size=6,
            ),
            st.sampled_from(FAULTS),
            st.integers(0, 3),
        ),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**16),
)
async def test_random_hints_and_faults_keep_the_fabric_consistent(
    hints: list[tuple[dict[tuple[int, int], float], str, int]], seed: int
) -> None:
    """Over random hints and injected switch faults, every transition passes the invariants
    (the transaction raises InvariantError otherwise), the manager counts no circuit the
    switch does not have, and each tor uses no more OCS ports than it is wired to. (A plan can
    be refused: a port that failed after the read-back.)"""
    topology = fat_tree(4, ocs=OcsLayer(tier="tor", count=2, uplinks=2))
    sims = {o.name: SimOcs(o.radix, latency=(1e-6, 1e-4), rng=seed) for o in topology.ocs}
    fm = FabricManager(
        topology,
        sims,
        RecordingRouter(),
        policy=CommitPolicy(hysteresis=0.2, min_dwell_s=0.0),
        reconfig_cost=ReconfigCost(fixed_s=0.001, per_change_s=0.0),
        step_timeout_s=0.05,
    )
    tors = fm.endpoints
    for demand, fault, port in hints:
        sim = sims[topology.ocs[port % len(topology.ocs)].name]
        if fault == "fail_port":
            sim.fail_port(port)
        elif fault == "delay_next_ack":
            sim.delay_next_ack(0.2)  # past the step timeout: the program times out
        elif fault != "none":
            getattr(sim, fault)()
        named = {(tors[a % len(tors)], tors[b % len(tors)]): v for (a, b), v in demand.items()}
        named = {k: v for k, v in named.items() if k[0] != k[1]}
        record = await fm.hint(Hint("job", "p", named))
        statuses = ("applied", "unchanged", "skipped", "refused", "rolled_back", "drained")
        assert record.status in statuses
        budget = topology.circuit_budgets()
        for tor, used in fm.circuits().ports().items():
            assert used <= budget[tor]
        ours = {(o, c) for o, c in fm._since}
        for name, sim in sims.items():
            _, live = await sim.circuits()
            mine = {c for o, c in ours if o == name}
            assert mine <= set(live), "the manager counts a circuit the switch does not have"


async def test_lead_time_hides_the_reconfiguration_cost() -> None:
    costly = ReconfigCost(fixed_s=5.0, per_change_s=0.0)
    late = await manager(SimOcs(8, latency=1e-5), RecordingRouter(), reconfig_cost=costly).hint(
        Hint("job-1", "generation", {("tor0", "tor1"): GB})
    )
    assert not late.commit and late.reconfig_cost_s == 5.0
    early = await manager(SimOcs(8, latency=1e-5), RecordingRouter(), reconfig_cost=costly).hint(
        Hint("job-1", "generation", {("tor0", "tor1"): GB}, lead_s=10.0)
    )
    assert early.commit and early.status == "applied" and early.reconfig_cost_s == 0.0
