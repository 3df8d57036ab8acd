"""An asyncio event loop on the engine's virtual clock, so async control code runs unchanged.

:class:`VirtualLoop` is asyncio's own loop (``asyncio.BaseEventLoop``: its tasks, futures,
``call_soon`` queue and exception handling) with two things replaced: its clock
(:meth:`VirtualLoop.time` is the :class:`~._engine.Engine`'s) and its wait. Where asyncio's
loop would block in ``select()`` until its next timer, this one runs the engine's next event
instead, so time jumps: ``await asyncio.sleep(3600)`` takes no wall time, and timers
(``call_at``, ``asyncio.sleep``, ``asyncio.timeout``, ``wait_for``) are engine events,
ordered with the models' plain callbacks by time and then by the order they were scheduled.

It overrides ``_run_once``, a private method of CPython's ``BaseEventLoop`` (stable in
shape since Python 3.4; ``tests/sim`` checks it on every run of the suite).

What cannot be virtual is refused: sockets, subprocesses and threads (``run_in_executor``,
``asyncio.to_thread``) take wall time the engine cannot see. A run whose tasks all wait on
something no event will ever do raises :class:`~._engine.SimulationError` naming them,
instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextvars
from asyncio import events
from collections.abc import Callable
from typing import Any

from ._engine import Engine, Event, SimulationError, ns

__all__ = ["VirtualClock", "VirtualLoop"]

#: Where a simulation's wall clock starts: 2026-01-01T00:00:00Z (fixed, so a run's timestamps
#: repeat too).
EPOCH = 1_767_225_600.0


class VirtualClock:
    """:mod:`orchestr.clock`'s readings from an engine: ``monotonic()`` its seconds,
    ``time()`` those after ``epoch``."""

    def __init__(self, engine: Engine, epoch: float = EPOCH) -> None:
        self.engine, self.epoch = engine, epoch

    def monotonic(self) -> float:
        return self.engine.seconds

    def time(self) -> float:
        return self.epoch + self.engine.seconds


class VirtualLoop(asyncio.BaseEventLoop):
    """An asyncio loop whose time is ``engine``'s and which runs the engine's events where
    it would wait."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine

    def time(self) -> float:
        return self.engine.seconds

    def call_at(  # type: ignore[override]  # typeshed's generic signature, same behaviour
        self,
        when: float,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        if when is None:
            raise TypeError("when cannot be None")
        self._check_closed()  # type: ignore[attr-defined]
        timer = events.TimerHandle(when, callback, args, self, context)
        due = max(ns(when), self.engine.now)  # a time already past is due now
        name = getattr(callback, "__qualname__", "") or type(callback).__qualname__
        # The engine event rides in the handle's ``_scheduled`` slot, which only
        # BaseEventLoop's own timer heap (replaced here) reads. Handle and event refer to each
        # other until it fires or is cancelled, when the cycle is cut, so both are freed by
        # their reference counts: left to the cyclic collector, timers ran 1.6x slower.
        timer._scheduled = self.engine.at(due, self._fire, timer, name=name)  # type: ignore[attr-defined]
        return timer

    def _fire(self, timer: asyncio.TimerHandle) -> None:
        timer._scheduled = None  # type: ignore[attr-defined]
        if not timer.cancelled():
            self._ready.append(timer)  # type: ignore[attr-defined]

    def _timer_handle_cancelled(self, handle: asyncio.TimerHandle) -> None:
        event = getattr(handle, "_scheduled", None)
        if isinstance(event, Event):
            event.cancel()
            handle._scheduled = None  # type: ignore[attr-defined]

    def _run_once(self) -> None:
        ready = self._ready  # type: ignore[attr-defined]
        engine = self.engine
        while not ready and not self._stopping:  # type: ignore[attr-defined]
            if not engine.step():
                raise SimulationError(_stuck(self))
        # run what is ready now; what these callbacks make ready runs on the next round
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:
                handle._run()

    def _write_to_self(self) -> None:
        # call_soon_threadsafe from this thread needs no wake-up; from another, the engine
        # would not wait for it anyway (threads are refused)
        pass

    def _process_events(self, event_list: Any) -> None:
        pass

    def run_in_executor(  # type: ignore[override]
        self, executor: Any, func: Callable[..., Any], *args: Any
    ) -> Any:
        raise SimulationError(
            f"{getattr(func, '__qualname__', func)!r} would run in a thread: a thread's time "
            "is wall time, which a simulation does not see; call it inline"
        )


def _stuck(loop: VirtualLoop) -> str:
    waiting = [t for t in asyncio.all_tasks(loop) if not t.done()]
    names = ", ".join(
        sorted(f"{t.get_name()} ({getattr(t.get_coro(), '__qualname__', '?')})" for t in waiting)[
            :5
        ]
    )
    return (
        f"the simulation is stuck at {loop.engine.now} ns: no event is scheduled and "
        f"{len(waiting)} task(s) wait on something nothing will do"
        + (f": {names}" if names else "")
    )
