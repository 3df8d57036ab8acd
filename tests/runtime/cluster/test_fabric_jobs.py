"""Jobs and the fabric manager: a phase's traffic reaches the head's manager as a hint, the
circuits it commits are in place before the phase starts, and the job's event log and trace
show them; a job can keep the fabric static. Real head, nodes and workers, in process."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import orchestr as oc
from orchestr._cluster._fabric import open_fabric
from orchestr._cluster._head import HeadService
from orchestr._cluster._node import NodeService
from orchestr._job._events import read_events
from orchestr._job._session import job_session
from tests.runtime.actors import Counter

PLAN = Path(__file__).resolve().parents[3] / "examples" / "fabric" / "small.toml"
BIG = 500 * 10**9  # bytes: enough that a circuit beats the OCS's reconfiguration cost


@pytest.fixture
async def head() -> AsyncIterator[HeadService]:
    config = oc.load_config()
    async with HeadService("token", config) as service:
        service.fabric = open_fabric(PLAN)
        async with (
            NodeService(service.address, "token", config, labels={"fabric_host": "h0"}),
            NodeService(service.address, "token", config, labels={"fabric_host": "h2"}),
        ):
            yield service


async def test_a_phase_gets_its_circuits_first_and_the_trace_shows_them(
    head: HeadService,
) -> None:
    config = oc.load_config()
    async with job_session(head.address, "token", config) as ctx:
        mesh = await ctx.spawn(Counter, n=2, strategy="STRICT_SPREAD", name="ring")
        async with ctx.phase("weight_sync", traffic=oc.Collective("broadcast", "ring", BIG)):
            assert head.fabric is not None and len(head.fabric.circuits()) == 1
            await mesh.add.call(1)
        async with ctx.phase("generation"):  # no traffic declared: nothing to plan
            pass
        log = ctx.events.path
    assert head.fabric is not None
    (record,) = head.fabric.history
    assert (record.job_id, record.phase, record.status) == (ctx.job_id, "weight_sync", "applied")
    assert record.add == (("tor0", "tor1", 1),)
    events = read_events(log)
    kinds = [(e["kind"], e.get("name")) for e in events if e["kind"] in ("fabric_plan", "phase")]
    assert kinds == [
        ("fabric_plan", "circuits for weight_sync"),
        ("phase", "weight_sync"),
        ("phase", "generation"),
    ]
    plan = next(e for e in events if e["kind"] == "fabric_plan")
    phase = next(e for e in events if e["kind"] == "phase")
    assert plan["track"] == "fabric" and plan["status"] == "applied"
    assert plan["ts"] + plan["dur"] <= phase["ts"] + 1e-3  # the circuits came first
    assert set(plan["timings"]) >= {"reserve", "program", "verify", "undrain"}
    trace = json.loads((Path(log).parent / "trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M"}
    assert {"fabric", "phases"} <= tracks


async def test_a_static_job_leaves_the_fabric_alone(head: HeadService) -> None:
    config = dataclasses.replace(oc.load_config(), fabric="static")
    async with job_session(head.address, "token", config) as ctx:
        await ctx.spawn(Counter, n=2, strategy="STRICT_SPREAD", name="ring")
        async with ctx.phase("weight_sync", traffic=oc.Collective("broadcast", "ring", BIG)):
            pass
        log = ctx.events.path
    assert head.fabric is not None and not head.fabric.history
    assert not [e for e in read_events(log) if e["kind"] == "fabric_plan"]


async def test_traffic_of_unknown_meshes_is_left_out_and_logged(head: HeadService) -> None:
    async with job_session(head.address, "token", oc.load_config()) as ctx:
        await ctx.spawn(Counter, n=2, strategy="STRICT_SPREAD", name="ring")
        async with ctx.phase("x", traffic=oc.Collective("all_reduce", "critic", 10)):
            pass  # the phase runs: a hint is advice
        traffic = {("ring", "ring"): BIG, ("ring", "critic"): BIG}
        async with ctx.phase("y", traffic=traffic):
            pass
        log = ctx.events.path
    skipped = [e for e in read_events(log) if e["kind"] == "fabric_hint_skipped"]
    assert [(e["phase"], e["unknown_meshes"]) for e in skipped] == [
        ("x", ["critic"]),
        ("y", ["critic"]),
    ]
    assert head.fabric is not None
    assert [r.phase for r in head.fabric.history] == ["y"]  # its known part was sent


async def test_without_a_fabric_manager_phases_run_as_before(ctx: oc.JobContext) -> None:
    await ctx.spawn(Counter, name="ring")
    for _ in range(2):  # the head is asked once
        async with ctx.phase("weight_sync", traffic=oc.Collective("broadcast", "ring", 10)):
            pass
    assert ctx._fabric_on is False


async def test_an_announced_phase_gets_its_circuits_in_its_lead_time(head: HeadService) -> None:
    async with job_session(head.address, "token", oc.load_config()) as ctx:
        await ctx.spawn(Counter, n=2, strategy="STRICT_SPREAD", name="ring")
        ctx.announce("weight_sync", traffic=oc.Collective("broadcast", "ring", BIG), lead_s=1.0)
        with pytest.raises(oc.ConfigError, match="lead_s is a number of seconds"):
            ctx.announce("x", lead_s=-1)
        async with ctx.phase("weight_sync"):  # waits for the announced plan, asks nothing
            assert head.fabric is not None and len(head.fabric.circuits()) == 1
        ctx.announce("training", traffic=oc.Collective("all_reduce", "ring", BIG))  # never run
        log = ctx.events.path
    assert head.fabric is not None
    assert next((r.phase, r.status) for r in head.fabric.history) == ("weight_sync", "applied")
    plans = [e for e in read_events(log) if e["kind"] == "fabric_plan"]
    assert plans[0]["phase"] == "weight_sync" and plans[0]["lead_s"] == 1.0
