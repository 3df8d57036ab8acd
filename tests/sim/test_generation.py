"""Generation on virtual time: the generator's own scheduler (the object the paged engine runs,
not a copy) with a step-time model; times that follow from the model, prefix hits, preemption
that gives every block back, and a model fitted to measured steps."""

from __future__ import annotations

import json
import pathlib

import pytest

import orchestr.roles.generator as generator
from orchestr.roles import models
from orchestr.sim import Engine, RequestTimes, SimGenerator, StepTimeModel, fit_step_model
from orchestr.sim._calibrate import calibrate
from orchestr.sim._generation import TERMS

MODEL = StepTimeModel(
    base_s=0.002,
    prefill_token_s=1e-4,
    decode_s=3e-4,
    prefill_attention_s=1e-8,
    decode_attention_s=1e-7,
    mixed_s=0.0015,
    after_prefill_s=0.0008,
)


def run(
    gen: SimGenerator, engine: Engine, arrivals: list[tuple[float, str, list[int], int]]
) -> None:
    for at, rid, prompt, out in arrivals:
        engine.at(round(at * 1e9), gen.submit, rid, prompt, out)
    engine.run()


def test_the_simulator_runs_the_generators_own_scheduler() -> None:
    gen = SimGenerator(Engine(), MODEL)
    assert type(gen.scheduler) is generator.Scheduler
    assert type(gen.scheduler.pool) is generator.BlockPool


def test_times_follow_from_the_step_model() -> None:
    engine = Engine()
    gen = SimGenerator(engine, MODEL, token_budget=2048)
    run(gen, engine, [(0.0, "a", list(range(100)), 5)])
    (a,) = gen.finished
    prefill = MODEL.seconds(prefill_tokens=100, prefill_pairs=100 * 101 // 2)  # causal pairs
    assert a.ttft == pytest.approx(prefill, abs=1e-9)
    # four decode steps, over 101 .. 104 keys (one query each), the first after a prefill
    decodes = sum(MODEL.seconds(decodes=1, decode_pairs=100 + i) for i in range(1, 5))
    decodes += MODEL.after_prefill_s
    assert a.end == pytest.approx(prefill + decodes, abs=1e-9)
    assert a.tpot == pytest.approx(decodes / 4, abs=1e-9)
    assert (a.output_tokens, gen.steps) == (5, 5)


@pytest.mark.parametrize("closed_form", [True, False])
def test_a_prompt_beside_decodes_is_a_mixed_step_and_the_next_decodes_after_a_prefill(
    closed_form: bool,
) -> None:
    engine = Engine()
    gen = SimGenerator(engine, MODEL, token_budget=2048, closed_form=closed_form)
    prefill = MODEL.seconds(prefill_tokens=100, prefill_pairs=100 * 101 // 2)
    # b arrives during a's first decode step; the next step computes its prompt beside a's
    # decode, and a's step after that decodes right after a prefill again
    run(gen, engine, [(0.0, "a", list(range(100)), 5), (prefill + 1e-6, "b", [7] * 50, 1)])
    a, b = sorted(gen.finished, key=lambda t: t.arrival)
    first = MODEL.seconds(decodes=1, decode_pairs=101, after_prefill=1)
    mixed = MODEL.seconds(50, 1, 50 * 51 // 2, 102, mixed=1)
    rest = MODEL.seconds(decodes=1, decode_pairs=103, after_prefill=1)
    rest += MODEL.seconds(decodes=1, decode_pairs=104)
    assert b.first_token == pytest.approx(prefill + first + mixed, abs=1e-9)
    assert a.end == pytest.approx(prefill + first + mixed + rest, abs=1e-9)


def test_a_shared_prefix_is_a_cache_hit_and_every_block_comes_back() -> None:
    engine = Engine()
    gen = SimGenerator(engine, MODEL, num_blocks=64, block_size=16, token_budget=256)
    shared = list(range(5, 517))  # 512 tokens: 32 full blocks
    run(gen, engine, [(0.0, "first", [*shared, 1], 4), (1.0, "second", [*shared, 2], 4)])
    first, second = sorted(gen.finished, key=lambda t: t.arrival)
    assert (first.cached_tokens, second.cached_tokens) == (0, 512)
    assert second.ttft < first.ttft / 5
    assert gen.scheduler.pool.num_free == 64


def test_preemption_under_a_small_pool_loses_nothing() -> None:
    engine = Engine(seed=1)
    gen = SimGenerator(engine, MODEL, num_blocks=24, block_size=16, max_batch=8)
    arrivals = [(0.001 * i, f"r{i}", [i + 5] * 60, 60) for i in range(6)]
    run(gen, engine, arrivals)
    assert sorted(t.id for t in gen.finished) == [f"r{i}" for i in range(6)]
    assert all(t.output_tokens == 60 for t in gen.finished)
    assert gen.scheduler.preemptions > 0
    assert gen.scheduler.pool.num_free == 24
    with pytest.raises(ValueError, match="already here"):
        gen.submit("r0", [1], 1)
        gen.submit("r0", [1], 1)


def test_the_same_arrivals_give_the_same_times() -> None:
    def once() -> list[RequestTimes]:
        engine = Engine()
        gen = SimGenerator(engine, MODEL, token_budget=512)
        run(
            gen,
            engine,
            [
                (i * 0.0037, f"r{i}", [(7 * i + j) % 300 for j in range(50 + i)], 3 + i % 7)
                for i in range(40)
            ],
        )
        return gen.finished

    assert once() == once()


@pytest.mark.parametrize("cache_outputs", [True, False])
def test_runs_of_decodes_in_closed_form_time_requests_as_step_by_step(cache_outputs: bool) -> None:
    """Poisson arrivals that land inside runs of decode steps (cutting them), prompts sharing
    prefixes, a pool small enough to preempt: the closed form gives every request the times
    the step-by-step generator gives, to a nanosecond a step, in far fewer events."""

    def once(closed_form: bool) -> tuple[SimGenerator, Engine]:
        engine = Engine(seed=3)
        gen = SimGenerator(
            engine,
            MODEL,
            num_blocks=160,
            block_size=16,
            max_batch=12,
            token_budget=512,
            closed_form=closed_form,
            cache_outputs=cache_outputs,
        )
        rng, at, arrivals = engine.rng, 0.0, []
        for i in range(60):
            at += rng.expovariate(20.0)
            prompt = [1 + i % 3] * 64 + [rng.randrange(300) for _ in range(rng.randint(1, 200))]
            arrivals.append((at, f"r{i}", prompt, rng.randint(1, 300)))
        run(gen, engine, arrivals)
        return gen, engine

    (steps, step_engine), (closed, closed_engine) = once(False), once(True)
    assert closed.runs > 0 and closed.scheduler.preemptions > 0
    assert closed.steps == steps.steps
    assert closed_engine.events_run < step_engine.events_run / 2
    by_id = {t.id: t for t in steps.finished}
    for t in closed.finished:
        s = by_id[t.id]
        assert (t.output_tokens, t.cached_tokens) == (s.output_tokens, s.cached_tokens)
        tolerance = 1e-9 * (steps.steps + 1)
        assert t.first_token == pytest.approx(s.first_token, abs=tolerance)
        assert t.end == pytest.approx(s.end, abs=tolerance)
    assert closed.busy_s == pytest.approx(steps.busy_s, rel=1e-9)
    assert closed.scheduler.pool.num_free == 160


def test_a_fit_recovers_the_coefficients_of_its_samples() -> None:
    shapes = [
        (64, 0, 2080, 0, 0, 0),
        (512, 0, 131328, 0, 0, 0),
        (0, 8, 0, 800, 0, 1),
        (0, 32, 0, 3000, 0, 0),
        (0, 1, 0, 90, 0, 0),
        (256, 0, 32896, 0, 0, 0),
        (0, 16, 0, 5000, 0, 1),
        (128, 4, 8256, 400, 1, 0),
        (300, 8, 45150, 900, 1, 0),
        (0, 4, 0, 410, 0, 1),
    ]
    samples = [(*x, MODEL.seconds(*x)) for x in shapes]
    fitted = fit_step_model(samples, "here")
    for name in TERMS:
        assert getattr(fitted, name) == pytest.approx(getattr(MODEL, name), rel=1e-6)
    # steps of four features (no mix measured): the mix terms are not fitted, and stay 0
    plain = fit_step_model([(*x[:4], x[-1]) for x in samples if not any(x[4:6])])
    assert plain.mixed_s == plain.after_prefill_s == 0 and plain.base_s > 0
    # a coefficient the data would make negative is held at 0
    noisy = fit_step_model([(*x, 0.001 + 1e-4 * x[0] - 1e-9 * x[2]) for x in shapes])
    assert noisy.prefill_attention_s == 0 and min(getattr(noisy, t) for t in TERMS) >= 0
    with pytest.raises(ValueError, match="cannot fit"):
        fit_step_model(samples[:2])
    with pytest.raises(ValueError, match="features and seconds"):
        fit_step_model([(1, 2, 3)])


def test_profiles_round_trip_and_bad_ones_are_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(MODEL.to_json()))
    assert StepTimeModel.load(str(path)) == MODEL
    for bad, match in (
        ({"decode_s": 0.1}, "needs base_s"),
        ({"base_s": 0.1, "decode_s": 1, "flops": 3}, "unknown step-time field"),
        ({"base_s": -1, "decode_s": 1}, "base_s is seconds >= 0"),
        ([1, 2], "JSON object"),
    ):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            StepTimeModel.load(str(path))


def test_calibration_times_the_real_engine(tmp_path: pathlib.Path) -> None:
    folder = models.make_tiny("llama", tmp_path / "tiny", layers=2)
    fitted, report = calibrate(
        str(folder),
        prefills=(16, 64, 256),
        decodes=((1, 32), (4, 32), (8, 64)),
        mixes=((2, 32, 64),),
        decode_steps=5,
        repeats=1,
        torch_threads=1,
    )
    # which terms carry the time depends on the machine's noise; that the fit prices every
    # measured step, and reports its error on each, does not
    samples = report["samples"]
    assert all(fitted.seconds(*x[:-1]) > 0 for x in samples)
    assert len(report["relative_errors"]) == len(samples)
    # three prefills; each run a prefill and 5 decodes, the mixed one's fourth beside a prompt
    assert len(samples) == 3 + 4 * 6
    mixed = samples[-6:]
    assert [x[:6] for x in mixed[3:]] == [
        [0, 2, 0, 2 * 35, 0, 0],
        [64, 2, 64 * 65 // 2, 2 * 36, 1, 0],
        [0, 2, 0, 2 * 37, 0, 1],
    ]
    assert [x[5] for x in samples[3:9]] == [0, 1, 0, 0, 0, 0]  # right after the prefill
    assert report["model"]["layers"] == 2
    with pytest.raises(ValueError, match="exceeds the step budget"):
        calibrate(str(folder), decodes=((64, 64),), token_budget=2048)
    with pytest.raises(ValueError, match="mixed run"):
        calibrate(str(folder), mixes=((8, 64, 2045),), token_budget=2048)
