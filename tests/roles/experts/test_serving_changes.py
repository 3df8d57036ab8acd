"""Expert hosts changing under a serving generator: a new placement applied while requests
decode (their tokens unchanged), a host killed whose experts have replicas elsewhere, and one
whose experts have none (the step fails naming the expert, or waits for the restarted host)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import orchestr as oc
from orchestr.roles import Completion, ExpertHost, Generator, Request, models
from orchestr.roles.experts import rebalance_serving
from orchestr.roles.generator._engines._paged import PagedEngine
from tests.roles.experts.test_hosts import folder
from tests.roles.generator.test_handoff import close
from tests.roles.generator.test_paged_engine import drain, scrape, series

__all__ = ["folder"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(240)

HALVES = [{0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, {0: [4, 5, 6, 7], 1: [4, 5, 6, 7]}]
ALL = {0: list(range(8)), 1: list(range(8))}


def requests(n: int, tokens: int, salt: int = 0) -> list[Request]:
    return [
        Request(
            f"r{salt}-{i}",
            [(13 * j + 5 * i + salt) % 380 + 5 for j in range(9 + 7 * i)],
            tokens,
            temperature=0.0,
            ignore_eos=True,
        )
        for i in range(n)
    ]


def reference(folder: pathlib.Path, reqs: list[Request]) -> dict[str, Completion]:
    """The model in one process, run to the end (seconds: the tests call it in a thread, so
    the embedded head and node on their loop keep their heartbeats meanwhile)."""
    alone = PagedEngine(models.load_model(folder), num_blocks=96, block_size=16, model_id="m")
    alone.submit(reqs)
    return drain(alone)


async def generator(
    ctx: oc.JobContext, folder: pathlib.Path, hosts: oc.Mesh, options: Any = None, **kw: Any
) -> oc.Mesh:
    return await ctx.spawn(
        Generator,
        checkpoint=str(folder),
        torch_threads=1,
        experts={"hosts": hosts, **(options or {})},
        kv={"num_blocks": 96, "block_size": 16},
        supervise="handle",
        **kw,
    )


async def streamed(
    gen: oc.Mesh, reqs: list[Request], during: Callable[[], Awaitable[Any]]
) -> tuple[dict[str, list[int]], int, Any]:
    """Each request's tokens, how many arrived after ``during`` (awaited once every request
    has a token) returned, and what it returned."""
    await gen.submit.call_one(reqs, stream="s")
    tokens: dict[str, list[int]] = {r.id: [] for r in reqs}
    done: set[str] = set()
    after, result, ran = 0, None, False
    while len(done) < len(reqs):
        u = await gen.updates.call_one("s", timeout_s=30)
        for d in u.deltas:
            tokens[d.id] += d.tokens
            after += len(d.tokens) if ran else 0
            if d.finish_reason is not None:
                done.add(d.id)
        if not ran and all(tokens.values()):
            result, ran = await during(), True
    return tokens, after, result


async def pid_of(ctx: oc.JobContext, mesh: oc.Mesh, rank: int) -> int:
    return next(a.pid for a in await ctx.actors() if a.name == mesh.name and a.rank == rank)


async def test_a_new_placement_is_applied_while_requests_decode(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    hosts = await ctx.spawn(ExpertHost, str(folder), n=2, placement=HALVES, torch_threads=1)
    gen = await generator(ctx, folder, hosts)
    warm = requests(3, 20, salt=1)
    await gen.generate.call_one(warm)  # the load window fills
    reqs = requests(4, 400)
    tokens, after, report = await streamed(
        gen, reqs, lambda: rebalance_serving(hosts, gen, num_replicas=12)
    )
    want = await asyncio.to_thread(reference, folder, reqs)
    assert all(tokens[r.id] == want[r.id].tokens for r in reqs)
    assert after > 0  # requests decoded on both sides of the switch
    assert report["experts_moved"] > 0 and report["experts_dropped"] >= 0
    assert report["balancedness_after"] >= report["balancedness_before"]
    hosted = await hosts.hosted.call()
    assert sum(len(h[0]) for h in hosted) == 12  # 12 replicas of layer 0, 6 on each host
    stats = await gen.stats.call_one()
    holders = stats["experts"]["holders"]
    assert [sorted(e for e in range(8) if h in holders[0][e]) for h in (0, 1)] == [
        h[0] for h in hosted
    ]
    assert stats["experts"]["lost_hosts"] == 0


async def test_a_dead_hosts_experts_run_on_their_replicas(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    hosts = await ctx.spawn(
        ExpertHost, str(folder), n=2, placement=[ALL, ALL], torch_threads=1, supervise="handle"
    )
    gen = await generator(ctx, folder, hosts)
    reqs = requests(3, 300, salt=2)
    pid = await pid_of(ctx, hosts, 0)
    tokens, after, _ = await streamed(
        gen, reqs, lambda: asyncio.to_thread(os.kill, pid, signal.SIGKILL)
    )
    want = await asyncio.to_thread(reference, folder, reqs)
    assert all(tokens[r.id] == want[r.id].tokens for r in reqs)
    stats = (await gen.stats.call_one())["experts"]
    assert after > 0 and stats["lost_hosts"] >= 1 and stats["resent_pairs"] > 0
    assert all(holders == [1] for row in stats["holders"].values() for holders in row)
    # the routing in the head's /metrics
    text = await asyncio.to_thread(scrape, ctx.metrics_address)
    engine = 'engine="Generator[0]"'
    assert series(text, f"orchestr:expert_hosts_lost_total{{{engine}}}") == stats["lost_hosts"]
    assert series(text, f"orchestr:expert_pairs_resent_total{{{engine}}}") == stats["resent_pairs"]
    routed = sum(
        series(text, f'orchestr:expert_tokens_total{{{engine},expert="{e}",layer="0"}}')
        for e in range(8)
        if f'expert="{e}",layer="0"' in text
    )
    prompts = sum(len(r.prompt) for r in reqs)
    assert routed == 2 * (prompts + 3 * 299)  # top 2 of every prompt token and decode input
    window = [
        series(text, f'orchestr:expert_load{{{engine},expert="{e}",layer="1"}}') for e in range(8)
    ]
    assert window == stats["load"][1]
    assert series(text, f'orchestr:expert_balancedness{{{engine},layer="1"}}') == 1.0  # one host


async def test_an_expert_without_replicas_fails_or_waits_for_a_host(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    hosts = await ctx.spawn(
        ExpertHost, str(folder), n=2, placement=HALVES, torch_threads=1, supervise="handle"
    )
    strict, patient = await asyncio.gather(
        generator(ctx, folder, hosts, name="strict"),
        generator(ctx, folder, hosts, name="patient", options={"on_lost": "wait", "poll_s": 0.1}),
    )
    reqs = requests(2, 8, salt=3)
    await asyncio.gather(strict.generate.call_one(reqs), patient.generate.call_one(reqs))
    os.kill(await pid_of(ctx, hosts, 0), signal.SIGKILL)
    again = requests(2, 30, salt=4)
    waiting = asyncio.ensure_future(patient.generate.call_one(again))
    with pytest.raises(oc.ActorError, match="no live expert host holds expert [0-3] of layer"):
        await strict.generate.call_one(again)
    assert not waiting.done()
    await hosts[1].load.call_one(HALVES[0])  # a replacement: host 1 now holds every expert
    want = await asyncio.to_thread(reference, folder, again)
    for c in await waiting:
        close(c, want[c.id])
    assert (await patient.stats.call_one())["experts"]["lost_hosts"] >= 1


async def test_a_restarted_host_comes_back_with_its_experts(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    hosts = await ctx.spawn(
        ExpertHost,
        str(folder),
        n=2,
        placement=HALVES,
        torch_threads=1,
        restart=oc.RestartPolicy(max_restarts=1, backoff_s=0.2),
    )
    gen = await generator(ctx, folder, hosts)
    await hosts[0].drop.call_one({1: [3]})
    await hosts[1].load.call_one({1: [3]})
    await ctx.checkpoint(hosts)  # what each holds now is what a restart brings back
    await gen.route_experts.call_one()
    os.kill(await pid_of(ctx, hosts, 0), signal.SIGKILL)
    reqs = requests(2, 30, salt=5)
    got = await gen.generate.call_one(reqs)  # calls wait for the restarted host
    want = await asyncio.to_thread(reference, folder, reqs)
    assert all(c.tokens == want[c.id].tokens for c in got)
    assert await hosts[0].hosted.call_one() == {0: [0, 1, 2, 3], 1: [0, 1, 2]}
