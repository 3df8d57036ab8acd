"""Supervision: restart policies, retry semantics, save/restore, hooks and the root policy,
with workers killed for real (SIGKILL, and a segmentation fault in native code)."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest

import orchestr as oc
from orchestr._cluster._node import NodeService
from orchestr._job._events import read_events
from orchestr._job._paths import worker_pythonpath
from tests.cluster import open_cluster
from tests.runtime.supervised import BadRestore, Caller, Keeper

AT_LEAST_ONCE = oc.RestartPolicy(max_restarts=3, backoff_s=0.05, retry="at_least_once")


async def _restarts(ctx: oc.JobContext, name: str) -> list[int]:
    return [a.restarts for a in await ctx.actors() if a.name == name]


async def _wait_alive(ctx: oc.JobContext, name: str, restarts: int) -> None:
    while True:
        actors = [a for a in await ctx.actors() if a.name == name]
        if all(a.state == "alive" for a in actors) and sum(a.restarts for a in actors) >= restarts:
            return
        await asyncio.sleep(0.05)


async def test_a_killed_actor_is_recreated_with_the_same_arguments(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Keeper, 7, tag="t", n=2, name="keep", restart=AT_LEAST_ONCE)
    before = await mesh.whoami.call()
    os.kill(before[1]["pid"], signal.SIGKILL)
    async with asyncio.timeout(20):
        await _wait_alive(ctx, "keep", 1)
    after = await mesh.whoami.call()
    assert after[0] == before[0]  # the survivor was untouched
    assert after[1]["pid"] != before[1]["pid"]
    assert (after[1]["seed"], after[1]["tag"], after[1]["rank"]) == (7, "t", 1)
    assert await _restarts(ctx, "keep") == [0, 1]
    kinds = [e["kind"] for e in read_events(os.path.join(ctx.session_dir, "events.jsonl"))]
    assert "actor_died" in kinds and "restart" in kinds


async def test_at_least_once_sends_calls_in_flight_again(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Keeper, 1, name="alo", restart=AT_LEAST_ONCE)
    pid = (await mesh.whoami.call_one())["pid"]
    calls = [mesh.slow_square.call_one(x, 1.0) for x in range(5)]
    await asyncio.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    async with asyncio.timeout(30):
        assert await asyncio.gather(*calls) == [x * x for x in range(5)]
    assert (await mesh.whoami.call_one())["pid"] != pid


async def test_at_most_once_fails_calls_in_flight_then_serves(ctx: oc.JobContext) -> None:
    policy = oc.RestartPolicy(max_restarts=1, backoff_s=0.05)
    mesh = await ctx.spawn(Keeper, 1, name="amo", restart=policy)
    pid = (await mesh.whoami.call_one())["pid"]
    call = mesh.slow_square.call_one(3, 5.0)
    await asyncio.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    async with asyncio.timeout(10):
        with pytest.raises(oc.ActorDiedError, match="SIGKILL") as info:
            await call
    assert "at-most-once" in str(info.value) or "being restarted" in str(info.value)
    async with asyncio.timeout(20):
        await _wait_alive(ctx, "amo", 1)
        assert await mesh.square.call_one(4) == 16


async def test_saved_state_is_restored_after_a_restart(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Keeper, 0, name="stateful", restart=AT_LEAST_ONCE)
    for n in (1, 2, 3):
        await mesh.add.call_one(n)
    assert await ctx.checkpoint(mesh) == 1
    await mesh.add.call_one(100)  # after the checkpoint: lost with the worker
    os.kill((await mesh.whoami.call_one())["pid"], signal.SIGKILL)
    async with asyncio.timeout(20):
        await _wait_alive(ctx, "stateful", 1)
    assert await mesh.restored_from.call_one() == {"total": 6}
    assert await mesh.add.call_one(1) == 7


async def test_periodic_checkpoints(ctx: oc.JobContext) -> None:
    policy = oc.RestartPolicy(max_restarts=1, backoff_s=0.05, checkpoint_s=0.1)
    mesh = await ctx.spawn(Keeper, 0, name="periodic", restart=policy)
    await mesh.add.call_one(5)
    await asyncio.sleep(0.5)  # a few checkpoints have run
    os.kill((await mesh.whoami.call_one())["pid"], signal.SIGKILL)
    async with asyncio.timeout(20):
        await _wait_alive(ctx, "periodic", 1)
    assert await mesh.restored_from.call_one() == {"total": 5}


async def test_checkpoint_needs_save_state(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Caller)
    with pytest.raises(oc.ConfigError, match="defines no save_state"):
        await ctx.checkpoint(mesh)


async def test_another_actor_reaches_the_restarted_incarnation(ctx: oc.JobContext) -> None:
    target = await ctx.spawn(Keeper, 1, name="target", restart=AT_LEAST_ONCE)
    caller = await ctx.spawn(Caller)
    assert await caller.call_square.call_one(target, 3) == 9  # the caller's connection is open
    os.kill((await target.whoami.call_one())["pid"], signal.SIGKILL)
    async with asyncio.timeout(20):
        await _wait_alive(ctx, "target", 1)
        # the handle the caller gets is the updated one; an old one would be found too
        assert await caller.call_square.call_one(target, 4) == 16


async def test_a_handled_death_leaves_the_survivors_usable(ctx: oc.JobContext) -> None:
    seen: list[oc.Failure] = []

    def hook(failure: oc.Failure) -> str:
        seen.append(failure)
        return "handle"

    mesh = await ctx.spawn(Keeper, 1, n=3, name="trio", supervise=hook)
    pids = [w["pid"] for w in await mesh.whoami.call()]
    os.kill(pids[1], signal.SIGKILL)
    async with asyncio.timeout(5):
        with pytest.raises(oc.ActorDiedError, match=r"trio\[1\].*SIGKILL"):
            await mesh[1].square.call_one(2)
        while not seen:  # noqa: ASYNC110 (the hook runs on the supervisor's task)
            await asyncio.sleep(0.02)
    assert [await mesh[r].square.call_one(r) for r in (0, 2)] == [0, 4]
    assert seen[0].rank == 1 and seen[0].error.signal == "SIGKILL" and not seen[0].can_restart
    states = {a.rank: a.state for a in await ctx.actors() if a.name == "trio"}
    assert states == {0: "alive", 1: "dead", 2: "alive"}


async def test_the_root_fails_the_job_with_the_remote_fatal_error() -> None:
    reached = False
    with pytest.raises(oc.SupervisionError) as info:
        async with asyncio.timeout(30), open_cluster() as ctx:
            mesh = await ctx.spawn(Keeper, 1, name="fragile")
            mesh.crash.broadcast()
            await asyncio.sleep(25)  # the job is cancelled long before this ends
            reached = True
    assert not reached
    text = str(info.value)
    assert "fragile[0]" in text and "SIGSEGV" in text
    assert "Fatal Python error" in text and "crash" in text  # the worker's stack dump
    assert "restart=orchestr.RestartPolicy" in text  # says what to do
    assert info.value.signal == "SIGSEGV"


async def test_restarts_run_out_then_the_job_fails() -> None:
    policy = oc.RestartPolicy(max_restarts=1, backoff_s=0.05)
    with pytest.raises(oc.SupervisionError, match=r"(?s)exited with code 9.*max_restarts=1"):
        async with asyncio.timeout(30), open_cluster() as ctx:
            mesh = await ctx.spawn(Keeper, 1, name="twice", restart=policy, supervise=None)
            for _ in range(2):
                mesh.exit_hard.broadcast(9)
                await _wait_alive(ctx, "twice", 1)
            await asyncio.sleep(25)


async def test_hook_escalation_and_hook_errors_fail_the_job() -> None:
    with pytest.raises(oc.SupervisionError, match="the supervise hook escalated it"):
        async with asyncio.timeout(30), open_cluster() as ctx:
            mesh = await ctx.spawn(Keeper, 1, restart=AT_LEAST_ONCE, supervise="escalate")
            mesh.exit_hard.broadcast(1)
            await asyncio.sleep(25)

    def broken(failure: oc.Failure) -> str:
        raise KeyError("no plan for this")

    with pytest.raises(oc.SupervisionError, match="hook of Keeper raised KeyError"):
        async with asyncio.timeout(30), open_cluster() as ctx:
            mesh = await ctx.spawn(Keeper, 1, supervise=broken)
            mesh.exit_hard.broadcast(1)
            await asyncio.sleep(25)


async def test_a_restart_that_cannot_restore_fails_loudly() -> None:
    policy = oc.RestartPolicy(max_restarts=2, backoff_s=0.05)
    with pytest.raises(oc.SupervisionError, match="load_state raised RuntimeError") as info:
        async with asyncio.timeout(30), open_cluster() as ctx:
            mesh = await ctx.spawn(BadRestore, restart=policy)
            await ctx.checkpoint(mesh)
            os.kill(await mesh.pid.call_one(), signal.SIGKILL)
            await asyncio.sleep(25)
    assert "restarting BadRestore[0] failed" in str(info.value)


def test_policy_and_hook_validation() -> None:
    with pytest.raises(oc.ConfigError, match="max_restarts"):
        oc.RestartPolicy(max_restarts=-1)
    with pytest.raises(oc.ConfigError, match="retry must be"):
        oc.RestartPolicy(retry="exactly_once")
    with pytest.raises(oc.ConfigError, match="backoff_s"):
        oc.RestartPolicy(backoff_s=-1)
    with pytest.raises(oc.ConfigError, match="checkpoint_s"):
        oc.RestartPolicy(checkpoint_s=0)
    assert oc.RestartPolicy(backoff_s=0.1, backoff_max_s=0.3).backoff(5) == 0.3


async def test_spawn_rejects_bad_supervision_arguments(ctx: oc.JobContext) -> None:
    with pytest.raises(oc.ConfigError, match="supervise must be one of"):
        await ctx.spawn(Keeper, 1, supervise="ignore")
    with pytest.raises(oc.ConfigError, match="restart must be an orchestr.RestartPolicy"):
        await ctx.spawn(Keeper, 1, restart={"max_restarts": 1})


async def test_random_kills_during_a_stream_of_calls(ctx: oc.JobContext) -> None:
    """Workers die by SIGKILL or SIGSEGV at random points while calls stream to them; every
    call still returns the right result (at-least-once, idempotent endpoint), none hangs."""
    rng = random.Random(4)
    policy = oc.RestartPolicy(max_restarts=10, backoff_s=0.02, retry="at_least_once")
    mesh = await ctx.spawn(Keeper, 1, n=3, name="chaos", restart=policy)
    stop = asyncio.Event()

    async def killer() -> int:
        kills = 0
        while not stop.is_set() and kills < 4:
            await asyncio.sleep(rng.uniform(0.1, 0.4))
            rank = rng.randrange(3)
            try:
                pid = (await mesh[rank].whoami.call_one())["pid"]
            except oc.ActorDiedError:
                continue
            os.kill(pid, rng.choice([signal.SIGKILL, signal.SIGSEGV]))
            kills += 1
        return kills

    killing = asyncio.ensure_future(killer())
    results = []
    async with asyncio.timeout(45):
        for start in range(0, 600, 30):
            batch = [mesh[x % 3].slow_square.call_one(x, 0.01) for x in range(start, start + 30)]
            results += await asyncio.gather(*batch)
        stop.set()
        kills = await killing
    assert results == [x * x for x in range(600)]
    assert kills >= 1 and sum(await _restarts(ctx, "chaos")) >= 1


async def test_members_sharing_a_process_live_and_die_together(ctx: oc.JobContext) -> None:
    policy = oc.RestartPolicy(max_restarts=1, backoff_s=0.02, retry="at_least_once")
    mesh = await ctx.spawn(Keeper, 3, n=6, name="packed", per_process=3, restart=policy)
    who = await mesh.whoami.call()
    pids = [w["pid"] for w in who]
    assert pids[:3] == [pids[0]] * 3 and pids[3:] == [pids[3]] * 3 and pids[0] != pids[3]
    assert [w["rank"] for w in who] == list(range(6)) and {w["seed"] for w in who} == {3}
    assert await mesh.add.call(2) == [2] * 6  # each member is its own actor, with its state
    os.kill(pids[0], signal.SIGKILL)
    async with asyncio.timeout(30):
        await _wait_alive(ctx, "packed", 3)
    after = [w["pid"] for w in await mesh.whoami.call()]
    assert after[3:] == pids[3:]  # the other process was untouched
    assert len(set(after[:3])) == 3 and pids[0] not in after  # a process each after restart
    assert await _restarts(ctx, "packed") == [1, 1, 1, 0, 0, 0]
    with pytest.raises(oc.ConfigError, match="per_process must be a positive integer"):
        await ctx.spawn(Keeper, 1, per_process=0)


async def test_a_restart_goes_to_another_node_when_its_own_is_full() -> None:
    async with (
        asyncio.timeout(60),
        open_cluster(resources={"cpu": 1}, labels={"host": "a"}) as ctx,
        NodeService(
            ctx.head_address,
            ctx.token,
            ctx.config,
            resources={"cpu": 1},
            labels={"host": "b"},
            worker_env={"PYTHONPATH": worker_pythonpath()},
        ) as second,
    ):
        blocker = await ctx.spawn(
            Caller, name="blocker", resources={"cpu": 1}, labels={"host": "b"}
        )

        async def make_room_elsewhere(failure: oc.Failure) -> str:
            # The dead actor's node fills up; the other node frees: the restart must move.
            await ctx.stop(blocker)
            await ctx.spawn(Caller, name="filler", resources={"cpu": 1}, labels={"host": "a"})
            return "restart"

        policy = oc.RestartPolicy(max_restarts=1, backoff_s=0.01)
        mover = await ctx.spawn(
            Keeper,
            5,
            name="mover",
            resources={"cpu": 1},
            restart=policy,
            supervise=make_room_elsewhere,
        )
        before = {a.name: a.node_id for a in await ctx.actors()}
        assert before["mover"] != second.node_id
        os.kill((await mover.whoami.call_one())["pid"], signal.SIGKILL)
        await _wait_alive(ctx, "mover", 1)
        after = {a.name: a.node_id for a in await ctx.actors() if a.state == "alive"}
        assert after["mover"] == second.node_id
        assert (await mover.whoami.call_one())["seed"] == 5
