"""The one seam through which orchestr's control code reads time.

The fabric manager, the reconfiguration transaction, the simulated OCS, the head's state, the
RL jobs, the generator's engine and the front door read the clock here, never through
:mod:`time` directly, so that the simulator (:mod:`orchestr.sim`) can run the same code on
virtual time: inside :func:`using` (the simulator enters it for a run) every reading comes from
the given :class:`Clock`; everywhere else from the wall clock.

The clock in force is a context variable: asyncio tasks and threads started inside
:func:`using` keep it, and code outside it (another job in the same process) is unaffected.
Reading it costs a context-variable lookup (about 50 ns) over :func:`time.monotonic`.
"""

from __future__ import annotations

import contextvars
import time as _time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

__all__ = ["Clock", "WallClock", "current", "monotonic", "perf_counter", "time", "using"]


class Clock(Protocol):
    """What a clock answers: seconds on a monotonic scale and seconds since the epoch."""

    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class WallClock:
    """The machine's clocks (:func:`time.monotonic` and :func:`time.time`)."""

    def monotonic(self) -> float:
        return _time.monotonic()

    def time(self) -> float:
        return _time.time()


_WALL = WallClock()
_clock: contextvars.ContextVar[Clock | None] = contextvars.ContextVar(
    "orchestr_clock", default=None
)


def current() -> Clock:
    """The clock in force here."""
    return _clock.get() or _WALL


def monotonic() -> float:
    """Seconds on a monotonic scale (only differences mean anything)."""
    clock = _clock.get()
    return _time.monotonic() if clock is None else clock.monotonic()


def perf_counter() -> float:
    """Seconds for timing an interval: :func:`time.perf_counter` on the wall clock, the
    monotonic reading of any other."""
    clock = _clock.get()
    return _time.perf_counter() if clock is None else clock.monotonic()


def time() -> float:
    """Seconds since the epoch (what a record's timestamp says)."""
    clock = _clock.get()
    return _time.time() if clock is None else clock.time()


@contextmanager
def using(clock: Clock) -> Iterator[Clock]:
    """Read ``clock`` in this context (and the tasks and threads started in it) until the
    block exits. Nests; raises ``TypeError`` for something that is not a :class:`Clock`."""
    if not (callable(getattr(clock, "monotonic", None)) and callable(getattr(clock, "time", None))):
        raise TypeError(f"a clock has monotonic() and time(), got {clock!r}")
    token = _clock.set(clock)
    try:
        yield clock
    finally:
        _clock.reset(token)
