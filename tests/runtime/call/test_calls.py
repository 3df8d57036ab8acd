"""The call modes, ordering, deadlines and errors, against real worker processes."""

from __future__ import annotations

import asyncio

import pytest

import orchestr as oc
from tests.cluster import open_cluster
from tests.runtime.actors import Caller, Counter


async def test_call_gathers_every_member_in_rank_order(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Counter, 10, n=3)
    assert await mesh.add.call(1) == [11, 11, 11]
    ranks = [w["rank"] for w in await mesh.whoami.call()]
    assert ranks == [0, 1, 2]
    assert len({w["pid"] for w in await mesh.whoami.call()}) == 3


async def test_call_one_needs_exactly_one_member(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Counter, n=2)
    assert await mesh[1].add.call_one(5) == 5
    with pytest.raises(oc.MeshError, match="exactly one actor.*has 2"):
        mesh.add.call_one(1)


async def test_indexing_and_slicing(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Counter, n=4, name="counters")
    assert [m.rank for m in mesh[1:3].members] == [1, 2]
    assert (await mesh[-1].whoami.call_one())["rank"] == 3
    assert [w["rank"] for w in await mesh[::2].whoami.call()] == [0, 2]
    assert (await mesh[2].whoami.call_one())["mesh"] == "counters"
    with pytest.raises(IndexError, match="has 4 members"):
        mesh[4]
    with pytest.raises(AttributeError, match="no endpoint 'nope'.*add"):
        mesh.nope  # noqa: B018


async def test_choose_prefers_the_least_loaded_member(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Counter, n=2)
    busy = [mesh[0].sleep.call_one(0.5) for _ in range(3)]
    picked = [await mesh.sleep.choose(0) for _ in range(4)]
    assert picked == [1, 1, 1, 1]
    await asyncio.gather(*busy)


async def test_stream_yields_in_completion_order(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Counter, n=3)
    # An ordered call blocks each member's mailbox for a different time (rank 0 longest), so
    # the streamed call that queues behind it finishes in reverse rank order.
    blockers = [mesh[r].sleep.call_one(d) for r, d in enumerate([0.6, 0.3, 0.0])]
    results = [rank async for rank in mesh.sleep.stream(0.0)]
    assert results == [2, 1, 0]
    await asyncio.gather(*blockers)


async def test_broadcast_is_fire_and_forget(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Counter, n=3)
    assert mesh.add.broadcast(7) is None
    # messages from one caller are processed in order, so a later call sees the broadcast
    assert await mesh.get.call() == [7, 7, 7]


async def test_handles_travel_to_other_actors(ctx: oc.JobContext) -> None:
    counters = await ctx.spawn(Counter, n=3)
    caller = await ctx.spawn(Caller)
    assert await caller.sum_of.call_one(counters[1:], 2) == 4
    back = await caller.forward.call_one(counters)
    assert back == counters
    assert await back[0].get.call_one() == 0


async def test_one_callers_messages_run_in_order(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Counter)
    # later calls are faster: a runtime that ran them concurrently would reorder them
    calls = [mesh.record.call_one(i, 0.002 * (50 - i) / 50) for i in range(50)]
    assert await asyncio.gather(*calls) == list(range(50))
    assert await mesh.seen_order.call_one() == list(range(50))


async def test_concurrent_endpoints_overlap(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Counter)
    results = await asyncio.gather(*(mesh.overlap.call_one(0.3) for _ in range(3)))
    assert max(results) == 3
    assert await asyncio.gather(*(mesh.blocking.call_one(0.2) for _ in range(2))) == [
        "done",
        "done",
    ]


async def test_sync_and_async_endpoints_and_uvloop(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Counter)
    assert await mesh.add.call_one(2) == 2
    assert await mesh.sleep.call_one(0.01) == 0
    assert (await mesh.loop_kind.call_one()).startswith("uvloop")


async def test_deadline_names_actor_endpoint_and_deadline(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Counter, name="slowpoke")
    with pytest.raises(oc.CallTimeoutError) as info:
        await mesh.sleep.options(timeout=0.2).call_one(30)
    message = str(info.value)
    assert "slowpoke[0].sleep" in message and "0.2 s" in message
    assert isinstance(info.value, TimeoutError)


async def test_default_deadline_comes_from_config() -> None:
    config = oc.load_config(call_timeout=0.3)
    async with open_cluster(config) as ctx:
        mesh = await ctx.spawn(Counter)
        with pytest.raises(oc.CallTimeoutError, match="0.3 s"):
            await mesh.sleep.call_one(30)


async def test_remote_exception_arrives_as_actor_error(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Counter, name="c")
    with pytest.raises(oc.ActorError) as info:
        await mesh.fail.call_one("bad input 42")
    err = info.value
    assert err.remote_type == "ValueError"
    assert err.remote_message == "bad input 42"
    assert "in fail" in err.remote_traceback and "raise ValueError(message)" in err.remote_traceback
    assert err.actor == "c[0]" and err.endpoint == "fail"
    # the actor keeps serving
    assert await mesh.add.call_one(1) == 1


async def test_wrong_argument_count_is_a_clear_error(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Counter)
    with pytest.raises(oc.ActorError, match=r"add\(n: int\) -> int: too many positional arguments"):
        await mesh.add.call_one(1, 2)
    with pytest.raises(oc.ActorError, match="missing a required argument: 'n'"):
        await mesh.add.call_one(m=1)
    assert await mesh.add.call_one(3) == 3


async def test_unknown_endpoint_on_the_wire_is_a_clear_error(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Counter, name="k")
    member = mesh.members[0]
    with pytest.raises(oc.ActorError, match="k\\[0\\] has no endpoint 'missing'; endpoints: add"):
        await ctx.client.call(member.address, member.actor_id, "k[0]", "missing", (), {})
    with pytest.raises(oc.ActorError, match="no actor 'a-nobody'"):
        await ctx.client.call(member.address, "a-nobody", "x", "add", (1,), {})
    assert await mesh.add.call_one(1) == 1


async def test_worker_logs_are_json_lines_with_bound_context(ctx: oc.JobContext) -> None:
    import json
    import pathlib

    mesh = await ctx.spawn(Counter, name="logged")
    with pytest.raises(oc.ActorError):
        await mesh.fail.call_one("for the log")
    await asyncio.sleep(0.2)  # the worker writes its log line after replying
    logs = list((pathlib.Path(ctx.session_dir) / "logs").glob("*.jsonl"))
    events = [json.loads(line) for f in logs for line in f.read_text().splitlines()]
    raised = [e for e in events if e["event"] == "call raised"]
    assert raised, events
    assert {"node", "worker", "actor", "job", "call"} <= set(raised[0])
    assert raised[0]["actor"] == "logged[0]" and raised[0]["job"] == ctx.job_id


async def test_a_cancellation_escaping_an_endpoint_fails_only_that_call(
    ctx: oc.JobContext,
) -> None:
    from tests.runtime.actors import CancelsItself

    mesh = await ctx.spawn(CancelsItself)
    with pytest.raises(oc.ActorError, match="cancelled from inside"):
        await mesh.inner_cancel.call_one()
    assert await mesh.ping.call_one() == "pong"
