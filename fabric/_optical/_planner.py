"""The circuit planner (issue: fabric manager): which switch pairs get optical circuits for the
coming phase, as the smallest change from the circuits in place, and whether that change is
worth its reconfiguration cost.

Inputs are abstract, no topology format: switch names, OCS ports per switch (``budgets``),
which pairs one OCS can join (``allowed``), the rate of one circuit, the electrical share each
pair gets without circuits, the phase's byte matrix, and the circuits in place with the time
each was set up. A circuit set is a b-matching: a multigraph where switch u holds at most
``budgets[u]`` circuits (the circuit types live in :mod:`._circuits`).

The seam is :class:`Planner`: a :class:`PlanRequest` in, a :class:`Plan` out. Every planner
hands its target circuits to :func:`decide`, which owns the shared rules: the plan as a diff
from the circuits in place, the predicted times (the bottleneck-pair model of
:func:`~orchestr.fabric._optical._costmodel.phase_time`), the commit rule with hysteresis, and dwell.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from operator import itemgetter

import numpy as np
import numpy.typing as npt

from orchestr.errors import ConfigError

from ._circuits import Circuit, CircuitSet
from ._plan import Plan, PlanRequest

__all__ = ["GreedyPlanner", "decide"]

_GBPS = 1e9 / 8  # bytes/s in one Gbit/s


_Floats = npt.NDArray[np.float64]


class _Problem:
    """A request indexed for speed: pair ``i * n + j`` (i < j) over sorted switch names; the
    pairs with traffic ascending in ``pids``, their bytes (the heavier way) and electrical
    bytes/s in arrays alongside."""

    def __init__(self, request: PlanRequest) -> None:
        self.request = r = request
        if not r.circuit_gbps > 0 or math.isinf(r.circuit_gbps):
            raise ConfigError(f"circuit_gbps must be a finite rate > 0, got {r.circuit_gbps!r}")
        if not r.repeats > 0:
            raise ConfigError(f"repeats must be > 0, got {r.repeats!r}")
        keys = list(r.demand)
        names = set(r.budgets)
        names.update(map(itemgetter(0), keys), map(itemgetter(1), keys))
        names.update(e for inst in r.current for e in (inst.circuit.a, inst.circuit.b))
        self.names = sorted(names)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.n = len(self.names)
        self.circuit = r.circuit_gbps * _GBPS
        self.free = [0] * self.n
        for name, ports in r.budgets.items():
            frozen = r.frozen_ports.get(name, 0)
            if isinstance(ports, bool) or not isinstance(ports, int) or not 0 <= frozen <= ports:
                raise ConfigError(
                    f"{name}: budget must be an int >= frozen ports >= 0, got {ports!r} / {frozen!r}"
                )
            self.free[self.index[name]] = ports - frozen
        self.pids, self.bytes = self._traffic(keys)
        self.elec = self._electrical()
        self.allowed = self._predicate()
        self.current: Counter[int] = Counter()
        self.young: Counter[int] = Counter()
        for inst in r.current:
            pid = self.pid(inst.circuit)
            if not self.allowed(pid):
                raise ConfigError(f"circuit {inst.circuit} is in place but its pair is not allowed")
            self.current[pid] += 1
            # its age against the dwell (not since against now - dwell: with a dwell far
            # below now's float resolution that subtraction rounds to now)
            if r.now - inst.since < r.policy.min_dwell_s:
                self.young[pid] += 1
        self.check(self.current, "the circuits in place")

    def _traffic(self, keys: list[tuple[str, str]]) -> tuple[npt.NDArray[np.int64], _Floats]:
        count, index = len(keys), self.index
        nbytes = np.fromiter(self.request.demand.values(), np.float64, count)
        bad = np.flatnonzero(~((nbytes >= 0) & np.isfinite(nbytes)))
        if bad.size:
            u, v = keys[bad[0]]
            raise ConfigError(f"demand {u} -> {v} must be finite bytes >= 0, got {nbytes[bad[0]]}")
        src = np.fromiter(map(index.__getitem__, map(itemgetter(0), keys)), np.int64, count)
        dst = np.fromiter(map(index.__getitem__, map(itemgetter(1), keys)), np.int64, count)
        live = (src != dst) & (nbytes > 0)
        pids = np.minimum(src, dst)[live] * self.n + np.maximum(src, dst)[live]
        nbytes = nbytes[live]
        order = np.lexsort((nbytes, pids))
        pids, nbytes = pids[order], nbytes[order]
        last = np.ones(pids.size, np.bool_)  # per pair, the heavier direction
        last[:-1] = pids[1:] != pids[:-1]
        return pids[last], nbytes[last]

    def _electrical(self) -> _Floats:
        rate, names, n = self.request.electrical_gbps, self.names, self.n
        if callable(rate):
            pairs = self.pids.tolist()
            gbps = np.fromiter((rate(names[q // n], names[q % n]) for q in pairs), np.float64)
        else:
            gbps = np.full(self.pids.size, float(rate))
        bad = np.flatnonzero(~(gbps >= 0))
        if bad.size:
            pair = self.circuits({int(self.pids[bad[0]]): 1})
            raise ConfigError(f"electrical_gbps must be >= 0, got {gbps[bad[0]]} for {pair}")
        return gbps * _GBPS

    def _predicate(self) -> Callable[[int], bool]:
        allowed, names, index, n = self.request.allowed, self.names, self.index, self.n
        if allowed is None:
            return lambda pid: True
        if callable(allowed):
            test = allowed
            return lambda pid: bool(test(names[pid // n], names[pid % n]))
        pairs = (sorted((index[u], index[v])) for u, v in allowed if u in index and v in index)
        return {i * n + j for i, j in pairs if i != j}.__contains__

    def pid(self, c: Circuit) -> int:
        try:
            return self.index[c.a] * self.n + self.index[c.b]
        except KeyError:
            raise ConfigError(f"circuit {c} names a switch with no OCS ports") from None

    def circuits(self, k: Mapping[int, int]) -> CircuitSet:
        names, n = self.names, self.n
        return CircuitSet.from_counts(
            {Circuit(names[p // n], names[p % n]): c for p, c in k.items()}
        )

    def positions(
        self, pids: Collection[int]
    ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.bool_]]:
        """Where ``pids`` sit in :attr:`pids`, and which of them have traffic at all."""
        want = np.fromiter(pids, np.int64, len(pids))
        if not self.pids.size:
            return np.zeros(len(pids), np.intp), np.zeros(len(pids), np.bool_)
        at = np.searchsorted(self.pids, want).clip(max=self.pids.size - 1)
        return at, self.pids[at] == want

    def times(self, k: Mapping[int, int]) -> _Floats:
        """Each pair's seconds with ``k`` circuits per pair (phase_time's model)."""
        cap = self.elec.copy()
        at, hit = self.positions(k.keys())
        cap[at[hit]] += np.fromiter(k.values(), np.float64, len(k))[hit] * self.circuit
        return np.divide(self.bytes, cap, out=np.full_like(cap, np.inf), where=cap > 0)

    def time(self, k: Mapping[int, int]) -> float:
        return float(self.times(k).max()) if self.pids.size else 0.0

    def port_changes(self, k: Counter[int]) -> int:
        changed: Counter[int] = Counter()
        for diff in (k - self.current, self.current - k):
            changed |= Counter(dict(enumerate(self.ports(diff))))  # a moved port changes once
        return sum(changed.values())

    def ports(self, k: Mapping[int, int]) -> list[int]:
        used = [0] * self.n
        for pid, count in k.items():
            used[pid // self.n] += count
            used[pid % self.n] += count
        return used

    def check(self, k: Mapping[int, int], what: str) -> None:
        for i, ports in enumerate(self.ports(k)):
            if ports > self.free[i]:
                raise ConfigError(
                    f"{what} use {ports} OCS ports at {self.names[i]}, over its {self.free[i]} "
                    "usable ones (budget less frozen ports): fix the budgets or the circuits"
                )


def decide(request: PlanRequest, target: CircuitSet, note: str = "") -> Plan:
    """The plan that moves from the circuits in place to ``target``, and whether to commit.

    Raises ConfigError when ``target`` breaks the port budgets or wiring. ``note`` (the
    planner's word on its bottleneck) is added to the reason.
    """
    problem = _Problem(request)
    k: Counter[int] = Counter()
    for c, count in target.counts().items():
        pid = problem.pid(c)
        if not problem.allowed(pid):
            raise ConfigError(f"planned circuit {c} joins a pair no OCS reaches")
        k[pid] += count
    problem.check(k, "the planned circuits")
    return _decide(problem, k, note)


def _decide(problem: _Problem, k: Counter[int], note: str) -> Plan:
    r, policy, current = problem.request, problem.request.policy, problem.current
    add, remove = k - current, current - k
    changes = problem.port_changes(k)
    static, planned = problem.time(current), problem.time(k)
    delta = 0.0 if static == planned else static - planned
    saving = delta * r.repeats
    cost = r.reconfig_cost(changes) if changes else 0.0
    bar = cost * (1 + policy.hysteresis) + policy.margin_s
    young_removed = sum(max(0, y - k[pid]) for pid, y in problem.young.items())
    commit = False
    if not changes:
        reason = "no change: the plan is the circuits in place"
    elif young_removed:
        reason = (
            f"refused: would take down {young_removed} circuit(s) set up less than "
            f"min_dwell_s={policy.min_dwell_s:g} s ago"
        )
    elif saving > bar:
        commit = True
        reason = (
            f"commit: saves {saving:.6g} s > reconfiguration {cost:.6g} s x "
            f"(1 + hysteresis {policy.hysteresis:g}) + margin {policy.margin_s:g} s"
        )
    else:
        reason = (
            f"kept the circuits in place: saving {saving:.6g} s does not exceed reconfiguration "
            f"{cost:.6g} s x (1 + hysteresis {policy.hysteresis:g}) + margin "
            f"{policy.margin_s:g} s = {bar:.6g} s"
        )
    held = sum(problem.young.values())
    if held:
        reason += f"; {held} circuit(s) younger than the {policy.min_dwell_s:g} s dwell held"
    if note:
        reason += f"; {note}"
    return Plan(
        add=problem.circuits(add),
        remove=problem.circuits(remove),
        keep=problem.circuits(k & current),
        predicted_s_static=static,
        predicted_s_with=planned,
        saving_s=saving,
        reconfig_cost_s=cost,
        port_changes=changes,
        commit=commit,
        reason=reason,
    )


class GreedyPlanner:
    """Greedy b-matching on the bottleneck pair.

    Circuits set up within the dwell stay. Then, from a heap of pairs keyed by predicted pair
    time ``bytes / (electrical + circuits * rate)``, the slowest pair gets one more circuit (one
    in place if it has one not yet counted, else a new one) and goes back with its new time,
    until the slowest pair cannot get one (no free port at an end, or no OCS joins it): under
    the bottleneck model no circuit elsewhere can shorten the phase then, so none is added.
    Circuits in place that nothing took the ports of stay; ties go to pairs with a circuit in
    place. Last, a repair from the circuits in place towards the same bottleneck time
    (:func:`_nearest`) replaces the plan when it needs fewer port changes, so circuits that
    do not shorten the phase are neither added nor swapped. Cost: one sort of the P pairs with
    traffic (numpy), then O(c log c) for c circuits; every pair leaves the sort at most once.
    """

    def plan(self, request: PlanRequest) -> Plan:
        p = _Problem(request)
        n, free, rate, pids = p.n, p.free, p.circuit, p.pids
        k = Counter(p.young)
        used = p.ports(k)
        unclaimed = {pid: c - k[pid] for pid, c in p.current.items() if c > k[pid]}
        # every pair once, slowest first, from a sort; pairs that got a circuit wait in a heap
        first = p.times(k)
        flag = np.ones(pids.size, np.int64)  # 0: a circuit in place not yet counted
        at, hit = p.positions(unclaimed.keys())
        flag[at[hit]] = 0
        stream = np.lexsort((flag, -first)).tolist()
        heap: list[tuple[float, int, int]] = []
        note, s = "", 0
        while s < len(stream) or heap:
            if s < len(stream):
                q = stream[s]
                item = (-float(first[q]), int(flag[q]), q)
                if heap and heap[0] < item:
                    item = heapq.heappop(heap)
                else:
                    s += 1
            else:
                item = heapq.heappop(heap)
            q = item[2]
            pid = int(pids[q])
            i, j = divmod(pid, n)
            if used[i] >= free[i] or used[j] >= free[j] or not p.allowed(pid):
                why = "no OCS joins it" if not p.allowed(pid) else "no free OCS port"
                note = f"the slowest pair left, {p.names[i]} <-> {p.names[j]}, gets no more: {why}"
                break
            _grow(k, used, n, pid, 1)
            left = unclaimed.get(pid, 0)
            if left > 1:
                unclaimed[pid] = left - 1
            elif left:
                del unclaimed[pid]
            t = float(p.bytes[q]) / (float(p.elec[q]) + k[pid] * rate)
            heapq.heappush(heap, (-t, int(pid not in unclaimed), q))
        at, hit = p.positions(unclaimed.keys())
        found = p.bytes[at] if p.bytes.size else np.zeros(len(at))  # no traffic at all
        load = dict(zip(unclaimed, np.where(hit, found, 0.0).tolist(), strict=True))
        for pid in sorted(unclaimed, key=lambda q: (-load[q], q)):
            i, j = divmod(pid, n)
            keep = min(unclaimed[pid], free[i] - used[i], free[j] - used[j])
            if keep > 0:
                _grow(k, used, n, pid, keep)
        near = _nearest(p, p.time(k))
        if near is not None and p.port_changes(near) < p.port_changes(k):
            k = near
        return _decide(p, k, note)


def _grow(k: Counter[int], used: list[int], n: int, pid: int, by: int) -> None:
    k[pid] += by
    used[pid // n] += by
    used[pid % n] += by


def _nearest(p: _Problem, bound: float) -> Counter[int] | None:
    """The circuits in place, changed little, so that no pair's time exceeds ``bound``.

    Each pair needs the fewest circuits that bring it within ``bound``; a pair short of that
    gets new ones on free ports, or on ports freed by taking down circuits beyond their own
    pair's need (never young ones). None when that greedy repair gets stuck.
    """
    if not 0 < bound < math.inf:
        return None
    n, free = p.n, p.free
    k = Counter(p.current)
    used = p.ports(k)
    fewest = np.ceil((p.bytes / bound - p.elec) / p.circuit - 1e-9)
    some = np.flatnonzero(fewest > 0)
    need = dict(zip(p.pids[some].tolist(), fewest[some].astype(np.int64).tolist(), strict=True))
    spare: dict[int, list[int]] = {}  # switch -> circuits in place it could lose
    for pid in sorted(k):
        for _ in range(k[pid] - max(need.get(pid, 0), p.young[pid])):
            spare.setdefault(pid // n, []).append(pid)
            spare.setdefault(pid % n, []).append(pid)
    for pid in sorted(need, key=lambda q: (k[q] - need[q], q)):
        while k[pid] < need[pid]:
            if not p.allowed(pid):
                return None
            for end in (pid // n, pid % n):
                while used[end] >= free[end]:
                    drop = spare.get(end, [])
                    if not drop:
                        return None
                    gone = drop.pop()
                    if k[gone] > max(need.get(gone, 0), p.young[gone]):  # else listed twice
                        _grow(k, used, n, gone, -1)
            _grow(k, used, n, pid, 1)
    return +k if p.time(k) <= bound * (1 + 1e-9) else None
