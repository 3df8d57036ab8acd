"""Placement strategies through a real spawn: all or nothing, with the reason."""

from __future__ import annotations

import pytest

import orchestr as oc
from tests.runtime.actors import Counter


async def test_strategies_through_spawn(ctx: oc.JobContext) -> None:
    packed = await ctx.spawn(Counter, n=2, strategy="STRICT_PACK", resources={"cpu": 0.25})
    nodes = {a.node_id for a in await ctx.actors() if a.mesh_id == packed.mesh_id}
    assert len(nodes) == 1
    before = [a.actor_id for a in await ctx.actors()]
    with pytest.raises(oc.PlacementError, match="STRICT_SPREAD: every member needs a node"):
        await ctx.spawn(Counter, n=2, strategy="STRICT_SPREAD", resources={"cpu": 0.25})
    assert [a.actor_id for a in await ctx.actors()] == before  # nothing half-created
    with pytest.raises(oc.ConfigError, match="unknown placement strategy 'ANY'"):
        await ctx.spawn(Counter, strategy="ANY")
