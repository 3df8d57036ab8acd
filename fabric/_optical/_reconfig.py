"""The reconfiguration transaction: reserve → drain → program → verify → undrain, fenced.

A :class:`Changes` names circuits to remove and add per OCS, each with the endpoint pair it serves.
A :class:`Reconfigurator` applies one plan at a time under a new generation number:

1. **reserve**: read the switches back, check the plan against them, hold back changes of ports
   inside their dwell time, refuse a plan that would drain a pair below its capacity floor;
2. **drain** the pairs whose circuits will be cut onto the electrical path;
3. **program** every switch with the plan's generation; 4. **verify** by reading back;
5. **undrain**: move the pairs that have circuits onto them.

A failure in drain puts the pairs back (nothing was cut). A failure in program or verify rolls
every switch back to the last live set under a newer generation, which also fences off a late
command of the failed one; if that fails too, the affected pairs stay on the electrical path and
the outcome says so. The state and the invariants checked on every transition live in the
sans-IO :class:`~orchestr.fabric._optical._reconfig_model.ReconfigModel`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping
from typing import Literal, TypeVar

import structlog

from orchestr import clock as _clock

from ._ocs import Circuit, OcsDriver, PortFailedError, apply_program
from ._ocs import circuit as _circuit
from ._reconfig_model import (
    Changes,
    FabricView,
    InvariantError,
    Key,
    OcsChanges,
    Pair,
    Program,
    ReconfigModel,
    Reserved,
    pair,
)
from ._routing import Router

__all__ = [
    "Changes",
    "FabricView",
    "InvariantError",
    "OcsChanges",
    "Outcome",
    "Pair",
    "ReconfigEvent",
    "Reconfigurator",
    "pair",
]

log = structlog.get_logger("orchestr.fabric")

Status = Literal["applied", "unchanged", "refused", "rolled_back", "drained"]
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ReconfigEvent:
    at: float
    generation: int
    step: str  # reserve, drain, program, verify, undrain, rollback, fault, ack
    what: str


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What :meth:`Reconfigurator.apply` did.

    ``status``: ``applied``; ``unchanged`` (nothing to do); ``refused`` (nothing touched,
    ``reason`` says why); ``rolled_back`` (back on the last live set, less circuits lost to
    faults); ``drained`` (``left_drained`` pairs have live circuits but stay on the electrical
    path). ``timings`` holds seconds per step.
    """

    status: Status
    generation: int
    reason: str | None
    live: Mapping[str, frozenset[Circuit]]
    skipped: tuple[Key, ...]
    left_drained: frozenset[Pair]
    lost: frozenset[Key]
    timings: Mapping[str, float]
    events: tuple[ReconfigEvent, ...]

    @property
    def ok(self) -> bool:
        return self.status in ("applied", "unchanged")


class _Tx:
    """One transaction's record: events, step timings, circuits lost to faults."""

    def __init__(self, clock: Callable[[], float], generation: int) -> None:
        self.clock = clock
        self.generation = generation
        self.events: list[ReconfigEvent] = []
        self.timings: dict[str, float] = {}
        self.lost: set[Key] = set()

    def event(self, step: str, what: str) -> None:
        self.events.append(ReconfigEvent(self.clock(), self.generation, step, what))

    @contextlib.contextmanager
    def timed(self, step: str) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.timings[step] = self.timings.get(step, 0.0) + self.clock() - start


class Reconfigurator:
    """Applies circuit plans to one or more OCS drivers, moving traffic through ``router``.

    ``floors``: minimum Gb/s per pair; a pair's capacity is ``electrical_gbps`` plus
    ``circuit_gbps`` per live circuit it is routed onto. ``served``: the pair each circuit
    already live on a switch serves (others carry no job traffic). ``min_dwell_s``: a port
    changed less than this long ago (by ``clock``) is not changed again; ``on_dwell`` says
    whether such changes are held back (``skip``) or refuse the whole plan. Each driver and
    router call runs under ``step_timeout_s``.
    """

    def __init__(
        self,
        drivers: OcsDriver | Mapping[str, OcsDriver],
        router: Router,
        *,
        floors: Mapping[Pair, float] | None = None,
        electrical_gbps: float | Mapping[Pair, float] = 100.0,
        circuit_gbps: float = 400.0,
        min_dwell_s: float = 0.0,
        clock: Callable[[], float] = _clock.monotonic,
        served: Mapping[str, Mapping[Circuit, Pair]] | None = None,
        step_timeout_s: float = 5.0,
        on_dwell: Literal["skip", "refuse"] = "skip",
    ) -> None:
        self._drivers = {"ocs": drivers} if isinstance(drivers, OcsDriver) else dict(drivers)
        self._router = router
        self._clock = clock
        self._served = {
            o: {_circuit(*c): pair(*p) for c, p in m.items()} for o, m in (served or {}).items()
        }
        self._step_timeout_s = step_timeout_s
        self._on_dwell = on_dwell
        self._model = ReconfigModel(floors or {}, electrical_gbps, circuit_gbps, min_dwell_s)
        self._lock = asyncio.Lock()

    @property
    def generation(self) -> int:
        """The newest generation issued (or read back from a switch)."""
        return self._model.generation

    def view(self) -> FabricView:
        return self._model.view()

    def capacity(self, p: Pair) -> float:
        return self._model.capacity(pair(*p))

    def acknowledge(self, ocs: str, generation: int, live: Collection[Circuit]) -> bool:
        """Take a report a switch sent on its own (outside ``program``). A report of a
        generation older than the last one issued to ``ocs`` (a late acknowledgement of an
        abandoned program), or one that arrives while a plan runs, changes nothing: returns
        False. Otherwise it counts as a read-back (circuits lost to faults are noted; their
        pairs are drained by the next plan) and returns True. Never blocks."""
        m = self._model
        if ocs not in m.live or generation < m.issued.get(ocs, 0) or self._lock.locked():
            log.info(
                "ocs report ignored", ocs=ocs, generation=generation, current=m.issued.get(ocs)
            )
            return False
        m.observe(ocs, generation, frozenset(_circuit(*c) for c in live), ())
        return True

    async def apply(self, plan: Changes) -> Outcome:
        """Apply ``plan``: reserve, drain, program, verify, undrain (see the module).

        Blocks on the switches and the router; plans queue and run one at a time. A switch or
        router failure is an :class:`Outcome`, not an exception; raises :class:`InvariantError`
        only on a bug. Cancelling it leaves pairs drained so far on the electrical path and
        the switches to be read back by the next plan.
        """
        async with self._lock:
            tx = _Tx(self._clock, self._model.generation)
            outcome = await self._transact(plan, tx)
        log.info(
            "fabric reconfiguration",
            status=outcome.status,
            generation=outcome.generation,
            reason=outcome.reason,
            timings=outcome.timings,
        )
        return outcome

    async def _transact(self, plan: Changes, tx: _Tx) -> Outcome:
        with tx.timed("reserve"):
            unknown = sorted(set(plan.changes) - set(self._drivers))
            if unknown:
                return self._outcome(tx, "refused", plan, None, f"unknown OCS {unknown}")
            for ocs in plan.changes:
                if not await self._read_back(ocs, tx, ()):
                    return self._outcome(tx, "refused", plan, None, f"{ocs}: read-back failed")
            radix = {o: d.radix for o, d in self._drivers.items()}
            r = self._model.reserve(plan, radix, self._clock(), self._on_dwell, tx.event)
        if isinstance(r, str):
            tx.event("reserve", f"refused: {r}")
            return self._outcome(tx, "refused", plan, None, r)
        tx.generation = r.generation
        for ocs, prog in r.programs.items():
            tx.event("reserve", f"{ocs}: connect {sorted(prog.made)}, cut {sorted(prog.cut)}")
        if r.drain:
            with tx.timed("drain"):
                drained = await self._route("drain", r.drain, tx)
            if not drained:  # nothing was cut: put back whatever the router moved
                with tx.timed("undrain"):
                    await self._route("undrain", r.drain & self._with_circuits(), tx)
                return self._outcome(tx, "rolled_back", plan, r, "the router could not drain")
        if not r.programs:
            return self._outcome(tx, "unchanged", plan, r, None)
        with tx.timed("program"):
            errors = await self._program(r.generation, r.programs, tx, rollback=False)
        if not errors:
            with tx.timed("verify"):
                live = {o: self._model.live[o] for o in r.programs}
                errors = await self._verify(live, r.generation, tx)
        status: Status = "applied"
        reason = None
        if errors:
            reason = "; ".join(f"{o}: {type(e).__name__}: {e}" for o, e in errors.items())
            with tx.timed("rollback"):
                status = "rolled_back" if await self._rollback(r, tx) else "drained"
        back = (r.drain | r.add_pairs) & self._with_circuits()
        if status != "drained" and back:
            with tx.timed("undrain"):
                if not await self._undrain(back, tx):
                    status, reason = "drained", reason or "the router could not undrain"
        if self._model.faulted:
            await self._route("drain", set(self._model.faulted), tx)
        return self._outcome(tx, status, plan, r, reason)

    async def _read_back(self, ocs: str, tx: _Tx, cutting: Collection[Circuit]) -> bool:
        m = self._model
        try:
            async with asyncio.timeout(self._step_timeout_s):
                generation, live = await self._drivers[ocs].circuits()
        except Exception as exc:
            tx.event("read-back", f"{ocs}: {type(exc).__name__}: {exc}")
            return False
        if ocs not in m.live:
            m.load(ocs, generation, live, self._served.get(ocs, {}))
            return True
        lost = m.observe(ocs, generation, live, cutting)
        if lost:
            tx.lost |= lost
            tx.event("fault", f"{ocs}: circuits {sorted(c for _, c in lost)} lost")
        return True

    async def _route(
        self, kind: Literal["drain", "undrain"], pairs: Collection[Pair], tx: _Tx
    ) -> bool:
        m = self._model
        if not pairs:
            return True
        (m.drain_begin if kind == "drain" else m.undrain_begin)(pairs)
        call = self._router.drain if kind == "drain" else self._router.undrain
        try:
            async with asyncio.timeout(self._step_timeout_s):
                await call(frozenset(pairs))
        except Exception as exc:
            tx.event(kind, f"failed for {sorted(pairs)}: {type(exc).__name__}: {exc}")
            return False
        (m.drain_done if kind == "drain" else m.undrain_done)(pairs)
        tx.event(kind, f"{sorted(pairs)}")
        return True

    async def _undrain(self, pairs: frozenset[Pair], tx: _Tx) -> bool:
        newcomers = pairs - self._model.undrained
        if await self._route("undrain", pairs, tx):
            return True
        await self._route("drain", newcomers, tx)  # back onto the electrical path
        return False

    async def _program(
        self, generation: int, programs: Mapping[str, Program], tx: _Tx, *, rollback: bool
    ) -> dict[str, Exception]:
        m = self._model
        now = self._clock()
        for ocs, prog in programs.items():
            m.issue(ocs, generation, prog.made, prog.cut, prog.pairs, now, rollback=rollback)

        async def one(ocs: str, prog: Program) -> None:
            intended = apply_program(m.live[ocs], prog.made, prog.cut)
            await self._drivers[ocs].program(generation, sorted(prog.made), sorted(prog.cut))
            if m.ack(ocs, generation, intended):
                tx.event("program", f"{ocs}: generation {generation} acknowledged")
            else:
                tx.event("ack", f"{ocs}: late acknowledgement of {generation} ignored")

        return await self._each(programs, one, "program", tx)

    async def _verify(
        self, expected: Mapping[str, frozenset[Circuit]], generation: int, tx: _Tx
    ) -> dict[str, Exception]:
        async def one(ocs: str, live: frozenset[Circuit]) -> None:
            await self._drivers[ocs].verify(generation, live)
            tx.event("verify", f"{ocs}: generation {generation} verified")

        return await self._each(expected, one, "verify", tx)

    async def _each(
        self,
        items: Mapping[str, T],
        fn: Callable[[str, T], Awaitable[None]],
        step: str,
        tx: _Tx,
    ) -> dict[str, Exception]:
        """Run ``fn`` for every switch at once; returns the failures by switch."""
        errors: dict[str, Exception] = {}

        async def guarded(ocs: str, item: T) -> None:
            try:
                async with asyncio.timeout(self._step_timeout_s):
                    await fn(ocs, item)
            except Exception as exc:
                errors[ocs] = exc
                tx.event(step, f"{ocs}: {type(exc).__name__}: {exc}")

        async with asyncio.TaskGroup() as tg:
            for ocs, item in items.items():
                tg.create_task(guarded(ocs, item))
        return errors

    async def _rollback(self, r: Reserved, tx: _Tx) -> bool:
        """Put every switch of the plan back on its last live set (less circuits lost to
        faults) under a newer generation. False when a switch could not be restored."""
        m = self._model
        restored = True
        shared = m.next_generation()  # one rollback generation for every switch of the plan
        for ocs, prog in r.programs.items():
            if not await self._read_back(ocs, tx, prog.cut):
                restored = False  # state unknown: its pairs stay drained
                continue
            target = r.old[ocs] - {c for o, c in tx.lost if o == ocs}
            for attempt in (1, 2):
                actual = m.live[ocs]
                made = target - actual
                pairs = {c: m.serves[(ocs, c)] for c in made if (ocs, c) in m.serves}
                fix = {ocs: Program(made, actual - target, pairs)}
                fresh = attempt == 1 and shared > m.issued.get(ocs, 0)  # no one overtook it
                generation = shared if fresh else m.next_generation()
                tx.event("rollback", f"{ocs}: generation {generation} back to {sorted(target)}")
                errors = await self._program(generation, fix, tx, rollback=True)
                if not errors:
                    errors = await self._verify({ocs: target}, generation, tx)
                if not errors:
                    break
                await self._read_back(ocs, tx, ())
                exc = errors[ocs]
                if attempt == 1 and isinstance(exc, PortFailedError):
                    target = frozenset(c for c in target if not exc.ports & set(c))
                    continue
                restored = False
        return restored

    def _with_circuits(self) -> set[Pair]:
        m = self._model
        return {p for o, cs in m.live.items() for c in cs if (p := m.serves.get((o, c)))}

    def _outcome(
        self, tx: _Tx, status: Status, plan: Changes, r: Reserved | None, reason: str | None
    ) -> Outcome:
        m = self._model
        touched = (r.drain | r.add_pairs) if r else frozenset()
        left = frozenset((touched & self._with_circuits()) - m.undrained)
        return Outcome(
            status,
            tx.generation,
            reason,
            {o: m.live.get(o, frozenset()) for o in plan.changes},
            r.skipped if r else (),
            left,
            frozenset(tx.lost),
            dict(tx.timings),
            tuple(tx.events),
        )
