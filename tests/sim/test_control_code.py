"""The real control code on virtual time: the fabric manager, its reconfiguration transaction
and the simulated OCS make the same decisions for the same hints on the wall clock and in a
simulation, where their waits take no wall time and their timings are the modelled ones."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from orchestr.fabric.optical import (
    CommitPolicy,
    FabricManager,
    Hint,
    ReconfigCost,
    RecordingRouter,
    SimOcs,
    load_topology,
)
from orchestr.sim import Simulation

PLAN = Path(__file__).resolve().parents[2] / "examples" / "fabric" / "small.toml"
GB = 1e9
LATENCY = 1e-3  # the simulated switch's time to program


async def hints(pause: float) -> tuple[list[tuple[Any, ...]], list[float]]:
    ocs = SimOcs(8, latency=LATENCY, rng=1)
    fm = FabricManager(
        load_topology(PLAN),
        {"ocs0": ocs},
        RecordingRouter(),
        policy=CommitPolicy(hysteresis=0.5, min_dwell_s=1.5),
        reconfig_cost=ReconfigCost(fixed_s=0.01, per_change_s=0.0),
    )
    await fm.hint(Hint("j", "a", {("tor0", "tor1"): 50 * GB}))
    await fm.hint(Hint("j", "b", {("tor0", "agg0"): 80 * GB}))  # a's circuit is in its dwell
    await asyncio.sleep(pause)
    await fm.hint(Hint("j", "c", {("tor0", "agg0"): 80 * GB}))
    ocs.fail_next_program()
    await fm.hint(Hint("j", "d", {("tor1", "agg0"): 80 * GB}))  # past the dwell: it fails
    await fm.hint(Hint("j", "e", {("tor1", "agg0"): 80 * GB}))
    decisions = [
        (r.seq, r.phase, r.commit, r.status, r.add, r.remove, r.generation, r.reason)
        for r in fm.history
    ]
    return decisions, [r.timings.get("program", -1.0) for r in fm.history]


def test_the_fabric_manager_decides_alike_on_the_wall_clock_and_on_virtual_time() -> None:
    wall, wall_programs = asyncio.run(hints(1.6))
    with Simulation() as sim:
        virtual, programs = sim.run(hints(1.6))
        assert sim.engine.now >= 1.6e9
    assert virtual == wall
    # e's plan is committed, but the ports d's rollback touched are still in their dwell
    assert [d[3] for d in wall] == ["applied", "applied", "skipped", "rolled_back", "unchanged"]
    assert "younger than the 1.5 s dwell held" in wall[1][7]
    assert len(wall[3][5]) == 2  # d would remove a's and b's circuits, old enough by then
    # on virtual time a program takes exactly the switch's modelled latency
    assert [p for p in programs if p >= 0] == pytest.approx([LATENCY] * 3, abs=1e-12)
    assert all(p > 0 for p in wall_programs if p >= 0)
