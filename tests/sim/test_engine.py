"""The event engine: time order, scheduling order at equal times, cancellation, runs up to an
instant, and a trace that repeats bit for bit for the same seed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestr.sim import Engine, SimulationError, ns


def test_events_run_in_time_order_and_in_scheduling_order_at_one_time() -> None:
    engine = Engine()
    seen: list[tuple[int, str]] = []
    for when, tag in ((30, "c"), (10, "a1"), (20, "b"), (10, "a2"), (10, "a3")):
        engine.at(when, lambda t=tag: seen.append((engine.now, t)))
    assert engine.run() == 5
    assert seen == [(10, "a1"), (10, "a2"), (10, "a3"), (20, "b"), (30, "c")]
    assert engine.now == 30 and len(engine) == 0


def test_a_callback_schedules_more_and_a_cancelled_event_never_runs() -> None:
    engine = Engine()
    seen: list[int] = []

    def tick(n: int) -> None:
        seen.append(engine.now)
        if n:
            engine.after(0.5, tick, n - 1)

    engine.at(0, tick, 3)
    doomed = engine.after(1.0, seen.append, -1)
    doomed.cancel()
    engine.run()
    assert seen == [0, ns(0.5), ns(1.0), ns(1.5)]
    assert engine.events_run == 4 and engine.next_time() is None


def test_a_run_stops_at_an_instant_and_the_clock_stands_there() -> None:
    engine = Engine()
    seen: list[int] = []
    for t in (5, 10, 15):
        engine.at(t, seen.append, t)
    assert engine.run(until=10) == 2
    assert (seen, engine.now, engine.next_time()) == ([5, 10], 10, 15)
    assert engine.run(until=100) == 1 and engine.now == 100
    assert engine.step() is False


def test_time_never_runs_backwards() -> None:
    engine = Engine()
    engine.run(until=50)
    with pytest.raises(SimulationError, match="already 50 ns"):
        engine.at(49, print)
    with pytest.raises(SimulationError):
        engine.after(-1e-9, print)


def _workload(seed: int) -> list[tuple[int, int, str]]:
    """Random arrivals that each schedule a random service, drawn from the engine's rng."""
    engine = Engine(seed, trace=True)

    def arrive(i: int) -> None:
        engine.after(engine.rng.expovariate(100.0), done, i, name=f"done{i}")

    def done(i: int) -> None:
        if i < 200:
            engine.after(engine.rng.random() / 50, arrive, i + 1, name=f"arrive{i + 1}")

    engine.at(0, arrive, 0, name="arrive0")
    engine.run()
    assert engine.trace is not None
    return engine.trace


def test_the_same_seed_gives_the_same_trace_bit_for_bit() -> None:
    first, again, other = _workload(7), _workload(7), _workload(8)
    assert first == again
    assert len(first) == 402
    assert first != other


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1000), st.booleans()), max_size=60))
def test_any_schedule_runs_sorted_by_time_then_order(items: list[tuple[int, bool]]) -> None:
    engine = Engine()
    ran: list[tuple[int, int]] = []
    events = []
    for i, (when, _) in enumerate(items):
        events.append(engine.at(when, ran.append, (when, i)))
    for event, (_, cancel) in zip(events, items, strict=True):
        if cancel:
            event.cancel()
    engine.run()
    want = sorted((when, i) for i, (when, cancel) in enumerate(items) if not cancel)
    assert ran == want
