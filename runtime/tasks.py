"""Owning background tasks: every task orchestr starts has an owner that cancels and awaits it.

asyncio keeps only a weak reference to a running task, and a task nobody awaits outlives the
code that started it. So a task is started in one of two places:

- an :class:`asyncio.TaskGroup`, where the tasks live no longer than one ``async with`` block
  and a failing one should cancel the rest (trio's nursery);
- a :class:`TaskOwner`, where an object (a listener, a supervisor, a client) holds tasks across
  calls, or where one task's failure is its starter's to handle rather than its siblings':
  waiting for the first of several awaitables, for one. :meth:`TaskOwner.start` keeps a strong
  reference until the task ends; :meth:`TaskOwner.aclose` cancels those still running and
  waits for them.

A task's failure stays with the task: whoever started it awaits it, reads it in a done
callback, or leaves it to asyncio's "exception was never retrieved" log, as for any task. The
owner raises none of them; what it cancels at its close ends as the close asked.

``tests/test_task_rule.py`` checks that no other ``create_task`` or ``ensure_future`` starts a
task in the runtime, the fabric, the roles, the CLI or the simulator. No I/O here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar, cast

from .errors import ClosedResourceError

__all__ = ["TaskOwner"]

T = TypeVar("T")


async def _await(awaitable: Awaitable[T]) -> T:
    return await awaitable


class TaskOwner:
    """The tasks one object or one block holds: started with :meth:`start`, ended with
    :meth:`aclose` (or by leaving ``async with``). Iterating gives the tasks still running."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def start(self, awaitable: Awaitable[T], *, name: str | None = None) -> asyncio.Task[T]:
        """Run ``awaitable`` (a coroutine, or any awaitable) as a task of the running loop and
        hold it until it ends; returns the task. Never blocks. Raises
        :class:`~orchestr.ClosedResourceError` once :meth:`aclose` has returned (the
        awaitable is then closed unrun, when it is a coroutine)."""
        if self._closed:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            raise ClosedResourceError(
                f"the task owner was closed: {name or 'a task'} was not started"
            )
        coro = awaitable if asyncio.iscoroutine(awaitable) else _await(awaitable)
        task = cast("asyncio.Task[T]", asyncio.get_running_loop().create_task(coro, name=name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` has returned: no task starts here any more."""
        return self._closed

    async def aclose(self) -> None:
        """Cancel every task still running (but one being cancelled already: its clean-up
        is not interrupted) and wait until all have ended; a task started meanwhile (by one
        being cancelled) is cancelled in turn. Their errors are not raised. Idempotent.

        Blocks on the tasks' own clean-up after their cancellation. Cancel-safe: cancelled
        while waiting, the tasks are cancelled already and a later call waits for them."""
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                if not task.cancelling():
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self._closed = True

    async def __aenter__(self) -> TaskOwner:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
