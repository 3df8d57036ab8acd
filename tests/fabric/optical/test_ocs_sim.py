"""The OCS driver conformance suite over ``SimOcs``, the sim's faults, and broken drivers the
suite must catch."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Collection, Sequence

import pytest

from orchestr.errors import ClosedResourceError, OrchestrError
from orchestr.fabric._optical._conformance import check_ocs_driver
from orchestr.fabric._optical._ocs import (
    Circuit,
    InvalidProgramError,
    OcsDriver,
    OcsError,
    PortFailedError,
    StaleGenerationError,
    VerifyError,
    check_program,
    circuit,
)
from orchestr.fabric._optical._ocs_sim import MEMS_LATENCY_S, SimEvent, SimOcs
from orchestr.sim import Simulation

FAST = 1e-5  # seconds per program: keeps the tests quick


def kinds(sim: SimOcs) -> list[str]:
    return [e.kind for e in sim.events]


@pytest.mark.parametrize("latency", [FAST, MEMS_LATENCY_S], ids=["microseconds", "mems"])
async def test_sim_passes_the_conformance_suite(latency: float | tuple[float, float]) -> None:
    assert await check_ocs_driver(lambda: SimOcs(8, latency=latency, rng=1)) == []


async def test_the_suite_takes_an_async_factory() -> None:
    async def make() -> OcsDriver:
        await asyncio.sleep(0)
        return SimOcs(6, latency=FAST)

    assert await check_ocs_driver(make) == []


class _Naive:
    """A driver with the usual mistakes, each switchable: applies connects one at a time
    (not atomic), ignores generations, and forgets it was closed."""

    def __init__(self, *, atomic: bool, fenced: bool, closes: bool, radix: int = 8) -> None:
        self.radix = radix
        self.generation = 0
        self.live: set[Circuit] = set()
        self.atomic, self.fenced, self.closes = atomic, fenced, closes
        self.closed = False

    async def program(
        self, generation: int, connect: Sequence[Circuit], disconnect: Sequence[Circuit]
    ) -> None:
        if self.closed and self.closes:
            raise ClosedResourceError("closed")
        if self.fenced and generation <= self.generation:
            raise StaleGenerationError(generation, self.generation)
        if self.atomic:
            made, cut = check_program(self.radix, self.live, connect, disconnect)
            self.live = (self.live - cut) | made
        else:
            for c in disconnect:
                self.live.discard(circuit(*c))
            for c in connect:  # validates as it goes: a bad circuit leaves the earlier ones in
                check_program(self.radix, self.live, [c], [])
                self.live.add(circuit(*c))
        self.generation = generation

    async def circuits(self) -> tuple[int, frozenset[Circuit]]:
        if self.closed and self.closes:
            raise ClosedResourceError("closed")
        return self.generation, frozenset(self.live)

    async def verify(self, generation: int, expected: Collection[Circuit]) -> None:
        if self.closed and self.closes:
            raise ClosedResourceError("closed")
        want = frozenset(circuit(*c) for c in expected)
        if generation != self.generation or want != self.live:
            raise VerifyError(generation=generation, found_generation=self.generation)

    async def aclose(self) -> None:
        self.closed = True


async def test_the_suite_passes_a_correct_hand_written_driver() -> None:
    assert await check_ocs_driver(lambda: _Naive(atomic=True, fenced=True, closes=True)) == []


@pytest.mark.parametrize(
    ("flaw", "checks"),
    [
        ({"atomic": False}, {"invalid_is_atomic"}),
        ({"fenced": False}, {"generations"}),
        ({"closes": False}, {"close"}),
    ],
)
async def test_the_suite_catches_a_broken_driver(flaw: dict[str, bool], checks: set[str]) -> None:
    options = {"atomic": True, "fenced": True, "closes": True} | flaw
    failures = await check_ocs_driver(lambda: _Naive(**options))
    assert {f.split(":")[0] for f in failures} == checks, failures


async def test_the_suite_reports_a_hanging_driver() -> None:
    def make() -> SimOcs:
        sim = SimOcs(8, latency=FAST)
        for _ in range(20):
            sim.drop_next_ack()
        return sim

    failures = await check_ocs_driver(make, deadline_s=0.05)
    assert len(failures) == 4, failures
    assert all("did not finish within 0.05 s" in f for f in failures)


def test_errors_belong_to_the_tree() -> None:
    for error in (InvalidProgramError, PortFailedError, StaleGenerationError, VerifyError):
        assert issubclass(error, OcsError)
    assert issubclass(OcsError, OrchestrError)
    assert issubclass(InvalidProgramError, ValueError)


async def test_invalid_programs_say_what_is_wrong() -> None:
    sim = SimOcs(8, latency=FAST, circuits=[(0, 1)])
    with pytest.raises(InvalidProgramError, match=r"port 8 is out of range.*0\.\.7"):
        await sim.program(1, [(2, 8)], [])
    with pytest.raises(InvalidProgramError, match=r"port 1 is in live circuit \(0, 1\)"):
        await sim.program(1, [(1, 2)], [])
    with pytest.raises(InvalidProgramError, match="port 3 is also in"):
        await sim.program(1, [(2, 3), (3, 4)], [])
    with pytest.raises(InvalidProgramError, match="no such live circuit"):
        await sim.program(1, [], [(2, 3)])
    with pytest.raises(StaleGenerationError, match="not newer"):
        await sim.program(0, [], [])
    assert await sim.circuits() == (0, frozenset({(0, 1)}))
    assert "program" not in kinds(sim)
    await sim.aclose()


async def test_a_failed_port_drops_its_circuit_and_refuses_programs() -> None:
    seen: list[SimEvent] = []
    sim = SimOcs(8, latency=FAST, circuits=[(0, 1), (2, 3)], on_event=seen.append)
    sim.fail_port(1)
    assert sim.live == {(2, 3)}
    with pytest.raises(PortFailedError, match=r"ports \[1\] have failed") as info:
        await sim.program(1, [(1, 4), (5, 6)], [])
    assert info.value.ports == {1}
    assert await sim.circuits() == (0, frozenset({(2, 3)}))
    sim.repair_port(1)
    await sim.program(1, [(1, 4)], [])
    assert sim.live == {(1, 4), (2, 3)}
    assert kinds(sim) == [
        "port-failed",
        "circuit-dropped",
        "port-repaired",
        "program",
        "applied",
        "ack",
    ]
    assert seen == sim.events
    await sim.aclose()


async def test_a_port_failing_mid_program_leaves_the_switch_unchanged() -> None:
    sim = SimOcs(8, latency=0.02, circuits=[(0, 1)])
    sim.fail_port(4, after_s=0.001)
    with pytest.raises(PortFailedError):
        await sim.program(1, [(4, 5)], [(0, 1)])
    assert await sim.circuits() == (0, frozenset({(0, 1)}))
    assert "rejected" in kinds(sim)
    await sim.aclose()


async def test_a_dropped_ack_leaves_the_program_applied_but_unanswered() -> None:
    sim = SimOcs(8, latency=FAST)
    sim.drop_next_ack()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await sim.program(1, [(0, 1)], [])
    assert await sim.circuits() == (1, frozenset({(0, 1)}))
    assert kinds(sim)[-1] == "ack-dropped"
    await sim.aclose()


async def test_a_late_command_of_an_old_generation_changes_nothing() -> None:
    sim = SimOcs(8, latency=FAST)
    sim.delay_next_command(0.03)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.005):
            await sim.program(1, [(0, 1)], [])
    await sim.program(2, [(2, 3)], [])  # overtakes the delayed one
    await asyncio.sleep(0.05)
    assert await sim.circuits() == (2, frozenset({(2, 3)}))
    stale = [e for e in sim.events if e.kind == "stale-ignored"]
    assert [e.generation for e in stale] == [1]
    assert [e.generation for e in sim.events if e.kind == "applied"] == [2]
    await sim.aclose()


async def test_a_late_ack_reaches_no_one() -> None:
    sim = SimOcs(8, latency=FAST)
    sim.delay_next_ack(0.02)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.005):
            await sim.program(1, [(0, 1)], [])
    assert sim.generation == 1  # applied on time; only the answer is late
    await asyncio.sleep(0.03)
    assert kinds(sim)[-1] == "ack"
    await sim.aclose()


async def test_injected_failure_and_slow_ports() -> None:
    draws: list[float] = []

    def model(rng: random.Random) -> float:
        draws.append(rng.uniform(1e-6, 2e-6))
        return draws[-1]

    sim = SimOcs(8, latency=model, rng=7)
    sim.fail_next_program("mirror stuck")
    with pytest.raises(OcsError, match="mirror stuck"):
        await sim.program(1, [(0, 1)], [])
    assert sim.generation == 0 and not sim.live
    sim.slow_port(0, 4)
    await sim.program(1, [(0, 1)], [])
    assert len(draws) == 2
    assert "latency x4" in [e for e in sim.events if e.kind == "program"][-1].detail
    with pytest.raises(ValueError, match="positive"):
        sim.slow_port(0, 0)
    with pytest.raises(ValueError, match="out of range"):
        sim.fail_port(8)
    await sim.aclose()


async def test_closing_fails_a_pending_program() -> None:
    sim = SimOcs(8, latency=10.0)
    pending = asyncio.ensure_future(sim.program(1, [(0, 1)], []))
    await asyncio.sleep(0)
    await sim.aclose()
    with pytest.raises(ClosedResourceError):
        await pending
    assert sim.generation == 0 and kinds(sim)[-1] == "closed"


def test_reads_take_the_modelled_round_trip_on_virtual_time() -> None:
    async def reads(sim: SimOcs, clock: Callable[[], float]) -> list[float]:
        began = clock()
        await sim.program(1, [(0, 1)], [])
        programmed = clock()
        assert await sim.circuits() == (1, frozenset({circuit(0, 1)}))
        read = clock()
        await sim.verify(1, [(0, 1)])
        return [programmed - began, read - programmed, clock() - read]

    with Simulation() as run:
        took = run.run(reads(SimOcs(8, latency=0.02, read_s=0.005), lambda: run.engine.seconds))
    assert took == pytest.approx([0.02, 0.005, 0.005], abs=1e-9)
    with pytest.raises(ValueError, match="read_s"):
        SimOcs(8, read_s=-1.0)


async def test_the_sim_with_a_read_time_passes_the_conformance_suite() -> None:
    assert await check_ocs_driver(lambda: SimOcs(8, latency=FAST, rng=1, read_s=FAST)) == []
