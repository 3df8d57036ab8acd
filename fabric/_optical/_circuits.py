"""Optical circuits as the planner sees them: a :class:`Circuit` joins two switches, a
:class:`CircuitSet` is a multiset of them (a pair may hold several), and :class:`Installed` is a
circuit in place with the time it was set up."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping

from orchestr.errors import ConfigError

__all__ = ["Circuit", "CircuitSet", "Installed"]


@dataclasses.dataclass(frozen=True, order=True)
class Circuit:
    """A circuit joining switches ``a`` and ``b``; unordered, so stored with ``a < b``."""

    a: str
    b: str

    def __post_init__(self) -> None:
        if self.a == self.b:
            raise ConfigError(f"a circuit joins two different switches, got {self.a!r} twice")
        if self.b < self.a:
            a, b = self.b, self.a
            object.__setattr__(self, "a", a)
            object.__setattr__(self, "b", b)


class CircuitSet:
    """An immutable multiset of circuits: a pair may hold several."""

    __slots__ = ("_counts",)

    def __init__(self, circuits: Iterable[Circuit | tuple[str, str]] = ()) -> None:
        counts: Counter[Circuit] = Counter()
        for c in circuits:
            counts[c if isinstance(c, Circuit) else Circuit(*c)] += 1
        self._counts = counts

    @classmethod
    def from_counts(cls, counts: Mapping[Circuit, int]) -> CircuitSet:
        out = cls()
        out._counts = Counter({c: k for c, k in counts.items() if k > 0})
        return out

    def count(self, u: str, v: str) -> int:
        """How many circuits join ``u`` and ``v``."""
        return self._counts.get(Circuit(u, v), 0)

    def counts(self) -> dict[Circuit, int]:
        return dict(self._counts)

    def ports(self) -> dict[str, int]:
        """OCS ports in use per switch."""
        used: Counter[str] = Counter()
        for c, k in self._counts.items():
            used[c.a] += k
            used[c.b] += k
        return dict(used)

    def __len__(self) -> int:
        return sum(self._counts.values())

    def __iter__(self) -> Iterator[Circuit]:
        for c in sorted(self._counts):
            for _ in range(self._counts[c]):
                yield c

    def __contains__(self, item: object) -> bool:
        return item in self._counts

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CircuitSet) and self._counts == other._counts

    def __hash__(self) -> int:
        return hash(frozenset(self._counts.items()))

    def __add__(self, other: CircuitSet) -> CircuitSet:
        return CircuitSet.from_counts(self._counts + other._counts)

    def __sub__(self, other: CircuitSet) -> CircuitSet:
        return CircuitSet.from_counts(self._counts - other._counts)

    def __and__(self, other: CircuitSet) -> CircuitSet:
        return CircuitSet.from_counts(self._counts & other._counts)

    def __repr__(self) -> str:
        inner = ", ".join(f"{c.a}-{c.b}: {k}" for c, k in sorted(self._counts.items()))
        return f"CircuitSet({{{inner}}})"


@dataclasses.dataclass(frozen=True)
class Installed:
    """A circuit in place and when it was set up, on the clock of :attr:`PlanRequest.now`."""

    circuit: Circuit
    since: float
