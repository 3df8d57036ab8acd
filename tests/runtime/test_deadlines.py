"""A call's deadline holds on the actor's side too: a call reaching an actor after its caller
gave up (the worker was stopped with SIGSTOP meanwhile) is dropped, not run; one running past
it is cancelled when its endpoint is cancel_safe, and runs to its end otherwise."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

import orchestr as oc

from .actors import Slow


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
