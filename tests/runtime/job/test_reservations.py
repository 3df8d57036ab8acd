"""Reservations through a running cluster: bundles held ahead of spawning, meshes spawned into
them, and their release stopping those meshes without failing the job."""

from __future__ import annotations

import pytest

import orchestr as oc
from orchestr._cluster._head import HeadService
from orchestr._cluster._node import NodeService
from orchestr._job._session import job_session
from tests.runtime.actors import Counter


async def _free_cpu(ctx: oc.JobContext) -> float:
    (node,) = await ctx.nodes()
    return float(node.free["cpu"])


async def test_spawn_into_a_reservation_and_release_it(ctx: oc.JobContext) -> None:
    cpu = await _free_cpu(ctx)
    gang = await ctx.reserve(2, resources={"cpu": 0.25}, strategy="STRICT_PACK", name="gang")
    assert gang.bundles == 2 and gang.resources == {"cpu": 0.25}
    assert await _free_cpu(ctx) == pytest.approx(cpu - 0.5)
    mesh = await ctx.spawn(Counter, n=2, reservation=gang)
    assert await mesh.add.call(1) == [1, 1]
    assert await _free_cpu(ctx) == pytest.approx(cpu - 0.5)  # the bundles hold the members
    with pytest.raises(oc.PlacementError, match="0 free bundle"):
        await ctx.spawn(Counter, reservation=gang)
    await gang.release()
    assert await _free_cpu(ctx) == pytest.approx(cpu)
    states = {a.state for a in await ctx.actors() if a.mesh_id == mesh.mesh_id}
    assert states == {"stopped"}
    with pytest.raises(oc.ActorDiedError):
        await mesh.add.call(1)
    await gang.release()  # idempotent
    with pytest.raises(oc.ConfigError, match="is released"):
        await ctx.spawn(Counter, reservation=gang)


async def test_a_reservation_that_does_not_fit_holds_nothing(ctx: oc.JobContext) -> None:
    cpu = await _free_cpu(ctx)
    with pytest.raises(oc.PlacementError, match="STRICT_SPREAD: every member needs a node"):
        await ctx.reserve(2, resources={"cpu": 0.1}, strategy="STRICT_SPREAD")
    with pytest.raises(oc.PlacementError, match="cannot place member 0"):
        await ctx.reserve(1, resources={"cpu": cpu + 1})
    assert await _free_cpu(ctx) == pytest.approx(cpu)
    with pytest.raises(oc.ConfigError, match="unknown placement strategy"):
        await ctx.reserve(1, strategy="NEAR")
    with pytest.raises(oc.ConfigError, match="must come from ctx.reserve"):
        await ctx.spawn(Counter, reservation="r-123")


async def test_the_jobs_end_releases_its_reservations() -> None:
    config = oc.load_config()
    async with HeadService("token", config) as head:
        async with NodeService(head.address, "token", config, resources={"cpu": 2.0}):
            async with job_session(head.address, "token", config) as ctx:
                await ctx.reserve(1, resources={"cpu": 0.5})
                assert await _free_cpu(ctx) == 1.5
            async with job_session(head.address, "token", config) as ctx:
                assert await _free_cpu(ctx) == 2.0
