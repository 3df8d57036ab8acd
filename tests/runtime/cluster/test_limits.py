"""Sizes are checked before anything is built for them, and no spawn waits forever: a huge
mesh, a node declaring impossible resources, a constructor that never returns."""

from __future__ import annotations

import math

import pytest

import orchestr as oc
from orchestr._cluster._headstate import HeadState
from orchestr._cluster._node import NodeService
from orchestr._cluster._records import MAX_MESH_SIZE, validate_resources
from orchestr.errors import ConfigError
from tests.cluster import open_cluster
from tests.runtime.actors import Counter, HangsInInit


async def test_a_constructor_that_never_returns_fails_the_spawn() -> None:
    async with open_cluster(oc.load_config(actor_init_timeout=1.0)) as ctx:
        with pytest.raises(oc.SpawnError, match=r"not created within 1 s.*ACTOR_INIT_TIMEOUT"):
            await ctx.spawn(HangsInInit)
        assert all(a.state != "alive" for a in await ctx.actors())
        counter = await ctx.spawn(Counter)  # and the cluster goes on
        assert await counter.add.call_one(2) == 2


async def test_a_huge_mesh_is_refused_before_anything_is_built(ctx: oc.JobContext) -> None:
    with pytest.raises(oc.ConfigError, match=f"1 to {MAX_MESH_SIZE} members"):
        await ctx.spawn(Counter, n=MAX_MESH_SIZE + 1)
    assert await ctx.actors() == []


@pytest.mark.parametrize(
    "resources",
    [
        {"cpu": math.inf},
        {"cpu": math.nan},
        {"cpu": -1.0},
        {"": 1.0},
        {"x" * 200: 1.0},
        {f"r{i}": 1.0 for i in range(100)},
    ],
)
def test_impossible_resources_are_refused(resources: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        validate_resources(resources)
    with pytest.raises(ConfigError):
        HeadState().register_node("n1", "127.0.0.1:1", resources, {}, now=0.0)


async def test_a_node_declaring_impossible_resources_is_refused(ctx: oc.JobContext) -> None:
    node = NodeService(ctx.head.address, ctx.token, ctx.config, resources={"cpu": math.inf})
    with pytest.raises(oc.OrchestrError, match="finite non-negative"):
        async with node:
            pass
    assert len(await ctx.nodes()) == 1
