"""The decisions a graph stage makes, without I/O: which member gets the next call
(:class:`Router`) and when a batch is complete (:class:`Batcher`). Times are plain floats
from the caller's clock."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from orchestr.errors import ConfigError

__all__ = ["Batcher", "Router"]


class Router:
    """Picks members for a stage's calls.

    ``choice`` is ``"least_loaded"`` (fewest of this stage's calls in flight, ties in
    rotation), ``"round_robin"`` (strict rotation: it waits for the next member's slot) or a
    function ``(value, n_members) -> index`` (it waits for that member's slot). At most
    ``limit`` calls per member are in flight. A member whose call died is down for a backoff
    that doubles with each death in a row (``backoff_s`` up to ``max_backoff_s``); picks skip
    it meanwhile, and a function's pick that is down falls back to the least-loaded member.
    """

    def __init__(
        self,
        n: int,
        choice: str | Callable[[Any, int], int],
        limit: int,
        *,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
    ) -> None:
        self.n = n
        self.choice = choice
        self.limit = limit
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.inflight = [0] * n
        self.down_until = [0.0] * n
        self.deaths = [0] * n  # in a row
        self._cursor = 0

    def preferred(self, value: Any) -> int | None:
        """A function policy's pick for ``value`` (checked); ``None`` for the built-in ones,
        which decide when a slot is free. Raises :class:`ConfigError` for a bad index."""
        if not callable(self.choice):
            return None
        index = self.choice(value, self.n)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.n:
            name = getattr(self.choice, "__qualname__", repr(self.choice))
            raise ConfigError(
                f"choice function {name} returned {index!r} for a mesh of {self.n}; it must "
                f"return a member index from 0 to {self.n - 1}"
            )
        return index

    def up(self, member: int, now: float) -> bool:
        return self.down_until[member] <= now

    def _free(self, member: int, now: float) -> bool:
        return self.up(member, now) and self.inflight[member] < self.limit

    def take(self, now: float, preferred: int | None = None) -> int | None:
        """The member to call now, its slot taken; ``None`` means wait for :meth:`end` or for
        :meth:`wake_at`."""
        order = [(self._cursor + k) % self.n for k in range(self.n)]
        if preferred is not None and self.up(preferred, now):
            pick: int | None = preferred if self._free(preferred, now) else None
        elif self.choice == "round_robin" and preferred is None:
            nxt = next((m for m in order if self.up(m, now)), None)
            pick = nxt if nxt is not None and self._free(nxt, now) else None
        else:
            free = [m for m in order if self._free(m, now)]
            pick = min(free, key=lambda m: self.inflight[m]) if free else None
        if pick is not None:
            self.inflight[pick] += 1
            self._cursor = (pick + 1) % self.n
        return pick

    def take_member(self, member: int, now: float) -> bool:
        """Take a slot on ``member`` itself (a fan-out calls every member); ``False`` means
        wait."""
        if not self._free(member, now):
            return False
        self.inflight[member] += 1
        return True

    def end(self, member: int, *, ok: bool) -> None:
        """A call to ``member`` finished; ``ok`` when it produced a result."""
        self.inflight[member] -= 1
        if ok:
            self.deaths[member] = 0

    def died(self, member: int, now: float) -> float:
        """A call found ``member`` dead: it is down for the backoff, which is returned."""
        self.deaths[member] += 1
        backoff: float = min(self.max_backoff_s, self.backoff_s * 2.0 ** (self.deaths[member] - 1))
        self.down_until[member] = max(self.down_until[member], now + backoff)
        return backoff

    def wake_at(self, now: float) -> float | None:
        """When the next down member comes back up, if any is down."""
        later = [t for t in self.down_until if t > now]
        return min(later) if later else None


class Batcher:
    """Groups items into batches of ``count`` items or of what arrived within ``timeout_s``
    of the batch's first item, whichever comes first."""

    def __init__(self, count: int | None, timeout_s: float | None) -> None:
        self.count = count
        self.timeout_s = timeout_s
        self.items: list[Any] = []
        self.deadline: float | None = None

    def add(self, item: Any, now: float) -> bool:
        """Add an item; ``True`` when the batch is full."""
        if not self.items and self.timeout_s is not None:
            self.deadline = now + self.timeout_s
        self.items.append(item)
        return self.count is not None and len(self.items) >= self.count

    def due(self, now: float) -> bool:
        return bool(self.items) and self.deadline is not None and now >= self.deadline

    def take(self) -> list[Any]:
        items, self.items, self.deadline = self.items, [], None
        return items
