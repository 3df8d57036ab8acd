"""Compiled step graphs: wired once, executed per step, steps pipelined; against real workers."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

import orchestr as oc
from orchestr._graph._dry import capture_graph
from tests.cluster import open_cluster
from tests.runtime.graph_actors import Ordered

on_cluster = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster() -> AsyncIterator[tuple[oc.JobContext, oc.Mesh, oc.Mesh]]:
    async with open_cluster() as ctx:
        four, one = await asyncio.gather(
            ctx.spawn(Ordered, n=4, name="four", resources={"cpu": 0.25}),
            ctx.spawn(Ordered, name="one", resources={"cpu": 0.25}),
        )
        yield ctx, four, one


Cluster = tuple[oc.JobContext, oc.Mesh, oc.Mesh]


@on_cluster
async def test_fanout_steps_pipelined_reach_every_actor_in_order(cluster: Cluster) -> None:
    ctx, four, _ = cluster
    g = oc.Graph("fan")
    g.output(g.fanout("take", four.take, g.input("x")))
    async with await g.compile(ctx) as compiled:
        assert await compiled.execute("first") == [[r, "first"] for r in range(4)]
        futures = [compiled.execute(i) for i in range(50)]  # all dispatched before any ends
        assert compiled.inflight >= 1
        results = await asyncio.gather(*futures)
    assert results == [[[r, i] for r in range(4)] for i in range(50)]
    for history in await four.history.call():
        assert history[-50:] == list(range(50))  # each actor ran the steps in order
    with pytest.raises(oc.ClosedResourceError, match="was closed"):
        compiled.execute(1)


@on_cluster
async def test_chains_choice_and_several_outputs(cluster: Cluster) -> None:
    ctx, four, one = cluster
    g = oc.Graph("chain")
    x = g.input()
    bumped = g.map("bump", one.plus_one, x)
    routed = g.map("route", four.take, bumped, choice=lambda v, n: v % n)
    g.output(routed)
    g.output(g.fanout("all", four.take, bumped), name="everyone")
    compiled = await g.compile(ctx)
    out = await compiled.execute(5)
    assert out == {"route": [2, 6], "everyone": [[r, 6] for r in range(4)]}
    outs = await asyncio.gather(*(compiled.execute(v) for v in range(8)))
    assert [o["route"] for o in outs] == [[(v + 1) % 4, v + 1] for v in range(8)]


@on_cluster
async def test_a_remote_error_fails_only_its_step(cluster: Cluster) -> None:
    ctx, four, one = cluster
    g = oc.Graph("errors")
    g.fanout("then", four.take, g.map("bump", one.plus_one, g.input()))
    compiled = await g.compile(ctx)
    bad, good = compiled.execute(-1), compiled.execute(1)
    with pytest.raises(oc.ActorError, match="negative step value -1") as info:
        await bad
    assert "plus_one" in info.value.remote_traceback
    assert await good == [[r, 2] for r in range(4)]


@on_cluster
async def test_large_arguments_take_the_shared_memory_path(cluster: Cluster) -> None:
    ctx, four, _ = cluster
    g = oc.Graph("big")
    g.fanout("size", four.size, g.input())
    compiled = await g.compile(ctx)
    array = np.ones(1 << 19)  # 4 MiB: past the inline limit
    assert await compiled.execute(array) == [array.nbytes] * 4


@on_cluster
async def test_steps_survive_a_restarted_member(cluster: Cluster) -> None:
    ctx, _, _ = cluster
    policy = oc.RestartPolicy(max_restarts=2, backoff_s=0.02, retry="at_least_once")
    mesh = await ctx.spawn(Ordered, n=2, name="phoenix", restart=policy, resources={"cpu": 0.25})
    g = oc.Graph("survive")
    g.fanout("take", mesh.take, g.input())
    compiled = await g.compile(ctx)
    pid = (await mesh.pid.call())[1]
    results = []
    async with asyncio.timeout(30):
        for i in range(40):
            if i == 10:
                os.kill(pid, signal.SIGKILL)
            results.append(await compiled.execute(i))
    assert results == [[[0, i], [1, i]] for i in range(40)]
    assert (await mesh.pid.call())[1] != pid


def test_what_cannot_be_compiled() -> None:
    from orchestr._call._mesh import Member

    mesh = oc.Mesh("m-x", "x", "pkg:X", [Member("a-0", "tcp://127.0.0.1:1", 0)], ["take"])
    g = oc.Graph("streaming")
    g.map("take", mesh.take, g.source("items", [1, 2]))
    with pytest.raises(oc.ConfigError, match="needs exactly one g.input"):
        asyncio.run(g.compile(None))
    g = oc.Graph("batched")
    x = g.input()
    g.map("take", mesh.take, g.map("first", mesh.take, x).batch(count=2))
    with pytest.raises(oc.ConfigError, match="batches its input"):
        asyncio.run(g.compile(None))
    g = oc.Graph("stepwise")
    g.map("take", mesh.take, g.input())
    with pytest.raises(oc.ConfigError, match="compile it with"):
        g.run(None)
    with pytest.raises(oc.ConfigError, match="step_timeout_s must be a positive number"):
        asyncio.run(g.compile(None, step_timeout_s=0))


async def test_orchestr_graph_captures_a_compiled_graph() -> None:
    async def main(ctx: Any) -> None:
        mesh = await ctx.spawn(Ordered, n=3)
        await ctx.init_distributed(mesh)  # nothing to join in a dry run
        g = oc.Graph("dry")
        g.fanout("take", mesh.take, g.input("x"))
        compiled = await g.compile(ctx)
        await compiled.execute(1)  # never reached in a dry run

    graph = await capture_graph(main)
    assert graph.name == "dry"
    text = graph.describe()
    assert "input, one value per step (compiled)" in text and "fanout Ordered.take" in text
    assert "shape=cds" in graph.to_dot()
