"""The simulated engine (``Generator(engine="sim", profile=FILE)``): the paged engine's scheduler
and KV pool with no model, each step lasting what a step-time profile says. On a virtual clock
it gives the simulator's times, request for request; as an actor it serves, hands off and
refuses what it cannot do."""

from __future__ import annotations

import json
import pathlib

import pytest

import orchestr as oc
from orchestr.roles import Generator, Request, models
from orchestr.roles._common._backend import choose_backend
from orchestr.roles._common._hf._config import read_config
from orchestr.roles.generator import StepTimeModel
from orchestr.roles.generator._engines._build import build_engine
from orchestr.roles.generator._engines._sim import SimEngine
from orchestr.sim import Engine, RequestTimes, SimGenerator

PROFILE = StepTimeModel(
    base_s=4e-3,
    prefill_token_s=2e-5,
    decode_s=3e-4,
    prefill_attention_s=1e-8,
    decode_attention_s=2e-8,
    mixed_s=5e-4,
    after_prefill_s=1e-3,
)
SCHEDULER = {"num_blocks": 48, "block_size": 4, "max_batch": 6, "token_budget": 32}


def _workload() -> list[Request]:
    """Prompts of several lengths, the first and the last sharing a prefix (a cache hit once
    the first is computed), more than one batch, and a pool small enough to preempt."""
    shared = list(range(10, 30))
    others = [list(range(50 + i, 58 + 3 * i)) for i in range(8)]
    prompts = [[*shared, 40], *others, [*shared, 41]]
    return [Request(f"r{i}", p, 6 + 3 * (i % 4)) for i, p in enumerate(prompts)]


def test_on_a_virtual_clock_it_gives_the_simulators_times(tmp_path: pathlib.Path) -> None:
    folder = models.make_tiny("llama", tmp_path / "llama", vocab=301)
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    engine = SimEngine(read_config(folder), PROFILE, clock=lambda: now[0], sleep=sleep, **SCHEDULER)
    engine.submit(_workload())
    done = []
    while engine.has_work():
        done += engine.step()
    assert engine.metrics()["vllm:prefix_cache_hits"] > 0
    ours = {c.id: c for c in done}
    assert all(len(c.tokens) == r.max_new_tokens for r in _workload() for c in [ours[r.id]])
    assert all(c.finish_reason == "length" for c in done)

    clock = Engine()
    finished: list[RequestTimes] = []
    sim = SimGenerator(clock, PROFILE, closed_form=False, done=finished.append, **SCHEDULER)
    for r in _workload():
        sim.submit(r.id, r.prompt, r.max_new_tokens)
    clock.run()
    theirs = {t.id: t for t in finished}
    assert sim.steps == engine.stats().steps
    for rid, t in theirs.items():
        assert ours[rid].ttft_s == pytest.approx(t.ttft, abs=1e-6), rid
        assert ours[rid].latency_s == pytest.approx(t.end - t.arrival, abs=1e-6), rid


def test_its_tokens_are_never_an_end_and_differ_between_requests(tmp_path: pathlib.Path) -> None:
    folder = models.make_tiny("llama", tmp_path / "llama", vocab=301)
    config = read_config(folder)
    engine = SimEngine(config, StepTimeModel(base_s=0.0), sleep=lambda s: None, **SCHEDULER)
    engine.submit([Request(f"r{i}", [5, 6, 7], 12) for i in range(3)])
    done = []
    while engine.has_work():
        done += engine.step()
    tokens = [c.tokens for c in done]
    assert all(len(t) == 12 and not set(t) & set(config.eos_token_ids) for t in tokens)
    assert len({tuple(t) for t in tokens}) == 3
    with pytest.raises(ValueError, match="no weights"):
        engine.load_weights({}, 1)


async def test_a_simulated_generator_serves_and_refuses_what_it_cannot(
    ctx: oc.JobContext, tmp_path: pathlib.Path
) -> None:
    folder = models.make_tiny("llama", tmp_path / "llama", vocab=301)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE.to_json()))
    kv = {"num_blocks": 64, "block_size": 4}
    gen = await ctx.spawn(
        Generator, checkpoint=str(folder), engine="sim", profile=str(profile), kv=kv
    )
    done = await gen.generate.call_one([Request(f"r{i}", [5, 6, 7, 8], 9) for i in range(4)])
    assert [len(c.tokens) for c in done] == [9] * 4 and all(c.ttft_s > 0 for c in done)
    # the handoff of a prompt's blocks works between simulated generators
    decode = await ctx.spawn(
        Generator, checkpoint=str(folder), engine="sim", profile=str(profile), kv=kv
    )
    request = Request("h", list(range(3, 23)), 5)
    handoff = (await gen.prefill.call_one(request)).sent_from(gen)
    (moved,) = await decode.generate.call_one([request], kv_from={"h": handoff})
    assert len(moved.tokens) == 5
    stats = await decode.stats.call_one()
    assert stats["orchestr:kv_transfers"] == 1 and stats["orchestr:kv_transfer_failures"] == 0
    with pytest.raises(oc.SpawnError, match="the simulated engine has none"):
        await ctx.spawn(
            Generator, checkpoint=str(folder), engine="sim", profile=str(profile), experts={}
        )


def test_bad_simulated_engine_options_are_refused(tmp_path: pathlib.Path) -> None:
    folder = str(models.make_tiny("llama", tmp_path / "llama", vocab=301))
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE.to_json()))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"base_s": -1}))
    for options, says in [
        ({"engine": "sim"}, "give profile=FILE"),
        ({"engine": "sim", "profile": str(bad)}, "seconds >= 0"),
        ({"engine": "sim", "profile": str(tmp_path / "none.json")}, "No such file"),
        ({"engine": None, "profile": str(profile)}, "not 'paged'"),
        ({"engine": "sim", "profile": str(profile), "tp": 2}, "not 'sim'"),
    ]:
        with pytest.raises(oc.ConfigError, match=says):
            build_engine(
                choose_backend("cpu"), "unused", 0, 8, checkpoint=folder, kv=None, vllm=None,
                model_kwargs=None, version=0, eos_id=None, pad_id=None, max_seq_len=None,
                vocab_size=None, **options,
            )  # fmt: skip
