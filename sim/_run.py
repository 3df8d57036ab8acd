"""A simulation: an engine, a virtual-time loop over it, and the clock seam pointed at it."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from .. import clock
from ._engine import Engine
from ._loop import EPOCH, VirtualClock, VirtualLoop

__all__ = ["Simulation", "run"]

T = TypeVar("T")


class Simulation:
    """An :class:`Engine` (seeded with ``seed``; ``trace`` records every event), a
    :class:`VirtualLoop` on it and a :class:`VirtualClock` (wall time from ``epoch``).
    :meth:`run` runs a coroutine to completion on virtual time, with every reading of
    :mod:`orchestr.clock` virtual meanwhile. Close it when done (or use it as a context
    manager)."""

    def __init__(self, seed: int = 0, *, trace: bool = False, epoch: float = EPOCH) -> None:
        self.engine = Engine(seed, trace=trace)
        self.loop = VirtualLoop(self.engine)
        self.clock = VirtualClock(self.engine, epoch)

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        """``main``'s result, run on the virtual loop (the engine's plain events interleaved by
        time). Raises what ``main`` raises, and :class:`SimulationError` when it waits on
        something no event will do."""
        with clock.using(self.clock):
            return self.loop.run_until_complete(main)

    def close(self) -> None:
        """Cancel the tasks left (each runs its cleanup on virtual time) and close the loop."""
        loop = self.loop
        if loop.is_closed():
            return
        left = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in left:
            task.cancel()
        if left:
            with clock.using(self.clock):
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.close()

    def __enter__(self) -> Simulation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run(main: Coroutine[Any, Any, T], *, seed: int = 0, trace: bool = False) -> T:
    """Run ``main`` on virtual time in a new :class:`Simulation`, as :func:`asyncio.run` does on
    the wall clock, and return its result."""
    with Simulation(seed, trace=trace) as sim:
        return sim.run(main)
