"""A host's CPU cores on virtual time, shared by the work running on them.

Role models charge their compute to their host's :class:`HostCpu` when the simulated cluster
has one (``SimCluster(cpus=N)``): on a machine where the roles share a few cores (the RL job's
two generators, trainer and reward worker on two CPUs, each torch op on one thread) a step
that runs beside others takes longer than alone, and the simulator would otherwise be fast
exactly where the roles contend.

The model is processor sharing, weighted as Linux's fair scheduler weighs its tasks: each
piece of work is one thread, at most one core, and the cores are shared among the threads in
proportion to their weights (:func:`nice_weight`: 1024 at nice 0, about 1.25 times less per
nice level). Weighted max-min: the heaviest threads take a whole core while their share would
be more than one, the rest split what is left by weight. So on two cores a trainer at nice 0
beside two generators at nice 10 runs at full speed and the generators at half each, as the
fair scheduler's per-core run queues settle. The time a task waits to be scheduled, cache
effects and memory bandwidth are not modelled.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from ._engine import Engine, Event, ns

__all__ = ["HostCpu", "nice_weight", "shares"]

#: Work left below this many core-seconds is done (the clock's nanosecond rounding).
_DONE = 1e-9


def nice_weight(nice: int) -> float:
    """The fair scheduler's weight of a thread at ``nice`` (-20..19): 1024 at 0, each level
    about 1.25 times lighter (its table: 110 at 10, 15 at 19)."""
    if isinstance(nice, bool) or not isinstance(nice, int) or not -20 <= nice <= 19:
        raise ValueError(f"nice is an integer in -20..19, got {nice!r}")
    return 1024.0 / 1.25**nice


def shares(cores: float, weights: list[float]) -> list[float]:
    """Cores each thread of ``weights`` runs on when they share ``cores``: weighted max-min
    fair, at most one core each."""
    out = [0.0] * len(weights)
    left, total = float(cores), float(sum(weights))
    order = sorted(range(len(weights)), key=lambda i: -weights[i])
    for pos, i in enumerate(order):
        if left * weights[i] < total:  # less than a core: so are the lighter ones
            for j in order[pos:]:
                out[j] = left * weights[j] / total
            return out
        out[i] = 1.0
        left -= 1.0
        total -= weights[i]
    return out


class _Work:
    __slots__ = ("done", "left", "rate", "weight")

    def __init__(self, left: float, weight: float, done: Callable[[], None]) -> None:
        self.left, self.weight, self.done = left, weight, done
        self.rate = 0.0


class HostCpu:
    """``cores`` cores of one host on ``engine``'s clock (see the module docstring)."""

    def __init__(self, engine: Engine, cores: float) -> None:
        if not cores > 0:
            raise ValueError(f"a host has more than 0 cores, got {cores!r}")
        self.engine, self.cores = engine, float(cores)
        self._work: dict[int, _Work] = {}
        self._ids = itertools.count()
        self._since = engine.now
        self._next: Event | None = None
        #: Core-seconds of work done so far.
        self.core_s = 0.0

    @property
    def running(self) -> int:
        """Threads with work on the cores now."""
        return len(self._work)

    def run(self, seconds: float, done: Callable[[], None], weight: float = 1024.0) -> None:
        """Run ``seconds`` of one thread's work (its time alone on an idle core) at
        ``weight``, then call ``done``."""
        if not seconds >= 0 or not weight > 0:
            raise ValueError(f"work is seconds >= 0 at a weight > 0, got {seconds!r}, {weight!r}")
        self._advance()
        self._work[next(self._ids)] = _Work(float(seconds), float(weight), done)
        self._plan()

    def _advance(self) -> None:
        now = self.engine.now
        dt = (now - self._since) / 1e9
        self._since = now
        if dt > 0:
            for w in self._work.values():
                w.left -= w.rate * dt
                self.core_s += w.rate * dt

    def _plan(self) -> None:
        if self._next is not None:
            self._next.cancel()
            self._next = None
        if not self._work:
            return
        work = list(self._work.values())
        for w, rate in zip(work, shares(self.cores, [w.weight for w in work]), strict=True):
            w.rate = rate
        soonest = min(max(0.0, w.left) / w.rate for w in work)
        self._next = self.engine.at(self.engine.now + ns(soonest), self._finish, name="cpu work")

    def _finish(self) -> None:
        self._next = None
        self._advance()
        ended = [k for k, w in self._work.items() if w.left <= _DONE]
        if not ended:  # rounded to the nanosecond just short of the end
            ended = [min(self._work, key=lambda k: self._work[k].left / self._work[k].rate)]
        callbacks = [self._work.pop(k).done for k in ended]
        self._plan()
        for done in callbacks:
            done()
