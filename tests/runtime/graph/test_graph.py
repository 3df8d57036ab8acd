"""Dataflow graphs: declarations and rendering without a cluster, then execution against real
worker processes on one embedded cluster shared by the module (spawning is the slow part)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

import orchestr as oc
from orchestr._call._mesh import Member
from orchestr._graph._dry import DryRunError, NoGraphError, capture_graph
from orchestr._graph._route import Batcher, Router
from orchestr._job._events import read_events
from tests.cluster import open_cluster
from tests.runtime.graph_actors import Stage

on_cluster = pytest.mark.asyncio(loop_scope="module")


def fake_mesh(name: str = "gens", n: int = 2) -> oc.Mesh:
    members = [Member(f"a-{r}", "tcp://127.0.0.1:1", r) for r in range(n)]
    return oc.Mesh(f"m-{name}", name, "pkg:Gen", members, ["generate", "score"])


# -- declarations, validation, rendering (no cluster) ------------------------------------


def test_validation_errors_are_clear() -> None:
    gens = fake_mesh()
    g = oc.Graph("rl")
    src = g.source("prompts", range(4))
    with pytest.raises(oc.ConfigError, match="unknown choice 'fastest'.*least_loaded"):
        g.map("gen", gens.generate, src, choice="fastest")
    with pytest.raises(oc.ConfigError, match="capacity must be an integer >= 1, got 0"):
        g.map("gen", gens.generate, src, capacity=0)
    with pytest.raises(oc.ConfigError, match="needs count=, timeout_s= or both"):
        src.batch()
    with pytest.raises(oc.ConfigError, match="batch of 32 .* can never fill.*capacity=16"):
        src.batch(count=32)
    with pytest.raises(oc.ConfigError, match="needs a mesh endpoint such as `mesh.generate`"):
        g.map("gen", Stage.double, src)
    other = oc.Graph("other")
    foreign = other.source("prompts", [])
    with pytest.raises(oc.ConfigError, match="belongs to graph 'other', not 'rl'"):
        g.map("gen", gens.generate, foreign)
    g.map("gen", gens.generate, src)
    with pytest.raises(oc.ConfigError, match="already has a node named 'gen'"):
        g.map("gen", gens.score, src)
    with pytest.raises(oc.ConfigError, match="name is 1-64 letters"):
        g.source("bad name", [])
    with pytest.raises(oc.ConfigError, match="at least two inputs"):
        g.merge("m", src)
    with pytest.raises(oc.ConfigError, match="the same input twice"):
        g.merge("m", src, src)
    with pytest.raises(oc.ConfigError, match="'requeue' .* its input 'prompts' is a source"):
        g.map("learn", gens.score, src, staleness=oc.Staleness(1, "requeue"))
    with pytest.raises(oc.ConfigError, match="staleness policy must be"):
        oc.Staleness(1, "later")
    with pytest.raises(oc.ConfigError, match="retries must be an integer >= 0"):
        g.map("x", gens.score, src, retries=-1)
    with pytest.raises(oc.ConfigError, match="needs an iterable"):
        g.source("n", 5)
    with pytest.raises(oc.ConfigError, match="a version is an integer"):
        oc.Versioned("v", "1")
    g.output(src)
    with pytest.raises(oc.ConfigError, match="already has an output named 'prompts'"):
        g.output(src)
    g.running = True
    with pytest.raises(oc.ConfigError, match="is running; declare every node before"):
        g.source("late", [])


def rl_graph() -> oc.Graph:
    gens, scorers = fake_mesh("gens", 4), fake_mesh("scorers", 2)
    g = oc.Graph("rl")
    prompts = g.source("prompts", [1, 2, 3])
    gen = g.map("generate", gens.generate, prompts, capacity=8, ordered=False)
    scored = g.map("score", scorers.score, gen.batch(count=8, timeout_s=0.05))
    g.fanout("sync", scorers.generate, scored, staleness=oc.Staleness(4))
    return g


def test_describe_dict_and_dot() -> None:
    g = rl_graph()
    text = g.describe()
    assert text.splitlines()[0] == "graph 'rl': 4 node(s), 1 output(s)"
    assert "prompts   source, list of 3 items; capacity 16" in text
    assert "generate  map gens.generate on 4 member(s) <- prompts, choice least_loaded" in text
    assert "<- generate.batch(count=8, timeout_s=0.05)" in text
    assert "fanout scorers.generate on 2 member(s)" in text and "staleness eta=4 drop" in text
    data = g.to_dict()
    assert data["outputs"] == {"sync": "sync"}
    assert data["nodes"][2]["inputs"] == [
        {"node": "generate", "batch_count": 8, "batch_timeout_s": 0.05}
    ]
    dot = g.to_dot()
    assert dot.startswith('digraph "rl" {')
    assert (
        '"generate" -> "score" [label="batch(count=8, timeout_s=0.05)\\ncap 8\\nunordered"];' in dot
    )
    assert '"sync" -> "output:sync" [style=dashed];' in dot


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_render_writes_dot_and_svg(tmp_path: Path) -> None:
    dot, svg = rl_graph().render(tmp_path / "rl")
    assert dot.read_text().startswith("digraph")
    assert "<svg" in svg.read_text() and "generate" in svg.read_text()


def test_render_without_graphviz_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(oc.ConfigError, match="`dot` is not on PATH.*install Graphviz"):
        rl_graph().render(tmp_path / "rl")
    assert (tmp_path / "rl.dot").exists()


def test_router_policies() -> None:
    least = Router(2, "least_loaded", 2)
    assert [least.take(0.0) for _ in range(5)] == [0, 1, 0, 1, None]  # ties rotate, limit 2
    least.end(0, ok=True)
    assert least.take(0.0) == 0
    rr = Router(3, "round_robin", 1)
    assert [rr.take(0.0), rr.take(0.0)] == [0, 1]
    rr.end(0, ok=True)
    assert rr.take(0.0) == 2 and rr.take(0.0) == 0
    assert rr.take(0.0) is None  # strict: waits for member 1
    fn = Router(2, lambda v, n: 1 if v == "long" else 0, 4)
    assert fn.preferred("long") == 1 and fn.take(0.0, 1) == 1
    assert fn.died(1, 0.0) == 0.05 and fn.died(1, 0.0) == 0.1  # backoff doubles
    assert fn.take(0.0, 1) == 0  # its pick is down: the least-loaded member instead
    assert fn.wake_at(0.0) == 0.1 and fn.up(1, 0.2)
    bad = Router(2, lambda v, n: 7, 1)
    with pytest.raises(oc.ConfigError, match="returned 7 for a mesh of 2"):
        bad.preferred("x")


def test_batcher_by_count_and_time() -> None:
    by_count = Batcher(3, None)
    assert [by_count.add(i, 0.0) for i in range(3)] == [False, False, True]
    assert by_count.take() == [0, 1, 2] and not by_count.due(99.0)
    by_time = Batcher(None, 0.5)
    by_time.add("a", 1.0)
    by_time.add("b", 1.2)
    assert not by_time.due(1.4) and by_time.due(1.5) and by_time.take() == ["a", "b"]


async def test_dry_run_captures_the_first_graph() -> None:
    async def main(ctx: Any) -> None:
        mesh = await ctx.spawn(Stage, n=3, name="workers")
        async with ctx.phase("generation"):
            g = oc.Graph("dry")
            g.map("double", mesh.double, g.source("nums", range(3)))
            await g.collect(ctx)
        raise AssertionError("not reached")

    graph = await capture_graph(main)
    assert graph.name == "dry" and "workers.double on 3 member(s)" in graph.describe()

    async def calls_first(ctx: Any) -> None:
        mesh = await ctx.spawn(Stage)
        await mesh.double.call_one(1)

    with pytest.raises(DryRunError, match=r"calls Stage.double before its first graph"):
        await capture_graph(calls_first)

    async def no_graph(ctx: Any) -> None:
        await ctx.spawn("tests.runtime.graph_actors:Stage")

    with pytest.raises(NoGraphError, match="ended without running a graph"):
        await capture_graph(no_graph)

    async def bad_args(ctx: Any) -> None:
        await ctx.spawn(Stage, 1, 2)

    with pytest.raises(oc.SpawnError, match="cannot be built with these arguments"):
        await capture_graph(bad_args)


# -- execution on a real cluster ----------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster() -> AsyncIterator[tuple[oc.JobContext, oc.Mesh, oc.Mesh]]:
    async with open_cluster() as ctx:
        two, one = await asyncio.gather(ctx.spawn(Stage, n=2), ctx.spawn(Stage, name="solo"))
        yield ctx, two, one


Cluster = tuple[oc.JobContext, oc.Mesh, oc.Mesh]


def graph_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("graph:")]


@on_cluster
async def test_map_ordered_and_unordered(cluster: Cluster) -> None:
    ctx, two, _ = cluster
    # item 0 holds member 0; least-loaded sends the rest to member 1, which finishes first
    items = [[0, 0.5], [1, 0.0], [2, 0.0], [3, 0.0]]
    for ordered, expect in [(True, [0, 1, 2, 3]), (False, [1, 2, 3, 0])]:
        g = oc.Graph("order")
        work = g.map(
            "work", two.work, g.source("items", items), ordered=ordered, inflight_per_member=1
        )
        out = (await g.collect(ctx))["work"]
        assert [v for v, _ in out] == expect
        assert dict(out) == {0: 0, 1: 1, 2: 1, 3: 1}
        assert work.name == "work"
    assert graph_tasks() == []


@on_cluster
async def test_batching_by_count_and_by_time(cluster: Cluster) -> None:
    ctx, two, _ = cluster
    g = oc.Graph("batches")
    g.map("total", two.total, g.source("nums", range(10)).batch(count=4))
    assert (await g.collect(ctx))["total"] == [[4, 6], [4, 22], [2, 17]]

    async def bursts() -> AsyncIterator[int]:
        for burst in ([1, 2, 3], [10, 20]):
            for x in burst:
                yield x
            await asyncio.sleep(0.3)

    g = oc.Graph("timed")
    g.map("total", two.total, g.source("nums", bursts()).batch(timeout_s=0.1))
    assert (await g.collect(ctx))["total"] == [[3, 6], [2, 30]]


@on_cluster
async def test_fanout_merge_tee_and_plain_calls_beside(cluster: Cluster) -> None:
    ctx, two, one = cluster
    g = oc.Graph("shapes")
    a, b = g.source("a", [1, 2, 3]), g.source("b", [10, 20])
    merged = g.merge("all", a, b)
    doubled = g.map("double", one.double, merged, ordered=False)
    g.output(g.fanout("sync", two.step, doubled))
    g.output(g.map("again", two.double, doubled))  # a tee: both see every item
    async with g.run(ctx) as run:
        assert await two.double.call(5) == [10, 10]  # plain calls keep working
        out = await run.collect()
    assert sorted(out["again"]) == [4, 8, 12, 40, 80]
    assert sorted(r[0][1] for r in out["sync"]) == [2, 4, 6, 20, 40]
    assert all([rank for rank, _ in r] == [0, 1] for r in out["sync"])  # fan-in in rank order
    stats = run.stats()
    assert stats["double->sync"]["sent"] == stats["double->again"]["sent"] == 5
    assert stats["a->all"]["delivered"] == 3 and stats["b->all"]["delivered"] == 2
    assert all(s["in_window"] == 0 and s["queue_depth"] == 0 for s in stats.values())


@on_cluster
async def test_round_robin_and_a_routing_function(cluster: Cluster) -> None:
    ctx, two, _ = cluster
    g = oc.Graph("rr")
    g.map("work", two.work, g.source("items", [[i, 0.0] for i in range(6)]), choice="round_robin")
    assert [rank for _, rank in (await g.collect(ctx))["work"]] == [0, 1, 0, 1, 0, 1]

    def long_to_one(item: list[Any], n: int) -> int:
        return 1 if item[1] > 0.05 else 0

    items = [[i, 0.1 if i % 3 == 0 else 0.0] for i in range(9)]
    g = oc.Graph("routed")
    g.map("work", two.work, g.source("items", items), choice=long_to_one)
    out = (await g.collect(ctx))["work"]
    assert out == [[i, 1 if i % 3 == 0 else 0] for i in range(9)]

    g = oc.Graph("misrouted")
    g.map("work", two.work, g.source("items", [[0, 0.0]]), choice=lambda v, n: n)
    with pytest.raises(oc.ConfigError, match="returned 2 for a mesh of 2"):
        await g.collect(ctx)


@on_cluster
async def test_backpressure_bounds_how_far_the_source_runs_ahead(cluster: Cluster) -> None:
    ctx, _, one = cluster
    pulled = 0

    def items() -> Iterator[list[Any]]:
        nonlocal pulled
        for i in range(12):
            pulled += 1
            yield [i, 0.01]

    g = oc.Graph("bounded")
    src = g.source("items", items(), capacity=2)
    work = g.map("work", one.work, src, capacity=3, inflight_per_member=1)
    ahead = []
    async with g.run(ctx) as run:
        seen = 0
        async for _ in run.results(work):
            seen += 1
            await asyncio.sleep(0.03)  # a slow consumer
            ahead.append(pulled - seen)
    assert seen == 12
    # every pulled item not yet read holds a slot in one of the two windows
    assert max(ahead) <= 2 + 3, ahead


@on_cluster
async def test_staleness_drop_and_requeue_are_counted(cluster: Cluster) -> None:
    ctx, two, one = cluster
    g = oc.Graph("stale")
    src = g.source("rollouts", [oc.Versioned(i, i) for i in range(10)])
    learn = g.map("learn", two.double, src, staleness=oc.Staleness(2, "drop"))
    async with g.run(ctx) as run:
        run.set_version(8)
        out = [pair async for pair in run.results(learn, versioned=True)]
    assert out == [(12, 6), (14, 7), (16, 8), (18, 9)]
    assert run.stats()["rollouts->learn"]["dropped_stale"] == 6

    await one.reset.call_one()
    g = oc.Graph("requeue")
    gen = g.map("gen", one.generate, g.source("prompts", range(6)))  # version = call number
    learn = g.map("learn", two.double, gen, staleness=oc.Staleness(0, "requeue"))
    async with g.run(ctx) as run:
        run.set_version(3)  # the first generations are stale: made again, newer
        out = [pair async for pair in run.results(learn, versioned=True)]
    assert sorted(v for v, _ in out) == [0, 2, 4, 6, 8, 10]
    assert all(version >= 3 for _, version in out)
    stats = run.stats()["gen->learn"]
    assert stats["requeued"] >= 3 and stats["dropped_stale"] == 0 and stats["delivered"] == 6

    g = oc.Graph("forever_stale")  # made again with the same old version: dropped in the end
    gen = g.map("gen", one.double, g.source("prompts", [oc.Versioned(i, 0) for i in range(3)]))
    g.map("learn", two.double, gen, staleness=oc.Staleness(0, "requeue"))
    async with g.run(ctx) as run:
        run.set_version(1)
        assert await run.collect() == {"learn": []}
    stats = run.stats()["gen->learn"]
    assert (stats["sent"], stats["requeued"], stats["dropped_stale"]) == (12, 9, 3)


def test_an_output_bound_and_version_of_are_checked_and_shown() -> None:
    gens = fake_mesh()
    g = oc.Graph("rl")
    src = g.source("prompts", range(4))
    with pytest.raises(oc.ConfigError, match="version_of is a function"):
        g.map("gen", gens.generate, src, version_of=3)
    gen = g.map("gen", gens.generate, src, version_of=len)
    with pytest.raises(oc.ConfigError, match="output 'prompts': staleness policy 'requeue'"):
        g.output(src, staleness=oc.Staleness(1, "requeue"))
    with pytest.raises(oc.ConfigError, match="staleness is an orchestr.Staleness"):
        g.output(gen, staleness=3)
    g.output(gen, "rollouts", staleness=oc.Staleness(0, "requeue"))
    assert "output rollouts <- gen (staleness eta=0 requeue)" in g.describe()
    assert "version_of len" in g.describe()
    assert g.to_dict()["output_staleness"] == {"rollouts": {"eta": 0, "policy": "requeue"}}
    assert "output rollouts (staleness eta=0 requeue)" in g.to_dot()


@on_cluster
async def test_an_output_bounds_what_its_reader_takes_as_it_reads(cluster: Cluster) -> None:
    ctx, two, one = cluster
    await one.reset.call_one()
    g = oc.Graph("bounded")
    gen = g.map("gen", one.generate, g.source("prompts", range(6)))  # version = call number
    g.output(gen, staleness=oc.Staleness(0, "requeue"))
    async with g.run(ctx) as run:
        run.set_version(3)  # the first generations are stale: made again, newer
        out = [pair async for pair in run.results("gen", versioned=True)]
    assert sorted(v for v, _ in out) == list(range(6))
    assert all(version >= 3 for _, version in out)
    stats = run.stats()["gen->output:gen"]
    assert stats["requeued"] >= 3 and stats["dropped_stale"] == 0 and stats["delivered"] == 6

    # each value is checked as it is read, against the version set by then: values that
    # waited in the output's buffer while the version moved on are dropped
    g = oc.Graph("by_read")
    made = g.map("made", two.step, g.source("xs", range(6)), version_of=lambda r: r[1])
    g.output(made, staleness=oc.Staleness(1, "drop"))
    async with g.run(ctx) as run:
        stream = run.results(made, versioned=True)
        first = await anext(stream)
        await run.wait()  # the rest are made and wait in the output's buffer
        run.set_version(5)
        rest = [pair async for pair in stream]
    assert first[1] == 0 and [v for _, v in rest] == [4, 5]
    assert run.stats()["made->output:made"]["dropped_stale"] == 3

    g = oc.Graph("bad_version")
    g.map("made", two.double, g.source("xs", range(2)), version_of=str)
    # the two results are 0 and 2; the first to arrive fails the graph
    with pytest.raises(oc.ConfigError, match="version_of returned '[02]'; a version is an integer"):
        await g.collect(ctx)


@on_cluster
async def test_a_remote_error_fails_the_graph_with_its_traceback(cluster: Cluster) -> None:
    ctx, two, _ = cluster
    g = oc.Graph("failing")
    g.map("check", two.fail_on, g.source("nums", range(100)))
    with pytest.raises(oc.ActorError, match="item 3 is bad") as info:
        await g.collect(ctx)
    assert "raise ValueError" in info.value.remote_traceback
    assert "(in graph 'failing', node 'check')" in info.value.__notes__
    assert graph_tasks() == []
    g2 = oc.Graph("failing2")
    checked = g2.map("check", two.fail_on, g2.source("nums", range(100)))
    async with g2.run(ctx) as run:  # raised once, from results(), not again at exit
        with pytest.raises(oc.ActorError):
            async for _ in run.results(checked):
                pass
    assert isinstance(run.failed, oc.ActorError) and graph_tasks() == []


@on_cluster
async def test_exit_cancels_an_endless_graph_and_logs_events(cluster: Cluster) -> None:
    ctx, two, _ = cluster
    closed = asyncio.Event()

    async def endless() -> AsyncIterator[int]:
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    g = oc.Graph("endless")
    doubled = g.map("double", two.double, g.source("nums", endless()))
    async with g.run(ctx) as run:
        stream = run.results(doubled, versioned=True)
        got = [v async for v, _ in _take(stream, 5)]
    assert got == [0, 2, 4, 6, 8] and closed.is_set() and graph_tasks() == []
    with pytest.raises(oc.ClosedResourceError, match="stopped before this output ended"):
        await anext(stream)
    events = read_events(ctx.events.path)
    assert any(e["kind"] == "graph" and e["name"] == "endless" for e in events)
    calls = [e for e in events if e["kind"] == "call" and e.get("graph") == "endless"]
    assert calls and calls[0]["track"].startswith("graph endless: double[")


async def _take(stream: AsyncIterator[Any], n: int) -> AsyncIterator[Any]:
    for _ in range(n):
        yield await anext(stream)


@on_cluster
async def test_a_killed_only_member_fails_the_graph(cluster: Cluster) -> None:
    ctx, _, _ = cluster
    victim = await ctx.spawn(Stage, name="victim", supervise="handle")  # the graph handles it
    pid = await victim.pid.call_one()
    g = oc.Graph("doomed")
    work = g.map("work", victim.work, g.source("items", [[i, 0.05] for i in range(50)]), retries=2)
    async with asyncio.timeout(20):
        with pytest.raises(oc.ActorDiedError, match="gave up on an item after 3 attempts") as info:
            async with g.run(ctx) as run:
                async for value, _ in run.results(work):
                    if value == 1:
                        os.kill(pid, signal.SIGKILL)
    assert isinstance(info.value.__cause__, oc.ActorDiedError)
    assert info.value.signal == "SIGKILL"
    assert run.stats()["items->work"]["redelivered"] >= 2
    assert graph_tasks() == []


@on_cluster
async def test_items_of_a_killed_member_go_to_the_survivor_exactly_once(cluster: Cluster) -> None:
    ctx, _, _ = cluster
    pair = await ctx.spawn(Stage, n=2, name="pair", supervise="handle")
    pids = [await m.pid.call_one() for m in pair]
    g = oc.Graph("survivor")
    work = g.map("work", pair.work, g.source("items", [[i, 0.02] for i in range(30)]), capacity=2)
    values: list[int] = []
    ranks: list[int] = []
    async with asyncio.timeout(30), g.run(ctx) as run:
        async for value, rank in run.results(work):
            values.append(value)
            ranks.append(rank)
            if len(values) == 4:
                os.kill(pids[1], signal.SIGKILL)
    assert values == list(range(30))  # ordered, every result exactly once
    assert set(ranks[-15:]) == {0}  # the dead member's items went to the survivor
    stats = run.stats()["items->work"]
    assert stats["redelivered"] >= 1 and stats["delivered"] == 30 and stats["duplicates"] == 0


@on_cluster
async def test_a_restarted_member_gets_its_items_again(cluster: Cluster) -> None:
    ctx, _, _ = cluster
    phoenix = await ctx.spawn(Stage, name="phoenix", restart=oc.RestartPolicy(max_restarts=1))
    pid = await phoenix.pid.call_one()
    g = oc.Graph("restarted")
    work = g.map(
        "work", phoenix.work, g.source("items", [[i, 0.02] for i in range(12)]), retries=10
    )
    values = []
    async with asyncio.timeout(30), g.run(ctx) as run:
        async for value, _ in run.results(work):
            values.append(value)
            if value == 2:
                os.kill(pid, signal.SIGKILL)
    assert values == list(range(12))
    assert run.stats()["items->work"]["redelivered"] >= 1
    assert await phoenix.pid.call_one() != pid


@on_cluster
async def test_ten_thousand_items_through_a_consumer_killed_three_times(cluster: Cluster) -> None:
    """At-least-once delivery with de-duplication: the consumer's worker is SIGKILLed three
    times mid-stream and restarted; every item's result arrives exactly once, in order."""
    ctx, _, _ = cluster
    policy = oc.RestartPolicy(max_restarts=3, backoff_s=0.02)
    consumer = await ctx.spawn(Stage, name="consumer", restart=policy)
    g = oc.Graph("exactly-once")
    items = g.source("items", range(10_000), capacity=64)
    doubled = g.map("double", consumer.double, items, ordered=True, retries=20, capacity=64)
    results: list[int] = []
    kills: list[int] = []
    async with asyncio.timeout(120), g.run(ctx) as run:
        async for value in run.results(doubled):
            results.append(value)
            if len(results) in (2_500, 5_000, 7_500):
                os.kill(await consumer.pid.call_one(), signal.SIGKILL)
                kills.append(len(results))
    assert kills == [2_500, 5_000, 7_500]
    assert results == [2 * i for i in range(10_000)]  # each once, in order
    stats = run.stats()["items->double"]
    assert stats["delivered"] == 10_000 and stats["redelivered"] >= 1
    assert [a.restarts for a in await ctx.actors() if a.name == "consumer"] == [3]


@on_cluster
async def test_random_kills_of_a_running_graph(cluster: Cluster) -> None:
    """Members of two stages die by SIGKILL or a SIGSEGV at random points while a graph runs;
    they are restarted and the graph finishes with every result once and in order."""
    ctx, _, _ = cluster
    rng = random.Random(11)
    policy = oc.RestartPolicy(max_restarts=8, backoff_s=0.02)
    first = await ctx.spawn(Stage, n=2, name="first", restart=policy)
    second = await ctx.spawn(Stage, n=2, name="second", restart=policy)
    g = oc.Graph("chaos")
    doubled = g.map("double", first.double, g.source("items", range(2_000)), retries=30)
    quadrupled = g.map("again", second.double, doubled, retries=30)
    results: list[int] = []
    kills = 0
    async with asyncio.timeout(90), g.run(ctx) as run:
        async for value in run.results(quadrupled):
            results.append(value)
            if len(results) % 400 == 200:
                victim = rng.choice([first, second])[rng.randrange(2)]
                with contextlib.suppress(oc.ActorDiedError):
                    pid = await victim.pid.call_one()
                    os.kill(pid, rng.choice([signal.SIGKILL, signal.SIGSEGV]))
                    kills += 1
    assert results == [4 * i for i in range(2_000)]
    assert kills >= 4
    async with asyncio.timeout(20):  # the last kill may land after the last item
        while True:
            actors = [a for a in await ctx.actors() if a.name in ("first", "second")]
            if sum(a.restarts for a in actors) == kills and {a.state for a in actors} == {"alive"}:
                break
            await asyncio.sleep(0.05)
