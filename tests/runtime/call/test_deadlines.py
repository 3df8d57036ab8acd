"""A call's deadline holds on the actor's side too: a call reaching an actor after its caller
gave up (the worker was stopped with SIGSTOP meanwhile) is dropped, not run; one running past
it is cancelled when its endpoint is cancel_safe, and runs to its end otherwise. A stopped
worker is reported as suspended while it is stopped."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

import orchestr as oc
from tests.runtime.actors import Slow


async def test_calls_that_timed_out_while_the_worker_was_stopped_never_run(
    ctx: oc.JobContext,
) -> None:
    slow = await ctx.spawn(Slow)
    pid = await slow.pid.call_one()
    os.kill(pid, signal.SIGSTOP)
    try:
        calls = [slow.mark.options(timeout=0.5).call_one(f"late-{i}") for i in range(3)]
        for call in calls:
            with pytest.raises(oc.CallTimeoutError, match="drops it if it had not started"):
                await call
    finally:
        os.kill(pid, signal.SIGCONT)
    await slow.mark.call_one("after")
    assert await slow.seen.call_one() == ["after"]


async def test_a_cancel_safe_call_is_cancelled_at_its_deadline(ctx: oc.JobContext) -> None:
    slow = await ctx.spawn(Slow)
    with pytest.raises(oc.CallTimeoutError):
        await slow.wait_then_mark.options(timeout=0.3).call_one(1.0, "cancelled")
    with pytest.raises(oc.CallTimeoutError):
        await slow.wait_then_mark_to_the_end.options(timeout=0.3).call_one(1.0, "finished")
    await asyncio.sleep(1.5)
    assert await slow.seen.call_one() == ["finished"]


def test_cancel_safe_needs_an_async_endpoint() -> None:
    with pytest.raises(TypeError, match="needs an async endpoint"):

        class Bad(oc.Actor):
            @oc.endpoint(cancel_safe=True)
            def f(self) -> None: ...


async def _suspended(ctx: oc.JobContext, actor_id: str, want: bool) -> None:
    """Wait (a few heartbeats at most) until the head reports ``actor_id`` as ``want``."""
    async with asyncio.timeout(15):
        while True:
            info = next(a for a in await ctx.actors() if a.actor_id == actor_id)
            if info.suspended == want:
                assert info.state == "alive"  # stopped is not dead: nothing is restarted
                return
            await asyncio.sleep(0.2)


async def test_a_stopped_worker_is_reported_suspended_until_it_continues(
    ctx: oc.JobContext,
) -> None:
    slow = await ctx.spawn(Slow)
    actor_id = slow.members[0].actor_id
    pid = await slow.pid.call_one()
    await _suspended(ctx, actor_id, False)
    os.kill(pid, signal.SIGSTOP)
    try:
        await _suspended(ctx, actor_id, True)
    finally:
        os.kill(pid, signal.SIGCONT)
    await _suspended(ctx, actor_id, False)
    await slow.mark.call_one("after")
