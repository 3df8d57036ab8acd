"""asyncio on virtual time: sleeps, timeouts and gathers take no wall time and see the
engine's clock, plain engine events interleave with tasks by time, a stuck run raises instead
of hanging, threads are refused, and orchestr.clock reads virtual time inside a run and the
wall clock outside it."""

from __future__ import annotations

import asyncio
import time

import pytest

from orchestr import clock
from orchestr.sim import Simulation, SimulationError, VirtualLoop, ns, run


def test_a_long_sleep_takes_no_wall_time_and_the_clock_jumps() -> None:
    async def main() -> tuple[float, float, float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.sleep(3 * 24 * 3600)  # three days: past asyncio's one-day select cap
        return start, loop.time(), clock.monotonic()

    start, end, seam = run(main())  # three days of sleep: a wait would time the test out
    assert (start, end, seam) == (0.0, 3 * 24 * 3600.0, 3 * 24 * 3600.0)


def test_timers_order_tasks_and_timeouts_fire_at_their_instant() -> None:
    async def sleeper(delay: float, tag: str, log: list[tuple[float, str]]) -> None:
        await asyncio.sleep(delay)
        log.append((clock.monotonic(), tag))

    async def main() -> list[tuple[float, str]]:
        log: list[tuple[float, str]] = []
        await asyncio.gather(
            sleeper(2, "b", log), sleeper(1, "a1", log), sleeper(1, "a2", log), sleeper(0, "z", log)
        )
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(10), 0.25)
        log.append((clock.monotonic(), "timed out"))
        try:
            async with asyncio.timeout(0.5):
                await asyncio.Event().wait()
        except TimeoutError:
            log.append((clock.monotonic(), "timeout block"))
        return log

    assert run(main()) == [
        (0.0, "z"),
        (1.0, "a1"),
        (1.0, "a2"),
        (2.0, "b"),
        (2.25, "timed out"),
        (2.75, "timeout block"),
    ]


def test_plain_engine_events_and_tasks_share_one_timeline() -> None:
    with Simulation() as sim:
        log: list[tuple[int, str]] = []
        done = sim.loop.create_future()
        sim.engine.at(ns(1.5), lambda: log.append((sim.engine.now, "model event")))
        sim.engine.at(ns(3), done.set_result, "set by an event")

        async def main() -> str:
            await asyncio.sleep(1)
            log.append((sim.engine.now, "task at 1"))
            await asyncio.sleep(1)
            log.append((sim.engine.now, "task at 2"))
            return await done

        assert sim.run(main()) == "set by an event"
        assert log == [(ns(1), "task at 1"), (ns(1.5), "model event"), (ns(2), "task at 2")]
        assert sim.engine.now == ns(3)


def test_a_cancelled_timer_leaves_the_engine() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualLoop)
        handle = loop.call_later(100, print, "never")
        assert len(loop.engine) == 1
        handle.cancel()
        assert loop.engine.next_time() is None
        await asyncio.sleep(1)

    with Simulation() as sim:
        sim.run(main())
        assert sim.engine.now == ns(1)  # the cancelled timer did not move the clock


def test_a_run_that_waits_on_nothing_raises_naming_its_tasks() -> None:
    async def waits_forever() -> None:
        await asyncio.Event().wait()

    async def main() -> None:
        await asyncio.sleep(5)
        await asyncio.gather(waits_forever(), asyncio.sleep(1))

    with pytest.raises(
        SimulationError, match=r"stuck at 6000000000 ns: .*2 task.*main\), .*waits_forever\)"
    ):
        run(main())


def test_threads_are_refused() -> None:
    async def main() -> None:
        await asyncio.to_thread(time.sleep, 0)

    with pytest.raises(SimulationError, match="would run in a thread"):
        run(main())


def test_the_clock_seam_is_virtual_inside_a_run_and_the_wall_outside() -> None:
    outside = clock.time()
    assert abs(outside - time.time()) < 60
    assert isinstance(clock.current(), clock.WallClock)

    async def main() -> tuple[float, float, float]:
        await asyncio.sleep(2.5)
        return clock.monotonic(), clock.perf_counter(), clock.time()

    with Simulation(epoch=1000.0) as sim:
        assert sim.run(main()) == (2.5, 2.5, 1002.5)
    assert abs(clock.monotonic() - time.monotonic()) < 1
    with pytest.raises(TypeError, match="a clock has monotonic"):
        with clock.using(object()):
            pass


def test_tasks_left_behind_are_cancelled_on_virtual_time() -> None:
    cleaned: list[float] = []

    async def lingers() -> None:
        try:
            await asyncio.sleep(1000)
        finally:
            cleaned.append(clock.monotonic())

    async def main() -> None:
        asyncio.get_running_loop().create_task(lingers())
        await asyncio.sleep(3)

    run(main())
    assert cleaned == [3.0]


def _trace(seed: int) -> list[tuple[int, int, str]]:
    async def worker(i: int, rng_draws: list[float]) -> None:
        for _ in range(5):
            await asyncio.sleep(sim.engine.rng.random())
            rng_draws.append(clock.monotonic())

    async def main() -> None:
        draws: list[float] = []
        await asyncio.gather(*(worker(i, draws) for i in range(4)))

    with Simulation(seed, trace=True) as sim:
        sim.run(main())
        assert sim.engine.trace is not None
        return sim.engine.trace


def test_the_same_seed_gives_the_same_trace_through_asyncio() -> None:
    assert _trace(3) == _trace(3)
    assert _trace(3) != _trace(4)
    assert len(_trace(3)) == 20
