"""The reconfiguration transaction over simulated switches and a recording router.

The router double and the switches' event hooks check the invariants from outside, on what
physically happened (a circuit cut while traffic rode it, an undrain onto nothing, a drain
below a floor), independently of the model's own assertions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestr.fabric._optical._ocs import Circuit, VerifyError
from orchestr.fabric._optical._ocs_sim import SimEvent, SimOcs
from orchestr.fabric._optical._reconfig import (
    Changes,
    InvariantError,
    OcsChanges,
    Outcome,
    Pair,
    Reconfigurator,
    pair,
)
from orchestr.fabric._optical._reconfig_model import ReconfigModel

E, C = 100.0, 400.0  # Gb/s: the electrical path, one circuit
FAST = 1e-5
AB, AC, CD, BD = pair("a", "b"), pair("a", "c"), pair("c", "d"), pair("b", "d")
Key = tuple[str, Circuit]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Sim(SimOcs):
    """A simulated switch that records each program with the manager's clock, and can fail a
    verify or a read-back on demand."""

    def __init__(self, name: str, clock: Clock, **kw: Any) -> None:
        super().__init__(**kw)
        self.name, self.clock = name, clock
        self.programs: list[tuple[float, int, frozenset[int]]] = []
        self.lie_next_verify = False
        self.fail_next_read = False
        self.before_verify: Callable[[], None] | None = None

    async def program(
        self, generation: int, connect: Sequence[Circuit], disconnect: Sequence[Circuit]
    ) -> None:
        ports = frozenset(p for c in [*connect, *disconnect] for p in c)
        self.programs.append((self.clock(), generation, ports))
        await super().program(generation, connect, disconnect)

    async def verify(self, generation: int, expected: Collection[Circuit]) -> None:
        if self.before_verify is not None:
            self.before_verify()
            self.before_verify = None
        if self.lie_next_verify:
            self.lie_next_verify = False
            raise VerifyError(generation=generation, found_generation=-1)
        await super().verify(generation, expected)

    async def circuits(self) -> tuple[int, frozenset[Circuit]]:
        if self.fail_next_read:
            self.fail_next_read = False
            raise ConnectionError("read-back lost")
        return await super().circuits()


class Fabric:
    """Switches, a cabling (port -> switch name) and a router double that checks physics."""

    def __init__(
        self,
        cabling: dict[str, list[str]],
        live: dict[str, Collection[Circuit]],
        *,
        floors: dict[Pair, float] | None = None,
        latency: Any = FAST,
    ) -> None:
        self.clock = Clock()
        self.cabling = cabling
        self.floors = floors or {}
        self.sims = {
            o: Sim(
                o,
                self.clock,
                radix=len(ports),
                latency=latency,
                rng=1,
                circuits=live[o],
                on_event=lambda e, o=o: self._on_event(o, e),
            )
            for o, ports in cabling.items()
        }
        self.calls: list[tuple[str, frozenset[Pair]]] = []
        self.fail: list[str] = []
        self.maybe: set[Key] = {(o, c) for o, s in self.sims.items() for c in s.live}
        self.sure: set[Key] = set(self.maybe)
        self.violations: list[str] = []

    def serves(self, ocs: str, c: Circuit) -> Pair:
        return pair(self.cabling[ocs][c[0]], self.cabling[ocs][c[1]])

    def served(self) -> dict[str, dict[Circuit, Pair]]:
        return {o: {c: self.serves(o, c) for c in s.live} for o, s in self.sims.items()}

    def live_of(self, p: Pair) -> set[Key]:
        return {(o, c) for o, s in self.sims.items() for c in s.live if self.serves(o, c) == p}

    def capacity(self, p: Pair) -> float:
        return E + C * len(self.sure & self.live_of(p))

    def _on_event(self, ocs: str, e: SimEvent) -> None:
        if e.kind == "applied":
            for c in e.disconnect:
                if (ocs, c) in self.maybe:
                    self.violations.append(f"I1 {ocs} {c} cut while {self.serves(ocs, c)} rode it")
        if e.kind in ("applied", "circuit-dropped"):
            self.maybe -= {(ocs, c) for c in e.disconnect}
            self.sure -= {(ocs, c) for c in e.disconnect}

    # the Router protocol
    async def drain(self, pairs: frozenset[Pair]) -> None:
        self.calls.append(("drain", pairs))
        for p in pairs:
            if E < min(self.floors.get(p, 0.0), self.capacity(p)):
                self.violations.append(f"I3 drained {p} below its floor")
        self.sure -= {k for k in self.sure if self.serves(*k) in pairs}
        await asyncio.sleep(0)
        if "drain" in self.fail:
            self.fail.remove("drain")
            raise RuntimeError("router: drain failed")
        self.maybe -= {k for k in self.maybe if self.serves(*k) in pairs}

    async def undrain(self, pairs: frozenset[Pair]) -> None:
        self.calls.append(("undrain", pairs))
        for p in pairs:
            if not self.live_of(p):
                self.violations.append(f"I2 undrained {p} onto no circuit")
            self.maybe |= self.live_of(p)
        await asyncio.sleep(0)
        if "undrain" in self.fail:
            self.fail.remove("undrain")
            raise RuntimeError("router: undrain failed")
        self.sure |= {k for p in pairs for k in self.live_of(p)}

    def reconfigurator(self, **kw: Any) -> Reconfigurator:
        kw.setdefault("step_timeout_s", 1.0)
        return Reconfigurator(
            dict(self.sims),
            self,
            floors=self.floors,
            electrical_gbps=E,
            circuit_gbps=C,
            clock=self.clock,
            served=self.served(),
            **kw,
        )

    def check_dwell(self, outcome: Outcome, min_dwell_s: float) -> None:
        for sim in self.sims.values():
            for i, (t, gen, ports) in enumerate(sim.programs):
                if gen != outcome.generation:
                    continue
                for t0, _, ports0 in sim.programs[:i]:
                    if ports & ports0 and t - t0 < min_dwell_s:
                        self.violations.append(f"I4 {sim.name} ports {sorted(ports & ports0)}")

    async def aclose(self) -> None:
        for sim in self.sims.values():
            await sim.aclose()


def one_switch(floors: dict[Pair, float] | None = None, latency: Any = FAST) -> Fabric:
    # ports: 0 a, 1 b, 2 c, 3 d, 4 c, 5 d, 6 b, 7 a
    cabling = {"ocs": ["a", "b", "c", "d", "c", "d", "b", "a"]}
    return Fabric(cabling, {"ocs": [(0, 1), (2, 3)]}, floors=floors, latency=latency)


SWAP = Changes.single(remove={(0, 1): AB}, add={(0, 4): AC})  # a-b gives way to a-c


def steps(outcome: Outcome) -> list[str]:
    seen: list[str] = []
    for e in outcome.events:
        if not seen or seen[-1] != e.step:
            seen.append(e.step)
    return seen


async def test_happy_path_runs_the_steps_in_order() -> None:
    f = one_switch()
    rc = f.reconfigurator()
    out = await rc.apply(SWAP)
    assert out.status == "applied" and out.ok and out.reason is None
    assert steps(out) == ["reserve", "drain", "program", "verify", "undrain"]
    assert set(out.timings) == {"reserve", "drain", "program", "verify", "undrain"}
    assert f.calls == [("drain", {AB}), ("undrain", {AC})]
    assert f.sims["ocs"].live == {(0, 4), (2, 3)} == out.live["ocs"]
    assert [e.generation for e in out.events] == [1] * len(out.events)
    assert f.sims["ocs"].generation == out.generation == rc.generation == 1
    assert rc.view().undrained == {AC, CD}
    assert rc.capacity(AB) == E and rc.capacity(AC) == E + C
    assert f.violations == []
    await f.aclose()


async def test_a_plan_that_cuts_nothing_drains_nothing() -> None:
    f = one_switch()
    rc = f.reconfigurator()
    out = await rc.apply(Changes.single(add={(4, 7): AC}))
    assert out.status == "applied"
    assert f.calls == [("undrain", {AC})]
    out = await rc.apply(Changes.single())
    assert out.status == "unchanged" and out.generation == 1
    await f.aclose()


async def test_a_program_failure_rolls_back_under_a_newer_generation() -> None:
    f = one_switch()
    rc = f.reconfigurator()
    f.sims["ocs"].fail_next_program()
    out = await rc.apply(SWAP)
    assert out.status == "rolled_back" and "injected fault" in (out.reason or "")
    assert f.sims["ocs"].live == {(0, 1), (2, 3)} == out.live["ocs"]
    assert f.sims["ocs"].generation == 2  # the rollback's (empty) program fences generation 1
    assert f.calls == [("drain", {AB}), ("undrain", {AB})]
    assert "rollback" in steps(out)
    assert f.violations == []
    assert (await rc.apply(SWAP)).status == "applied"
    await f.aclose()


async def test_a_verify_mismatch_rolls_back() -> None:
    f = one_switch()
    rc = f.reconfigurator()
    f.sims["ocs"].lie_next_verify = True
    out = await rc.apply(SWAP)
    assert out.status == "rolled_back" and "VerifyError" in (out.reason or "")
    assert f.sims["ocs"].live == {(0, 1), (2, 3)}
    assert [g for _, g, _ in f.sims["ocs"].programs] == [1, 2]
    assert f.violations == []
    await f.aclose()


async def test_a_fault_found_by_verify_is_recorded_and_its_pair_drained() -> None:
    f = one_switch()
    rc = f.reconfigurator()
    f.sims["ocs"].before_verify = lambda: f.sims["ocs"].fail_port(3)  # c-d's circuit drops
    out = await rc.apply(SWAP)
    assert out.status == "rolled_back"
    assert out.lost == {("ocs", (2, 3))}
    assert f.sims["ocs"].live == {(0, 1)}
    assert ("drain", {CD}) in f.calls  # routed onto a dead circuit: moved to the electrical path
    assert rc.view().undrained == {AB}
    assert f.violations == []
    await f.aclose()


async def test_when_the_rollback_fails_too_the_pairs_stay_drained() -> None:
    f = one_switch()
    rc = f.reconfigurator()
    sim = f.sims["ocs"]
    sim.fail_next_program("stuck mirror")  # the plan's program...
    sim.fail_next_program("stuck mirror")  # ...and the rollback's
    out = await rc.apply(SWAP)
    assert out.status == "drained"
    assert out.left_drained == {AB}  # its circuit is live, its traffic on the electrical path
    assert f.calls == [("drain", {AB})]
    assert rc.view().undrained == {CD}
    assert f.violations == []
    await f.aclose()


async def test_a_port_failing_mid_program_rolls_back() -> None:
    f = one_switch(latency=0.02)
    rc = f.reconfigurator()
    f.sims["ocs"].fail_port(4, after_s=0.002)
    out = await rc.apply(SWAP)
    assert out.status == "rolled_back" and "PortFailedError" in (out.reason or "")
    assert f.sims["ocs"].live == {(0, 1), (2, 3)}
    assert f.violations == []
    await f.aclose()


async def test_a_failed_port_of_a_cut_circuit_is_left_out_of_the_rollback() -> None:
    f = one_switch(latency=0.02)
    rc = f.reconfigurator()
    f.sims["ocs"].fail_port(1, after_s=0.002)  # (0, 1) drops while being cut
    out = await rc.apply(Changes.single(remove={(0, 1): AB}, add={(1, 5): BD}))
    assert out.status == "rolled_back"
    assert f.sims["ocs"].live == {(2, 3)}
    assert AB not in rc.view().undrained and not out.left_drained  # no circuit: electrical only
    assert f.violations == []
    await f.aclose()


async def test_a_router_drain_failure_cuts_nothing() -> None:
    f = one_switch()
    rc = f.reconfigurator()
    f.fail.append("drain")
    out = await rc.apply(SWAP)
    assert out.status == "rolled_back" and "drain" in (out.reason or "")
    assert f.sims["ocs"].programs == [] and f.sims["ocs"].live == {(0, 1), (2, 3)}
    assert f.calls == [("drain", {AB}), ("undrain", {AB})]
    assert rc.view().undrained == {AB, CD}
    assert f.violations == []
    await f.aclose()


async def test_a_router_undrain_failure_leaves_the_pair_drained() -> None:
    f = one_switch()
    rc = f.reconfigurator()
    f.fail.append("undrain")
    out = await rc.apply(SWAP)
    assert out.status == "drained" and out.left_drained == {AC}
    assert f.sims["ocs"].live == {(0, 4), (2, 3)}
    assert f.calls[-1] == ("drain", {AC})
    assert f.violations == []
    await f.aclose()


async def test_a_late_ack_of_an_old_generation_changes_nothing() -> None:
    f = one_switch()
    rc = f.reconfigurator(step_timeout_s=0.01)
    sim = f.sims["ocs"]
    sim.delay_next_ack(0.03)  # applied on time, answered after the deadline
    out = await rc.apply(SWAP)
    assert out.status == "rolled_back" and "TimeoutError" in (out.reason or "")
    assert sim.live == {(0, 1), (2, 3)} and sim.generation == 2
    before = rc.view()
    await asyncio.sleep(0.04)  # the late ack arrives at the switch's side and reaches no one
    assert [e.generation for e in sim.events if e.kind == "ack"][-1] == 1
    assert not rc.acknowledge("ocs", 1, {(0, 4), (2, 3)})  # nor does a report of it
    assert rc.view() == before
    assert sim.live == {(0, 1), (2, 3)}
    assert f.violations == []
    await f.aclose()


async def test_a_late_command_of_an_old_generation_is_fenced_off() -> None:
    f = one_switch()
    rc = f.reconfigurator(step_timeout_s=0.01)
    sim = f.sims["ocs"]
    sim.delay_next_command(0.03)
    out = await rc.apply(SWAP)
    assert out.status == "rolled_back"
    await asyncio.sleep(0.04)
    assert [e.generation for e in sim.events if e.kind == "stale-ignored"] == [1]
    assert sim.live == {(0, 1), (2, 3)} and sim.generation == 2
    assert f.violations == []
    await f.aclose()


async def test_a_current_report_counts_as_a_read_back() -> None:
    f = one_switch()
    rc = f.reconfigurator()
    assert (await rc.apply(SWAP)).status == "applied"
    f.sims["ocs"].fail_port(2)
    assert rc.acknowledge("ocs", 1, f.sims["ocs"].live)
    assert CD in rc.view().faulted
    out = await rc.apply(Changes.single())
    assert out.status == "unchanged" and ("drain", {CD}) in f.calls
    assert rc.view().faulted == set()
    await f.aclose()


@pytest.mark.parametrize("on_dwell", ["skip", "refuse"])
async def test_dwell_holds_back_ports_changed_recently(on_dwell: Any) -> None:
    f = one_switch()
    rc = f.reconfigurator(min_dwell_s=10.0, on_dwell=on_dwell)
    assert (await rc.apply(SWAP)).status == "applied"  # ports 0, 1, 4 changed at t
    f.clock.t += 5
    plan = Changes.single(remove={(0, 4): AC}, add={(1, 5): BD, (4, 7): AC})
    out = await rc.apply(plan)
    if on_dwell == "refuse":
        assert out.status == "refused" and "changed less than 10 s ago" in (out.reason or "")
    else:
        assert out.status == "unchanged"
        assert set(out.skipped) == {("ocs", c) for c in [(0, 4), (1, 5), (4, 7)]}
    assert f.sims["ocs"].generation == 1
    f.clock.t += 6
    out = await rc.apply(plan)
    assert out.status == "applied" and out.skipped == ()
    f.check_dwell(out, 10.0)
    assert f.violations == []
    await f.aclose()


async def test_dwell_holds_back_only_the_changes_of_recent_ports() -> None:
    f = one_switch()
    rc = f.reconfigurator(min_dwell_s=10.0)
    assert (await rc.apply(Changes.single(add={(4, 7): AC}))).status == "applied"
    out = await rc.apply(Changes.single(remove={(4, 7): AC, (2, 3): CD}, add={(3, 5): CD}))
    assert out.skipped == (("ocs", (4, 7)),)
    assert out.status == "applied" and f.sims["ocs"].live == {(0, 1), (4, 7), (3, 5)}
    await f.aclose()


async def test_floors_refuse_a_plan_that_drains_a_pair_below_them() -> None:
    f = one_switch(floors={AB: E + C})
    rc = f.reconfigurator()
    out = await rc.apply(SWAP)
    assert out.status == "refused" and "below its floor of 500 Gb/s" in (out.reason or "")
    assert f.calls == [] and f.sims["ocs"].programs == []
    f2 = one_switch(floors={AB: E})
    assert (await f2.reconfigurator().apply(SWAP)).status == "applied"
    await f.aclose()
    await f2.aclose()


async def test_bad_plans_are_refused_before_anything_moves() -> None:
    f = one_switch()
    rc = f.reconfigurator()
    cases = [
        (Changes({"nope": OcsChanges()}), "unknown OCS"),
        (Changes.single(remove={(4, 5): CD}), "not live"),
        (Changes.single(remove={(0, 1): CD}), "serves ('a', 'b')"),
        (Changes.single(add={(1, 6): BD}), "port 1 is in live circuit"),
        (Changes.single(add={(6, 8): BD}), "out of range"),
    ]
    for plan, reason in cases:
        out = await rc.apply(plan)
        assert out.status == "refused" and reason in (out.reason or ""), out.reason
    assert f.calls == [] and f.sims["ocs"].programs == []
    f.sims["ocs"].fail_next_read = True
    assert (await rc.apply(SWAP)).reason == "ocs: read-back failed"
    await f.aclose()


async def test_a_plan_over_two_switches_rolls_both_back() -> None:
    cabling = {"x": ["a", "b", "c", "d"], "y": ["a", "b", "c", "d"]}
    f = Fabric(cabling, {"x": [(0, 1)], "y": [(2, 3)]})
    rc = f.reconfigurator()
    f.sims["y"].fail_next_program()
    plan = Changes({"x": OcsChanges(add={(2, 3): CD}), "y": OcsChanges(remove={(2, 3): CD})})
    out = await rc.apply(plan)
    assert out.status == "rolled_back"
    assert f.sims["x"].live == {(0, 1)} and f.sims["y"].live == {(2, 3)}
    assert f.sims["x"].generation == f.sims["y"].generation == 2
    assert f.violations == []
    assert (await rc.apply(plan)).status == "applied"
    assert f.sims["x"].live == {(0, 1), (2, 3)} and f.sims["y"].live == set()
    await f.aclose()


def test_the_model_raises_on_each_invariant() -> None:
    def model(**kw: Any) -> ReconfigModel:
        m = ReconfigModel(kw.pop("floors", {}), kw.pop("electrical", E), C, 10.0)
        m.load("o", 0, frozenset({(0, 1)}), {(0, 1): AB})
        return m

    with pytest.raises(InvariantError, match="I1 cutting o"):
        model().issue("o", 1, (), [(0, 1)], {}, 0.0, rollback=False)
    m = model()
    m.issue("o", 1, [(2, 3)], (), {(2, 3): CD}, 0.0, rollback=False)
    with pytest.raises(InvariantError, match="I4 ports"):
        m.issue("o", 2, [(3, 4)], [(2, 3)], {}, 5.0, rollback=False)
    m.issue("o", 2, (), [(2, 3)], {}, 5.0, rollback=True)  # a rollback may
    with pytest.raises(InvariantError, match="I5 generation 2 after 2"):
        m.issue("o", 2, (), (), {}, 20.0, rollback=False)
    with pytest.raises(InvariantError, match="I3"):
        model(floors={AB: E + C}).drain_begin({AB})
    with pytest.raises(InvariantError, match="I2 .* no electrical path"):
        model(electrical={AB: 0.0})
    m = model()
    m.drain_begin({AB})
    m.drain_done({AB})
    m.ack("o", 1, frozenset())  # cutting a drained pair's circuit is fine...
    with pytest.raises(InvariantError, match="I2 .* routed onto circuits but has none"):
        m.undrain_begin({AB})  # ...routing it onto no circuit is not
    m = model()
    with pytest.raises(InvariantError, match="I1 o"):
        m.ack("o", 1, frozenset())  # a circuit vanishing under routed traffic, not a fault


# -- random plans, latencies and faults -----------------------------------------------------

FAULTS = [
    None,
    "fail_port",
    "fail_mid",
    "repair",
    "slow",
    "drop_ack",
    "delay_ack",
    "delay_cmd",
    "fail_program",
    "lie_verify",
    "fail_read",
    "router_drain",
    "router_undrain",
]
NAMES = ["a", "b", "c", "d", "e"]


def _draw_plan(data: st.DataObject, f: Fabric, ocs: str, radix: int) -> OcsChanges:
    # What is live depends on how the last apply's timings fell out, so every draw here has
    # the same shape whatever is live (Hypothesis replays a case and needs the same draws):
    # indices into the live circuits, and a permutation of all ports filtered to the free.
    live = sorted(f.sims[ocs].live)
    picks = data.draw(st.lists(st.integers(0, radix), max_size=3))
    rm = list(dict.fromkeys(live[i % len(live)] for i in picks)) if live else []
    busy = {p for c in live if c not in rm for p in c}
    order = [p for p in data.draw(st.permutations(range(radix))) if p not in busy]
    add: dict[Circuit, Pair] = {}
    for i in range(0, min(len(order) - 1, data.draw(st.integers(0, 4))), 2):
        c = (min(order[i], order[i + 1]), max(order[i], order[i + 1]))
        if f.serves(ocs, c)[0] != f.serves(ocs, c)[1]:
            add[c] = f.serves(ocs, c)
    if data.draw(st.integers(0, 19)) == 0:
        add[(0, radix)] = ("a", "b")  # an invalid port now and then
    return OcsChanges({c: f.serves(ocs, c) for c in rm}, add)


async def _scenario(data: st.DataObject) -> None:
    switches = data.draw(st.sampled_from([["x"], ["x", "y"]]))
    radix = data.draw(st.integers(6, 10))
    cabling = {
        o: data.draw(st.lists(st.sampled_from(NAMES), min_size=radix, max_size=radix))
        for o in switches
    }
    live: dict[str, list[Circuit]] = {}
    for o in switches:
        ports = data.draw(st.permutations(range(radix)))
        live[o] = [
            (min(a, b), max(a, b))
            for a, b in zip(ports[0:6:2], ports[1:6:2], strict=True)
            if cabling[o][a] != cabling[o][b]
        ]
    hi = data.draw(st.sampled_from([1e-6, 1e-5, 2e-4]))
    floors = {
        pair(a, b): data.draw(st.sampled_from([0.0, 0.0, E, E + C]))
        for a in NAMES
        for b in NAMES
        if a < b
    }
    f = Fabric(cabling, live, floors=floors, latency=(hi / 10, hi))
    dwell = data.draw(st.sampled_from([0.0, 5.0]))
    rc = f.reconfigurator(min_dwell_s=dwell, step_timeout_s=0.01)
    try:
        for _ in range(data.draw(st.integers(1, 6))):
            plan = Changes({o: _draw_plan(data, f, o, radix) for o in switches})
            ocs = data.draw(st.sampled_from(switches))
            sim = f.sims[ocs]
            port = data.draw(st.integers(0, radix - 1))
            fault = data.draw(st.sampled_from(FAULTS))
            if fault == "fail_port":
                sim.fail_port(port)
            elif fault == "fail_mid":
                sim.fail_port(port, after_s=data.draw(st.sampled_from([0.0, hi / 2, hi])))
            elif fault == "repair":
                sim.repair_port(port)
            elif fault == "slow":
                sim.slow_port(port, 3.0)
            elif fault == "drop_ack":
                sim.drop_next_ack()
            elif fault == "delay_ack":
                sim.delay_next_ack(0.02)
            elif fault == "delay_cmd":
                sim.delay_next_command(0.02)
            elif fault == "fail_program":
                sim.fail_next_program()
            elif fault == "lie_verify":
                sim.lie_next_verify = True
            elif fault == "fail_read":
                sim.fail_next_read = True
            elif fault == "router_drain":
                f.fail.append("drain")
            elif fault == "router_undrain":
                f.fail.append("undrain")
            out = await rc.apply(plan)  # the model asserts I1-I5 on every transition
            if out.status in ("applied", "rolled_back", "drained"):
                f.check_dwell(out, dwell)
            assert not f.violations, (fault, out, f.violations)
            pick = data.draw(st.integers(0, 1 << 16))  # drawn alike whatever happened
            target = data.draw(st.sampled_from(switches))
            if rc.generation > 1:  # I5: a late report of an old generation changes nothing
                old = pick % rc.generation
                before = rc.view()
                if old < before.issued.get(target, 0):
                    assert not rc.acknowledge(target, old, {(0, 1)})
                    assert rc.view() == before
            f.clock.t += data.draw(st.sampled_from([0.0, 1.0, 6.0]))
            f.fail.clear()
        await asyncio.sleep(0.03)  # delayed commands and acks land
        for s in f.sims.values():
            applied = [e.generation for e in s.events if e.kind == "applied"]
            assert applied == sorted(set(applied)), applied  # generations only grow
        assert not f.violations, f.violations
    finally:
        await f.aclose()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_plans_timings_and_faults_keep_the_invariants(data: st.DataObject) -> None:
    asyncio.run(_scenario(data))
