"""A host's cores on virtual time: work shared weighted max-min fair, one core a thread at
most, as Linux's fair scheduler shares its cores by nice; and the generator's steps on them,
timed as the recompute engine runs them."""

from __future__ import annotations

import pytest

from orchestr.sim import Engine, SimGenerator, StepTimeModel
from orchestr.sim._cpu import HostCpu, nice_weight, shares


def test_shares_are_weighted_max_min_at_most_a_core_each() -> None:
    assert shares(2, [1024, 110, 110]) == [1.0, 0.5, 0.5]  # the RL job's trainer and generators
    assert shares(1, [3, 1]) == [0.75, 0.25]
    assert shares(4, [1, 2]) == [1.0, 1.0]  # more cores than threads
    assert shares(2, [1, 1, 1]) == pytest.approx([2 / 3] * 3)
    assert shares(3, []) == []


def test_nice_weights_follow_the_fair_schedulers_table() -> None:
    assert nice_weight(0) == 1024
    assert nice_weight(10) == pytest.approx(110, rel=0.01)  # the kernel's table: 110
    assert nice_weight(-5) == pytest.approx(3121, rel=0.02)  # the kernel's table: 3121
    for bad in (20, -21, 1.5, True):
        with pytest.raises(ValueError, match="nice"):
            nice_weight(bad)


def ends(cpu_cores: float, work: list[tuple[float, float, float]]) -> list[float]:
    """Each piece of ``(start, seconds, weight)``'s end on a host of ``cpu_cores``."""
    engine = Engine()
    cpu = HostCpu(engine, cpu_cores)
    out = [0.0] * len(work)

    def finished(i: int) -> None:
        out[i] = engine.seconds

    for i, (start, seconds, weight) in enumerate(work):
        engine.at(
            round(start * 1e9), lambda i=i, s=seconds, w=weight: cpu.run(s, lambda: finished(i), w)
        )
    engine.run()
    assert cpu.running == 0
    return out


def test_work_beside_other_work_takes_longer() -> None:
    assert ends(1, [(0, 1, 1024)]) == [1.0]
    assert ends(1, [(0, 1, 1024), (0, 1, 1024)]) == [2.0, 2.0]
    assert ends(2, [(0, 1, 1024), (0, 1, 1024)]) == [1.0, 1.0]
    # the second arrives halfway: both at half speed from then
    assert ends(1, [(0, 1, 1024), (0.5, 1, 1024)]) == pytest.approx([1.5, 2.0])
    # a trainer at nice 0 beside two generators at nice 10 on two cores: it runs alone-fast,
    # they at half a core each until it ends, then a core each
    w = nice_weight(10)
    assert ends(2, [(0, 1, 1024), (0, 1, w), (0, 1, w)]) == pytest.approx([1.0, 1.5, 1.5])
    assert ends(1, [(0, 0, 1024)]) == [0.0]


def test_the_cores_count_the_work_done_and_refuse_bad_work() -> None:
    engine = Engine()
    cpu = HostCpu(engine, 2)
    for seconds in (1.0, 2.0, 0.5):
        cpu.run(seconds, lambda: None)
    engine.run()
    assert cpu.core_s == pytest.approx(3.5)
    with pytest.raises(ValueError, match="seconds"):
        cpu.run(-1.0, lambda: None)
    with pytest.raises(ValueError, match="weight"):
        cpu.run(1.0, lambda: None, 0.0)
    with pytest.raises(ValueError, match="cores"):
        HostCpu(engine, 0)


UNIT = StepTimeModel(base_s=0.0, prefill_token_s=1.0)  # a second a token computed


def test_recompute_steps_are_whole_sequences_padded_to_the_longest() -> None:
    engine = Engine()
    gen = SimGenerator(engine, UNIT, recompute=True, token_budget=1 << 20)
    gen.submit("a", [1, 2, 3], 2)
    gen.submit("b", [4, 5, 6, 7, 8], 3)
    engine.run()
    times = {t.id: t for t in gen.finished}
    # steps of 2 x 5, 2 x 6 (a ends), then b alone: 1 x 7
    assert times["a"].first_token == 10 and times["a"].end == 22
    assert times["b"].end == 29 and gen.steps == 3
    assert gen.busy_s == 29


def test_generators_sharing_a_core_take_twice_as_long() -> None:
    def end_of(shared: bool) -> list[float]:
        engine = Engine()
        cpu = HostCpu(engine, 1) if shared else None
        gens = [SimGenerator(engine, UNIT, recompute=True, cpu=cpu) for _ in range(2)]
        for i, gen in enumerate(gens):
            gen.submit(f"r{i}", [1, 2], 2)
        engine.run()
        assert all(g.busy_s == g.finished[0].end for g in gens)  # the steps' time on the clock
        return [g.finished[0].end for g in gens]

    assert end_of(shared=False) == [5.0, 5.0]  # 2 + 3 tokens each
    assert end_of(shared=True) == [10.0, 10.0]
