"""The fabric manager: phase hints in, circuit plans out, applied through the reconfiguration
transaction.

A hint says what traffic the coming phase of a job will send between switches (bytes from
switch to switch; :func:`hint_demand` turns a phase's traffic between meshes, or a collective
over a mesh, into that, from where the meshes' members run). The manager asks its planner
(:class:`~._planner.GreedyPlanner` by default) for a circuit set, puts each planned circuit on
an OCS that reaches both switches with free ports, and, when the planner says the plan is
worth its cost, applies it with a :class:`~._reconfig.Reconfigurator` (reserve, drain, program,
verify, undrain). Every hint leaves a :class:`PlanRecord` in a bounded history: the plan, the
decision and why, and what the transaction did with its step timings.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import structlog

from orchestr import clock as _clock
from orchestr.errors import ConfigError, OrchestrError

from ._circuits import Circuit, CircuitSet, Installed
from ._costmodel import ReconfigCost, collective_demand
from ._ocs import OcsDriver
from ._ocs import circuit as ocs_circuit
from ._plan import CommitPolicy, Plan, Planner, PlanRequest
from ._planner import GreedyPlanner
from ._reconfig import Reconfigurator
from ._reconfig_model import Changes, OcsChanges
from ._routing import RecordingRouter, Router
from ._topology import Topology

__all__ = ["FabricManager", "Hint", "PlanRecord", "RecordingRouter", "hint_demand"]

log = structlog.get_logger("orchestr.fabric.manager")

Demand = dict[tuple[str, str], float]


@dataclasses.dataclass(frozen=True)
class Hint:
    """A job's coming phase, as switch-to-switch bytes (see :func:`hint_demand`)."""

    job_id: str
    phase: str
    demand: Mapping[tuple[str, str], float]
    expected_s: float | None = None
    #: How often the phase's traffic recurs before the next hint (the saving counts each).
    repeats: float = 1.0
    #: Seconds before the phase starts that the hint arrives: a reconfiguration runs in that
    #: time while the job goes on, so only what does not fit in it counts as its cost.
    lead_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class PlanRecord:
    """What one hint led to: the plan, whether it was committed and why, and what the
    reconfiguration did (``status`` is the transaction's, or ``planned``/``skipped``)."""

    seq: int
    at_unix: float
    job_id: str
    phase: str
    add: tuple[tuple[str, str, int], ...]
    remove: tuple[tuple[str, str, int], ...]
    keep: tuple[tuple[str, str, int], ...]
    predicted_s_static: float
    predicted_s_with: float
    saving_s: float
    reconfig_cost_s: float
    #: Switch ports whose circuit the plan changes.
    port_changes: int
    commit: bool
    reason: str
    status: str
    generation: int
    timings: Mapping[str, float]
    events: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["timings"] = dict(self.timings)
        return out


def hint_demand(
    traffic: Mapping[tuple[str, str], float] | tuple[str, str, float] | None,
    members: Mapping[str, list[str | None]],
) -> Demand:
    """Switch-to-switch bytes of a phase. ``members`` maps each mesh to the switch each of
    its members sits under (``None``: not on the managed fabric, left out). ``traffic`` is
    ``{(src mesh, dst mesh): bytes}`` (spread evenly over member pairs), or a collective
    ``(kind, mesh, bytes per member)``. Raises :class:`ConfigError` for an unknown mesh."""

    def placed(mesh: str) -> list[str]:
        if mesh not in members:
            raise ConfigError(f"the phase names mesh {mesh!r}, which this job has not spawned")
        return [s for s in members[mesh] if s is not None]

    demand: Demand = collections.defaultdict(float)
    if traffic is None:
        return {}
    if isinstance(traffic, tuple):
        kind, mesh, nbytes = traffic
        count = collections.Counter(placed(mesh))
        for key, value in collective_demand(kind, dict(count), nbytes).items():  # type: ignore[arg-type]
            demand[key] += value
        return dict(demand)
    for (src, dst), nbytes in traffic.items():
        a, b = placed(src), placed(dst)
        if not a or not b:
            continue
        share = float(nbytes) / (len(a) * len(b))
        for s, d in itertools.product(a, b):
            if s != d:
                demand[(s, d)] += share
    return dict(demand)


class FabricManager:
    """Plans and applies circuits for the fabric ``topology`` describes, one hint at a time.

    ``drivers`` maps each OCS of the topology to its driver; ``router`` moves pairs between
    circuits and the electrical path. ``clock`` is seconds on the dwell's clock.
    """

    def __init__(
        self,
        topology: Topology,
        drivers: Mapping[str, OcsDriver],
        router: Router,
        *,
        planner: Planner | None = None,
        policy: CommitPolicy | None = None,
        reconfig_cost: Callable[[int], float] | None = None,
        clock: Callable[[], float] = _clock.monotonic,
        history: int = 1000,
        step_timeout_s: float = 10.0,
    ) -> None:
        missing = sorted({o.name for o in topology.ocs} - set(drivers))
        if missing:
            raise ConfigError(f"no driver for OCS {', '.join(missing)} of the fabric's plan")
        self.topology = topology
        self._drivers = dict(drivers)
        self._planner = planner or GreedyPlanner()
        self._policy = policy or CommitPolicy()
        self._cost = reconfig_cost or _latency_cost(topology)
        self._clock = clock
        wires = [w for o in topology.ocs for w in topology.ocs_wires(o.name).values()]
        self.circuit_gbps = min((w.gbps for w in wires), default=0.0)
        #: OCS -> port -> the switch its fibre reaches.
        self._port_switch = {
            o.name: {p: w.switch_port.element for p, w in topology.ocs_wires(o.name).items()}
            for o in topology.ocs
        }
        self._reach = {o.name: topology.ocs_reach(o.name) for o in topology.ocs}
        self.endpoints = sorted({s for reach in self._reach.values() for s in reach})
        self._reconfigurator = Reconfigurator(
            dict(drivers),
            router,
            # The slowest electrical link: a lower bound on every pair's electrical path (the
            # transaction checks it stays positive; the manager declares no floors), found
            # without a path search for each of the endpoints' pairs.
            electrical_gbps=min((link.gbps for link in topology.links), default=1.0),
            circuit_gbps=self.circuit_gbps or 1.0,
            min_dwell_s=self._policy.min_dwell_s,
            clock=clock,
            step_timeout_s=step_timeout_s,
        )
        #: Live OCS circuits: (OCS, port pair) -> when it was set up.
        self._since: dict[tuple[str, tuple[int, int]], float] = {}
        self._seq = itertools.count(1)
        self.history: collections.deque[PlanRecord] = collections.deque(maxlen=history)
        self._lock = asyncio.Lock()

    # -- queries ---------------------------------------------------------------------------
    def _electrical(self, a: str, b: str) -> float:
        return self.topology.switch_path(a, b).bottleneck_gbps

    def _pair(self, ocs: str, c: tuple[int, int]) -> tuple[str, str]:
        a, b = self._port_switch[ocs][c[0]], self._port_switch[ocs][c[1]]
        return (a, b) if a <= b else (b, a)

    def circuits(self) -> CircuitSet:
        """The switch pairs joined by live circuits (with multiplicity)."""
        return CircuitSet(self._pair(o, c) for o, c in self._since)

    def show(self) -> dict[str, Any]:
        """The fabric now: its size, the OCS and their live circuits, the generation."""
        t = self.topology
        return {
            "hosts": len(t.hosts),
            "accelerators": len(t.accelerators),
            "switches": {tier: len(t.switches_in(tier)) for tier in ("tor", "agg", "core")},
            "endpoints": self.endpoints,
            "circuit_gbps": self.circuit_gbps,
            "generation": self._reconfigurator.generation,
            "ocs": [
                {
                    "name": o.name,
                    "radix": o.radix,
                    "wired": len(t.ocs_wires(o.name)),
                    "circuits": sorted(
                        [*c, *self._pair(o.name, c)] for (ocs, c) in self._since if ocs == o.name
                    ),
                }
                for o in t.ocs
            ],
        }

    def host_endpoint(self, host: str) -> str | None:
        """The switch an OCS reaches that carries ``host``'s traffic: its ToR, else an
        aggregation switch above it; ``None`` when no OCS reaches either."""
        tor = self.topology.tor_of(host)
        if tor in self.endpoints:
            return tor
        up = [s for s in self.endpoints if self.topology.link_gbps(tor, s) > 0]
        return up[0] if up else None

    # -- hints -----------------------------------------------------------------------------
    def plan(self, hint: Hint) -> Plan:
        """What the planner would do for ``hint`` now (nothing is applied)."""
        now = self._clock()
        current = [Installed(Circuit(*self._pair(o, c)), t) for (o, c), t in self._since.items()]
        for (a, b), nbytes in hint.demand.items():
            if nbytes < 0 or a not in self.endpoints or b not in self.endpoints:
                raise ConfigError(
                    f"a hint's traffic runs between switches an OCS reaches ({', '.join(self.endpoints)}); "
                    f"got {a!r} -> {b!r}: {nbytes!r} bytes"
                )
        budgets: dict[str, int] = collections.Counter()
        for reach in self._reach.values():
            for switch, ports in reach.items():
                budgets[switch] += len(ports)
        return self._planner.plan(
            PlanRequest(
                demand=hint.demand,
                budgets=budgets,
                circuit_gbps=self.circuit_gbps,
                electrical_gbps=self._electrical,
                now=now,
                allowed=lambda a, b: any(a in r and b in r for r in self._reach.values()),
                current=current,
                reconfig_cost=self._visible_cost(hint.lead_s),
                policy=self._policy,
                repeats=hint.repeats,
            )
        )

    async def hint(self, hint: Hint) -> PlanRecord:
        """Plan for ``hint`` and, when the plan is worth it, apply it. One hint at a time.

        Blocks on the plan and the reconfiguration (reserve, drain, program, verify,
        undrain); returns its :class:`PlanRecord`, whose ``status`` says what happened: a
        switch's failure is recorded there, rolled back, not raised. Raises :class:`ConfigError`
        for traffic between switches no OCS reaches, or of negative bytes. Not cancel-safe: a transaction cancelled
        mid-way is rolled back by the next one."""
        async with self._lock:
            await self._sync()
            plan = self.plan(hint)
            status, generation = "skipped", self._reconfigurator.generation
            timings: dict[str, float] = {}
            events: tuple[str, ...] = ()
            reason = plan.reason
            if plan.commit:
                outcome = await self._reconfigurator.apply(self._changes(plan))
                status, generation = outcome.status, outcome.generation
                timings = dict(outcome.timings)
                events = tuple(f"{e.step}: {e.what}" for e in outcome.events)
                reason = outcome.reason or reason
                now = self._clock()
                # the switches the plan touched, as read back; the others as they were
                live = [(o, c) for o, cs in outcome.live.items() for c in cs]
                live += [k for k in self._since if k[0] not in outcome.live]
                self._since = {k: self._since.get(k, now) for k in live}
            record = self._record(hint, plan, status, generation, reason, timings, events)
        log.info(
            "fabric hint",
            job=hint.job_id,
            phase=hint.phase,
            commit=plan.commit,
            status=status,
            reason=reason,
        )
        return record

    def _visible_cost(self, lead_s: float) -> Callable[[int], float]:
        """The reconfiguration cost a phase announced ``lead_s`` ahead still sees."""
        if lead_s <= 0:
            return self._cost
        return lambda changes: max(0.0, self._cost(changes) - lead_s) if changes else 0.0

    async def _sync(self) -> None:
        """Take the switches' own word for their circuits: a circuit lost to a fault since the
        last plan is forgotten, one set up by someone else (an earlier manager) is adopted."""
        now = self._clock()
        for name, driver in self._drivers.items():
            try:
                _, live = await driver.circuits()
            except OrchestrError as exc:
                log.warning("cannot read an OCS back", ocs=name, error=str(exc))
                continue
            keys = {(name, (c[0], c[1])) for c in live}
            for key in [k for k in self._since if k[0] == name and k not in keys]:
                log.warning("a circuit was lost", ocs=name, circuit=key[1], pair=self._pair(*key))
                del self._since[key]
            for key in keys:
                self._since.setdefault(key, now)

    def _changes(self, plan: Plan) -> Changes:
        """The plan as OCS programs: circuits removed from the ports serving their pair, new
        ones on an OCS reaching both switches, on free ports."""
        remove: dict[str, dict[tuple[int, int], tuple[str, str]]] = collections.defaultdict(dict)
        add: dict[str, dict[tuple[int, int], tuple[str, str]]] = collections.defaultdict(dict)
        live = sorted(self._since, key=lambda k: -self._since[k])  # youngest go first
        for c, count in plan.remove.counts().items():
            a, b = c.a, c.b
            for key in [k for k in live if self._pair(*k) == (a, b)][:count]:
                remove[key[0]][key[1]] = (a, b)
        busy = {(o, p) for (o, c) in self._since for p in c} - {
            (o, p) for o, cs in remove.items() for c in cs for p in c
        }
        for c, count in plan.add.counts().items():
            a, b = c.a, c.b
            for _ in range(count):
                slot = self._free_slot(a, b, busy)
                if slot is None:  # the planner kept to the budgets; wiring decides here
                    log.warning("no OCS port pair left for a planned circuit", pair=(a, b))
                    continue
                ocs, pa, pb = slot
                busy |= {(ocs, pa), (ocs, pb)}
                add[ocs][ocs_circuit(pa, pb)] = (a, b)
        return Changes({o: OcsChanges(remove.get(o, {}), add.get(o, {})) for o in {*remove, *add}})

    def _free_slot(self, a: str, b: str, busy: set[tuple[str, int]]) -> tuple[str, int, int] | None:
        for ocs, reach in self._reach.items():
            if a in reach and b in reach:
                pa = next((p for p in reach[a] if (ocs, p) not in busy), None)
                pb = next((p for p in reach[b] if (ocs, p) not in busy), None)
                if pa is not None and pb is not None:
                    return ocs, pa, pb
        return None

    def _record(
        self,
        hint: Hint,
        plan: Plan,
        status: str,
        generation: int,
        reason: str,
        timings: Mapping[str, float],
        events: Iterable[str],
    ) -> PlanRecord:
        def rows(cs: CircuitSet) -> tuple[tuple[str, str, int], ...]:
            return tuple(sorted((c.a, c.b, n) for c, n in cs.counts().items()))

        record = PlanRecord(
            next(self._seq),
            _clock.time(),
            hint.job_id,
            hint.phase,
            rows(plan.add),
            rows(plan.remove),
            rows(plan.keep),
            plan.predicted_s_static,
            plan.predicted_s_with,
            plan.saving_s,
            plan.reconfig_cost_s,
            plan.port_changes,
            plan.commit,
            reason,
            status,
            generation,
            dict(timings),
            tuple(events),
        )
        self.history.append(record)
        return record


def _latency_cost(topology: Topology) -> ReconfigCost:
    """Reconfiguration cost from the OCS latency models: the slowest switch's fixed part, and
    what each port adds on it."""
    if not topology.ocs:
        return ReconfigCost(0.0, 0.0)
    one = max(o.latency.expected_ms(1) for o in topology.ocs) / 1000
    two = max(o.latency.expected_ms(2) for o in topology.ocs) / 1000
    return ReconfigCost(fixed_s=one, per_change_s=max(0.0, two - one))
