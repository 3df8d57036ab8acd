"""The discrete-event engine: virtual time in integer nanoseconds, events in a heap.

An event is a callback due at an instant; events due at the same instant run in the order
they were scheduled (each carries a sequence number, the heap's tie-break), so a run depends
only on what was scheduled, never on the machine, the wall clock or hash order: the same
scheduling (and the same seed for :attr:`Engine.rng`) gives the same trace, bit for bit.

Time is an ``int`` of nanoseconds so that sums of durations are exact (a float's seconds
lose nanoseconds past a few months of virtual time and add differently in another order).
:meth:`Engine.after` takes seconds as the models give them and rounds once.

Why by hand: SimPy's events are generators resumed through its own scheduler (measured here
about twice the cost of a plain heap of callbacks), and async control code already has its
coroutine runner: asyncio, which :class:`~._loop.VirtualLoop` puts on this engine's clock.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from typing import Any

from orchestr.errors import OrchestrError

__all__ = ["Engine", "Event", "SimulationError", "ns"]

NS = 1_000_000_000


def ns(seconds: float) -> int:
    """``seconds`` as whole nanoseconds (rounded to the nearest)."""
    return round(seconds * NS)


class SimulationError(OrchestrError):
    """A simulation that cannot go on: time asked to go backwards, or a run waiting on
    something nothing will ever do."""

    __module__ = "orchestr.sim"


class Event(list[Any]):
    """A scheduled callback: ``[when_ns, seq, callback, args, name]``, a list so the heap
    orders events by time and then sequence in C (``seq`` is unique, so the comparison never
    reaches the callback: ``bench/sim_events.py`` ran 1.79 s per million events with objects
    compared by a Python ``__lt__``, 0.87 with these, 0.48 for a bare heap of tuples).
    :meth:`cancel` before it is due keeps it from running."""

    __slots__ = ()

    @property
    def when(self) -> int:
        return int(self[0])

    @property
    def seq(self) -> int:
        return int(self[1])

    @property
    def cancelled(self) -> bool:
        return self[2] is None

    def cancel(self) -> None:
        self[2] = None

    def __repr__(self) -> str:
        return f"Event({self[0]} ns, #{self[1]}, {self[4] or self[2]!r})"


class Engine:
    """Runs callbacks in virtual time order. ``seed`` seeds :attr:`rng`, the one source of
    randomness a model run on this engine should draw from. With ``trace`` on, every event
    run is recorded as ``(when_ns, seq, name)`` in :attr:`trace`."""

    def __init__(self, seed: int = 0, *, trace: bool = False) -> None:
        self.now = 0  #: virtual time, in nanoseconds
        self.rng = random.Random(seed)
        self.events_run = 0
        self.trace: list[tuple[int, int, str]] | None = [] if trace else None
        self._heap: list[Event] = []
        self._seq = 0

    @property
    def seconds(self) -> float:
        """Virtual time in seconds."""
        return self.now / NS

    def at(self, when: int, callback: Callable[..., Any], *args: Any, name: str = "") -> Event:
        """Run ``callback(*args)`` at ``when`` (ns). Raises :class:`SimulationError` for an
        instant already past."""
        if when < self.now:
            raise SimulationError(f"cannot schedule at {when} ns: it is already {self.now} ns")
        self._seq += 1
        event = Event((when, self._seq, callback, args, name))
        heapq.heappush(self._heap, event)
        return event

    def after(
        self, delay: float, callback: Callable[..., Any], *args: Any, name: str = ""
    ) -> Event:
        """Run ``callback(*args)`` ``delay`` seconds from now (rounded to a nanosecond; a
        negative delay is refused)."""
        return self.at(self.now + ns(delay), callback, *args, name=name)

    def next_time(self) -> int | None:
        """When the next live event is due (ns), or ``None`` when none is."""
        heap = self._heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
        return int(heap[0][0]) if heap else None

    def step(self) -> bool:
        """Run the next live event; ``False`` when there is none."""
        heap = self._heap
        while heap:
            when, seq, callback, args, name = heapq.heappop(heap)
            if callback is None:
                continue
            self.now = when
            self.events_run += 1
            if self.trace is not None:
                self.trace.append((when, seq, name or _name(callback)))
            callback(*args)
            return True
        return False

    def run(self, until: int | None = None) -> int:
        """Run events in order until none is left, or up to and including those due at
        ``until`` (ns; the clock then stands at ``until``). Returns the events run."""
        heap, trace, pop = self._heap, self.trace, heapq.heappop
        last = float("inf") if until is None else until
        ran = 0
        try:
            while heap and heap[0][0] <= last:
                when, seq, callback, args, name = pop(heap)
                if callback is None:
                    continue
                self.now = when
                ran += 1
                if trace is not None:
                    trace.append((when, seq, name or _name(callback)))
                callback(*args)
        finally:
            self.events_run += ran
        if until is not None and until > self.now:
            self.now = until
        return ran

    def __len__(self) -> int:
        """Events scheduled and not yet run (cancelled ones included until they surface)."""
        return len(self._heap)


def _name(callback: Callable[..., Any]) -> str:
    return getattr(callback, "__qualname__", None) or type(callback).__qualname__
