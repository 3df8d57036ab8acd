"""The reconfiguration transaction's sans-IO core: plans, the manager's belief, the invariants.

:class:`ReconfigModel` holds what the fabric manager believes about its switches and routes and
changes only through transitions (load, program issued, acknowledged, read back, drain and
undrain begun or done). Each transition asserts the safety invariants against the state before
it and raises :class:`InvariantError` on a violation (a bug, never a switch's fault):

- I1 no live circuit is cut while traffic may be routed onto it (it was drained first);
- I2 every pair keeps its electrical path, and a pair routed onto circuits has one live;
- I3 no transition of ours drops a pair's capacity (electrical + routed live circuits) below
  ``min(floor, capacity before)``; losses to switch faults are recorded, not blamed;
- I4 a program other than a rollback touches no port changed less than ``min_dwell_s`` ago;
- I5 generations only grow, and a late acknowledgement of an old generation changes nothing.

:class:`~orchestr.fabric._optical._reconfig.Reconfigurator` is the async shell that does the I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import NamedTuple

from orchestr.errors import OrchestrError

from ._ocs import Circuit, InvalidProgramError
from ._ocs import check_program as _check_program
from ._ocs import circuit as _circuit

__all__ = [
    "Changes",
    "FabricView",
    "InvariantError",
    "Key",
    "OcsChanges",
    "Pair",
    "Program",
    "ReconfigModel",
    "Reserved",
    "pair",
]

Pair = tuple[str, str]
"""Two endpoints (e.g. switch names) whose traffic a circuit carries, in sorted order."""
Key = tuple[str, Circuit]  # (OCS name, circuit)


def pair(a: str, b: str) -> Pair:
    return (a, b) if a <= b else (b, a)


class InvariantError(OrchestrError, AssertionError):
    """A reconfiguration safety invariant failed: a bug in the transaction. Names the invariant,
    the transition and the circuits or pairs involved."""


@dataclasses.dataclass(frozen=True)
class OcsChanges:
    """One switch's part of a plan: circuit -> the pair it serves."""

    remove: Mapping[Circuit, Pair] = dataclasses.field(default_factory=dict)
    add: Mapping[Circuit, Pair] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Changes:
    changes: Mapping[str, OcsChanges]

    @classmethod
    def single(
        cls,
        *,
        remove: Mapping[Circuit, Pair] | None = None,
        add: Mapping[Circuit, Pair] | None = None,
        ocs: str = "ocs",
    ) -> Changes:
        return cls({ocs: OcsChanges(dict(remove or {}), dict(add or {}))})


@dataclasses.dataclass(frozen=True)
class FabricView:
    """A snapshot of the manager's model (compare two to see that nothing changed)."""

    generation: int
    issued: Mapping[str, int]
    live: Mapping[str, frozenset[Circuit]]
    undrained: frozenset[Pair]
    routed: frozenset[Key]
    counted: frozenset[Key]
    faulted: frozenset[Pair]


class Program(NamedTuple):
    made: frozenset[Circuit]
    cut: frozenset[Circuit]
    pairs: Mapping[Circuit, Pair]  # made circuit -> the pair it serves, where known


@dataclasses.dataclass(frozen=True)
class Reserved:
    generation: int
    old: Mapping[str, frozenset[Circuit]]
    programs: Mapping[str, Program]
    drain: frozenset[Pair]
    add_pairs: frozenset[Pair]
    skipped: tuple[Key, ...]


class ReconfigModel:
    """The manager's belief about switches and routes, with the invariants. No I/O.

    ``undrained``: pairs the router may steer onto circuits; ``routed``: circuits traffic may
    use (set when an undrain starts, cleared when a drain ends); ``counted``: circuits whose
    capacity is confirmed (set when an undrain ends, cleared when a drain starts), so I1 is
    checked against the pessimistic side for safety and I3 against the one for capacity.
    """

    def __init__(
        self,
        floors: Mapping[Pair, float],
        electrical_gbps: float | Mapping[Pair, float],
        circuit_gbps: float,
        min_dwell_s: float,
    ) -> None:
        self.floors = {pair(*p): f for p, f in floors.items()}
        self.electrical = electrical_gbps
        self.circuit_gbps = circuit_gbps
        self.min_dwell_s = min_dwell_s
        self.pairs: set[Pair] = set(self.floors)
        self.live: dict[str, frozenset[Circuit]] = {}
        self.serves: dict[Key, Pair] = {}
        self.undrained: set[Pair] = set()
        self.routed: set[Key] = set()
        self.counted: set[Key] = set()
        self.faulted: set[Pair] = set()
        self.changed_at: dict[tuple[str, int], float] = {}
        self.issued: dict[str, int] = {}
        self.generation = 0

    def view(self) -> FabricView:
        return FabricView(
            self.generation,
            dict(self.issued),
            dict(self.live),
            frozenset(self.undrained),
            frozenset(self.routed),
            frozenset(self.counted),
            frozenset(self.faulted),
        )

    def elec(self, p: Pair) -> float:
        e = self.electrical
        return e if isinstance(e, int | float) else e.get(p, 0.0)

    def circuits_of(self, pairs: Collection[Pair]) -> set[Key]:
        return {
            (o, c) for o, cs in self.live.items() for c in cs if self.serves.get((o, c)) in pairs
        }

    def capacity(self, p: Pair) -> float:
        """Gb/s: the electrical path plus each live circuit the pair's traffic surely uses."""
        return self._capacities(self.live, self.counted).get(p, self.elec(p))

    def _capacities(
        self, live: Mapping[str, frozenset[Circuit]], counted: Collection[Key]
    ) -> dict[Pair, float]:
        caps = {p: self.elec(p) for p in self.pairs}
        for o, c in counted:
            p = self.serves.get((o, c))
            if p is not None and c in live.get(o, ()):
                caps[p] = caps.get(p, self.elec(p)) + self.circuit_gbps
        return caps

    def next_generation(self) -> int:
        before = self.view()
        self.generation = max(self.generation, *self.issued.values(), 0) + 1
        self.check(before, "reserve")
        return self.generation

    def dwelling(self, ocs: str, ports: Iterable[int], now: float) -> bool:
        times = [self.changed_at.get((ocs, p)) for p in ports]
        return any(t is not None and now - t < self.min_dwell_s for t in times)

    def reserve(
        self,
        plan: Changes,
        radix: Mapping[str, int],
        now: float,
        on_dwell: str,
        note: Callable[[str, str], None],
    ) -> Reserved | str:
        """Check ``plan`` against the live sets, hold back changes inside their dwell time
        (or refuse, ``on_dwell="refuse"``), check floors, allocate the generation. Returns
        what to do, or why the plan is refused (nothing changed then)."""
        programs: dict[str, Program] = {}
        skipped: list[Key] = []
        drain: set[Pair] = set(self.faulted)
        add_pairs: set[Pair] = set()
        for ocs, ch in plan.changes.items():
            live = self.live[ocs]
            rm = {_circuit(*c): pair(*p) for c, p in ch.remove.items()}
            add = {_circuit(*c): pair(*p) for c, p in ch.add.items()}
            for c, p in [*rm.items(), *add.items()]:
                known = self.serves.get((ocs, c))
                if known is not None and known != p:
                    return f"{ocs} {c} serves {known}, not {p}; plan against the cabling"
            for c in set(rm) & set(add):  # remaking a circuit changes nothing
                del rm[c], add[c]
            gone = sorted(set(rm) - live)
            if gone:
                return f"{ocs}: circuits {gone} are not live (changed since planning); plan again"
            # Both ports of a live circuit changed together, so an add never needs a port of
            # a held-back removal unless it is held back itself; check_program re-checks.
            held_rm = {c for c in rm if self.dwelling(ocs, c, now)}
            held_add = {c for c in add if self.dwelling(ocs, c, now)}
            if held_rm or held_add:
                held = sorted(held_rm | held_add)
                if on_dwell == "refuse":
                    return (
                        f"{ocs}: circuits {held} touch ports changed less than "
                        f"{self.min_dwell_s:g} s ago"
                    )
                skipped += [(ocs, c) for c in held]
                note("reserve", f"{ocs}: held back {held} (dwell)")
            cut = frozenset(rm) - held_rm
            made = {c: p for c, p in add.items() if c not in held_add}
            try:
                _check_program(radix[ocs], live, made, cut)
            except InvalidProgramError as exc:
                return f"{ocs}: {exc}"
            if made or cut:
                programs[ocs] = Program(frozenset(made), cut, made)
                add_pairs |= set(made.values())
                drain |= {rm[c] for c in cut if (ocs, c) in self.routed}
        for p in sorted(drain - self.faulted):
            floor = self.floors.get(p, 0.0)
            if self.elec(p) < min(floor, self.capacity(p)) - 1e-9:
                return (
                    f"draining {p} would leave it {self.elec(p):g} Gb/s, below its floor of "
                    f"{floor:g} Gb/s; keep one of its circuits or lower the floor"
                )
        generation = self.next_generation() if programs else self.generation
        old = {o: self.live[o] for o in programs}
        return Reserved(
            generation, old, programs, frozenset(drain), frozenset(add_pairs), tuple(skipped)
        )

    # -- transitions: each mutates, then checks against the state before ------------------

    def load(
        self, ocs: str, generation: int, live: frozenset[Circuit], served: Mapping[Circuit, Pair]
    ) -> None:
        before = self.view()
        self.live[ocs] = live
        self.issued[ocs] = generation
        self.generation = max(self.generation, generation)
        for c in live:
            if c in served:
                self.serves[(ocs, c)] = served[c]
                self.pairs.add(served[c])
                self.undrained.add(served[c])
                self.routed.add((ocs, c))
                self.counted.add((ocs, c))
        self.check(before, "load", exempt=True)

    def issue(
        self,
        ocs: str,
        generation: int,
        made: Collection[Circuit],
        cut: Collection[Circuit],
        pairs: Mapping[Circuit, Pair],
        now: float,
        *,
        rollback: bool,
    ) -> None:
        before = self.view()
        problems = []
        ports = {p for c in [*made, *cut] for p in c}
        if not rollback and self.dwelling(ocs, ports, now):
            problems.append(f"I4 ports {sorted(ports)} of {ocs} are inside their dwell time")
        for c in cut:
            if (ocs, c) in self.routed:
                problems.append(f"I1 cutting {ocs} {c} of {self.serves.get((ocs, c))} undrained")
        if generation <= self.issued.get(ocs, -1):
            problems.append(f"I5 generation {generation} after {self.issued[ocs]} on {ocs}")
        if problems:
            raise InvariantError("program: " + "; ".join(problems))
        for c in made:
            if c in pairs:
                self.serves[(ocs, c)] = pairs[c]
                self.pairs.add(pairs[c])
        self.changed_at.update({(ocs, p): now for p in ports})
        self.issued[ocs] = generation
        self.generation = max(self.generation, generation)
        self.check(before, "program")

    def ack(self, ocs: str, generation: int, live: frozenset[Circuit]) -> bool:
        """The switch applied ``generation``; ignored (False) when a newer one was issued."""
        if generation < self.issued.get(ocs, 0):
            return False  # I5: a late acknowledgement touches nothing
        before = self.view()
        self._set_live(ocs, live)
        self.check(before, "ack")
        return True

    def observe(
        self, ocs: str, generation: int, live: frozenset[Circuit], cutting: Collection[Circuit]
    ) -> frozenset[Key]:
        """A read-back. Circuits gone that were not being cut are lost to a fault; pairs left
        routed onto nothing are marked faulted until drained. Returns the lost ones."""
        before = self.view()
        lost = frozenset((ocs, c) for c in self.live.get(ocs, frozenset()) - live - set(cutting))
        self._set_live(ocs, live)
        self.issued[ocs] = max(self.issued.get(ocs, 0), generation)
        self.generation = max(self.generation, generation)
        have = {self.serves.get(k) for k in self.routed}
        self.faulted |= {p for p in self.undrained if p not in have}
        self.check(before, "read-back", lost=lost, exempt=True)
        return lost

    def drain_begin(self, pairs: Collection[Pair]) -> None:
        before = self.view()
        self.counted = {k for k in self.counted if self.serves.get(k) not in pairs}
        self.check(before, "drain")

    def drain_done(self, pairs: Collection[Pair]) -> None:
        before = self.view()
        self.undrained -= set(pairs)
        self.faulted -= set(pairs)
        self.routed = {k for k in self.routed if self.serves.get(k) not in pairs}
        self.check(before, "drained")

    def undrain_begin(self, pairs: Collection[Pair]) -> None:
        before = self.view()
        self.undrained |= set(pairs)
        self.faulted -= set(pairs)
        self.routed |= self.circuits_of(pairs)
        self.check(before, "undrain")

    def undrain_done(self, pairs: Collection[Pair]) -> None:
        before = self.view()
        self.counted |= self.circuits_of(pairs) & self.routed
        self.check(before, "undrained")

    def _set_live(self, ocs: str, live: frozenset[Circuit]) -> None:
        self.live[ocs] = live
        self.routed = {(o, c) for o, c in self.routed if o != ocs or c in live}
        self.counted = {(o, c) for o, c in self.counted if o != ocs or c in live}

    def check(
        self,
        before: FabricView,
        transition: str,
        *,
        lost: Collection[Key] = (),
        exempt: bool = False,
    ) -> None:
        """Assert I1-I5 for the step from ``before`` to now. ``lost`` circuits vanished by a
        switch fault and ``exempt`` read-backs may lower capacity (the switch did, not us)."""
        problems = []
        for ocs, old in before.live.items():
            for c in old - self.live.get(ocs, frozenset()):
                if (ocs, c) in before.routed and (ocs, c) not in lost:
                    problems.append(f"I1 {ocs} {c} of {self.serves.get((ocs, c))} cut undrained")
        have = {self.serves.get(k) for k in self.routed}
        caps = self._capacities(self.live, self.counted)
        caps_before = self._capacities(before.live, before.counted)
        for p in sorted(self.pairs):
            if self.elec(p) <= 0:
                problems.append(f"I2 {p} has no electrical path")
            if p in self.undrained and p not in self.faulted and p not in have:
                problems.append(f"I2 {p} is routed onto circuits but has none live")
            if not exempt:
                now, was = caps[p], caps_before[p]
                if now < min(self.floors.get(p, 0.0), was) - 1e-9:
                    problems.append(
                        f"I3 {p} drops to {now:g} Gb/s (floor {self.floors.get(p, 0.0):g}, was {was:g})"
                    )
        if self.generation < before.generation or any(
            self.issued.get(o, 0) < g for o, g in before.issued.items()
        ):
            problems.append("I5 a generation went backwards")
        if problems:
            raise InvariantError(f"{transition}: " + "; ".join(problems))
