"""The owner of background tasks: it holds what it starts, and its close cancels and awaits
what is left, raising none of their errors."""

from __future__ import annotations

import asyncio
import inspect

import pytest

import orchestr as oc
from orchestr.tasks import TaskOwner


async def test_a_task_is_held_until_it_ends_and_its_result_is_the_starters() -> None:
    owner = TaskOwner()
    task = owner.start(asyncio.sleep(0, "done"), name="one")
    assert task.get_name() == "one" and list(owner) == [task] and len(owner) == 1
    assert await task == "done"
    await asyncio.sleep(0)  # the done callback runs
    assert len(owner) == 0
    await owner.aclose()


async def test_close_cancels_and_awaits_what_is_left_and_raises_none_of_their_errors() -> None:
    async def fails() -> None:
        raise ValueError("a failure the starter reads")

    async def cleans_up(log: list[str]) -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.01)  # a clean-up that awaits
            log.append("cleaned")
            raise RuntimeError("raised while cancelled")

    log: list[str] = []
    async with TaskOwner() as owner:
        failed = owner.start(fails())
        await asyncio.sleep(0)
        slow = owner.start(cleans_up(log))
        waiting = owner.start(asyncio.Event().wait())
        await asyncio.sleep(0)
    assert log == ["cleaned"] and slow.done() and waiting.cancelled()
    assert isinstance(failed.exception(), ValueError)  # left to the starter
    assert owner.closed and len(owner) == 0
    await owner.aclose()  # idempotent


async def test_a_task_being_cancelled_is_not_cancelled_again() -> None:
    ended = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.02)  # a second cancel would cut this short
            ended.set()

    owner = TaskOwner()
    task = owner.start(slow_to_stop())
    await asyncio.sleep(0)
    task.cancel()
    await owner.aclose()
    assert ended.is_set() and task.cancelled()


async def test_a_task_started_while_closing_is_cancelled_too() -> None:
    owner = TaskOwner()
    late: list[asyncio.Task[None]] = []

    async def starts_another() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            late.append(owner.start(asyncio.sleep(60)))

    owner.start(starts_another())
    await asyncio.sleep(0)
    await owner.aclose()
    assert late and late[0].cancelled() and len(owner) == 0


async def test_any_awaitable_runs_and_a_closed_owner_refuses_to_start() -> None:
    owner = TaskOwner()
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = owner.start(future)
    future.set_result(3)
    assert await task == 3
    await owner.aclose()
    coro = asyncio.sleep(0)
    with pytest.raises(oc.ClosedResourceError, match="was not started"):
        owner.start(coro, name="late")
    # closed unrun: no "never awaited" warning
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
