"""Serving on virtual time: the front door's own router over simulated generators, co-located
and with prefill and decode apart (KV moved over a flow network, entered into the decode
generator's cache as a handoff does)."""

from __future__ import annotations

import pathlib
import random

import pytest

import orchestr.roles.serving as serving
from orchestr.errors import ConfigError
from orchestr.sim import (
    ServingRequest,
    StepTimeModel,
    load_scenario,
    run_scenario,
    simulate_serving,
)
from orchestr.sim import _serving as sim_serving

MODEL = StepTimeModel(
    base_s=0.002,
    prefill_token_s=1e-4,
    decode_s=3e-4,
    prefill_attention_s=1e-8,
    decode_attention_s=1e-7,
)


def test_the_simulator_routes_with_the_front_doors_router() -> None:
    assert sim_serving.Router is serving.Router  # type: ignore[attr-defined]


def test_one_request_costs_its_prefill_and_its_decodes() -> None:
    run = simulate_serving([ServingRequest("a", 0.5, list(range(100)), 5)], MODEL)
    (a,) = run.served
    prefill = MODEL.seconds(prefill_tokens=100, prefill_pairs=100 * 101 // 2)
    decodes = sum(MODEL.seconds(decodes=1, decode_pairs=100 + i) for i in range(1, 5))
    assert a.ttft == pytest.approx(prefill, abs=1e-8)
    assert a.end - a.arrival == pytest.approx(prefill + decodes, abs=1e-8)
    assert (run.steps, run.runs) == (5, 1)  # the four decodes were one closed-form run


def workload(n: int, rate: float, seed: int = 0, systems: int = 4) -> list[ServingRequest]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(300) for _ in range(256)] for _ in range(systems)]
    at, out = 0.0, []
    for i in range(n):
        at += rng.expovariate(rate)
        prompt = [*rng.choice(prefixes), *(rng.randrange(300) for _ in range(rng.randint(8, 64)))]
        out.append(ServingRequest(f"r{i}", at, prompt, rng.randint(4, 40)))
    return out


def test_the_kv_rule_sends_a_shared_prefix_where_it_is_cached() -> None:
    # twelve system prompts of 16 blocks; each generator's cache holds about four
    requests = workload(300, 40.0, systems=12)
    kv = simulate_serving(requests, MODEL, generators=4, policy="kv", num_blocks=96)
    spread = simulate_serving(requests, MODEL, generators=4, policy="round_robin", num_blocks=96)
    hits = {
        name: sum(s.cached_tokens for s in r.served) for name, r in (("kv", kv), ("rr", spread))
    }
    assert hits["kv"] > 1.5 * hits["rr"]
    assert kv.summary()["ttft_s_p50"] < spread.summary()["ttft_s_p50"]
    assert all(s.end > s.first_token >= s.arrival for s in kv.served)


def test_prefill_and_decode_apart_move_the_kv_and_continue_the_request() -> None:
    prompt = list(range(300))
    request = [ServingRequest("a", 0.0, prompt, 6)]
    runs = {
        gbps: simulate_serving(request, MODEL, prefill=1, kv_bytes_per_token=1e6, kv_gbps=gbps)
        for gbps in (8.0, 16.0)
    }
    slow, fast = runs[8.0], runs[16.0]
    (a,) = slow.served
    assert a.path == "disaggregated" and slow.kv_bytes == 300e6
    prefill = MODEL.seconds(prefill_tokens=300, prefill_pairs=300 * 301 // 2)
    # 300 MB at 1 GB/s, then at 2 GB/s: the first token and the end move by the difference
    assert a.ttft - fast.served[0].ttft == pytest.approx(0.3 - 0.15, abs=1e-8)
    assert a.end - fast.served[0].end == pytest.approx(0.3 - 0.15, abs=1e-8)
    # the decode side computes only what the handed-off blocks do not hold: the last partial
    # block (300 = 18 full blocks of 16 + 12); it samples the first token there (the prefill
    # side's is thrown away, as Generator.prefill's), then decodes
    tail = MODEL.seconds(prefill_tokens=12, prefill_pairs=12 * 288 + 12 * 13 // 2)
    assert a.ttft == pytest.approx(prefill + 0.3 + tail, abs=1e-8)
    decodes = sum(MODEL.seconds(decodes=1, decode_pairs=300 + i) for i in range(1, 6))
    decodes += MODEL.after_prefill_s
    assert a.end == pytest.approx(prefill + 0.3 + tail + decodes, abs=1e-8)


def test_the_serving_paths_own_costs_delay_what_they_precede() -> None:
    prompt = list(range(300))
    one = [ServingRequest("a", 0.5, prompt, 6)]
    base = simulate_serving(one, MODEL).served[0]
    late = simulate_serving(one, MODEL, request_s=0.004).served[0]
    assert late.ttft == pytest.approx(base.ttft + 0.004, abs=1e-8)
    assert late.end == pytest.approx(base.end + 0.004, abs=1e-8)
    apart = {h: simulate_serving(one, MODEL, prefill=1, handoff_s=h).served[0] for h in (0, 0.02)}
    assert apart[0.02].ttft == pytest.approx(apart[0].ttft + 0.02, abs=1e-8)
    for bad in ({"request_s": -1.0}, {"handoff_s": float("nan")}):
        with pytest.raises(ValueError, match="seconds >= 0"):
            simulate_serving(one, MODEL, **bad)


def test_generators_and_the_serving_paths_threads_share_the_hosts_cores() -> None:
    pair = [ServingRequest(n, 0.5, list(range(k, k + 100)), 5) for n, k in (("a", 0), ("b", 500))]
    apart = simulate_serving(pair, MODEL, generators=2, policy="round_robin")
    alone = simulate_serving(pair, MODEL, generators=2, policy="round_robin", cpus=2)
    shared = simulate_serving(pair, MODEL, generators=2, policy="round_robin", cpus=1)
    took = {
        name: [s.end - s.arrival for s in run.served]
        for name, run in (("apart", apart), ("alone", alone), ("shared", shared))
    }
    assert {s.worker for s in shared.served} == {"decode0", "decode1"}
    assert took["alone"] == pytest.approx(took["apart"], abs=1e-8)
    assert took["shared"] == pytest.approx([2 * t for t in took["apart"]], abs=1e-8)
    # a token's work on the front door's thread shares the one core with the next step: each
    # step after a token is longer by that work; the first (the prefill) is not
    one = pair[:1]
    base = simulate_serving(one, MODEL, cpus=1).served[0]
    fed = simulate_serving(one, MODEL, cpus=1, token_cpu_s=[0.001]).served[0]
    assert fed.ttft == pytest.approx(base.ttft, abs=1e-8)
    assert fed.end == pytest.approx(base.end + 4 * 0.001, abs=1e-8)
    for bad in ({"token_cpu_s": [0.001]}, {"cpus": 1, "token_cpu_s": [-1.0]}):
        with pytest.raises(ValueError, match="token_cpu_s"):
            simulate_serving(one, MODEL, **bad)


def test_short_prompts_stay_on_their_decode_generator_and_slos_count_goodput() -> None:
    requests = workload(100, 30.0)
    short = [ServingRequest(f"s{i}", 0.01 * i, [1, 2, 3], 3) for i in range(10)]
    run = simulate_serving(
        [*requests, *short],
        MODEL,
        generators=2,
        prefill=1,
        kv_bytes_per_token=1e5,
        min_prefill_tokens=64,
    )
    paths = run.summary()["paths"]
    assert paths == {"disaggregated": 100, "prefilled_on_decode": 10}
    loose, tight = run.summary(1.0, 1.0), run.summary(1e-4, 1e-4)
    assert loose["slo_attainment"] == 1.0 and tight["slo_attainment"] == 0.0
    assert loose["goodput_per_s"] == pytest.approx(loose["requests_per_s"])


def test_bad_runs_are_refused() -> None:
    one = [ServingRequest("a", 0.0, [1, 2], 2)]
    with pytest.raises(ValueError, match="generators"):
        simulate_serving(one, MODEL, generators=0)
    with pytest.raises(ValueError, match="repeat"):
        simulate_serving([*one, *one], MODEL)
    with pytest.raises(ValueError, match="policy"):
        simulate_serving(one, MODEL, policy="fastest")
    with pytest.raises(ValueError, match="never fit"):
        simulate_serving([ServingRequest("b", 0.0, [1] * 100, 100)], MODEL, num_blocks=4)


SCENARIO = """kind = "serving"
[profile]
builtin = "h100-llama3-8b"
[serving]
generators = 2
{extra}
[serving.workload]
requests = 40
rate = 20.0
prompt_tokens = [64, 256]
output_tokens = [32, 64]
"""


def test_a_scenario_runs_its_serving_on_one_hosts_cores(tmp_path: pathlib.Path) -> None:
    tpot = {}
    for name, extra in (
        ("own", ""),
        ("one core", "cpus = 1"),
        ("one core and tokens", "cpus = 1\ntoken_cpu_s = [0.001, 0.001]"),
    ):
        path = tmp_path / "s.toml"
        path.write_text(SCENARIO.format(extra=extra))
        metrics = run_scenario(load_scenario(str(path)))
        assert metrics["completed"] == 40
        tpot[name] = metrics["tpot_s_p50"]
    assert tpot["own"] < tpot["one core"] < tpot["one core and tokens"]
    for bad in ("token_cpu_s = [0.001]", "cpus = 1\ntoken_cpu_s = [true]", "cpus = 0"):
        path.write_text(SCENARIO.format(extra=bad))
        with pytest.raises(ConfigError, match=r"\[serving\]: (token_cpu_s|cpus) must be"):
            load_scenario(str(path))


def test_the_spill_rule_is_the_front_doors() -> None:
    assert sim_serving.should_spill is serving.should_spill  # type: ignore[attr-defined]
    rule = serving.should_spill
    assert not rule(None, 100, 0)  # off
    assert not rule(4, 3, 0)  # the decode pool is not full
    assert rule(4, 4, 3) and rule(4, 9, 0)  # full, and the prefill side has fewer
    assert not rule(4, 4, 4) and not rule(4, 5, 7)


def test_a_full_decode_pool_spills_whole_requests_to_the_prefill_pool(
    tmp_path: pathlib.Path,
) -> None:
    rng = random.Random(1)
    at, requests = 0.0, []
    for i in range(120):  # decode-heavy: long answers to short-ish prompts
        at += rng.expovariate(20.0)
        requests.append(ServingRequest(f"r{i}", at, [rng.randrange(300) for _ in range(80)], 200))
    split = simulate_serving(requests, MODEL, prefill=1)
    spill = simulate_serving(requests, MODEL, prefill=1, spill_at=8)
    assert split.summary()["paths"] == {"disaggregated": 120}
    paths = spill.summary()["paths"]
    assert paths["spilled"] > 0 and paths["spilled"] + paths["disaggregated"] == 120
    for s in spill.served:  # served whole where the rule sent it, every token out
        assert s.worker.startswith("prefill" if s.path == "spilled" else "decode")
        assert s.end > s.first_token > s.arrival
    assert spill.summary()["tpot_s_p50"] < split.summary()["tpot_s_p50"]
    assert spill.summary()["output_tokens_per_s"] > split.summary()["output_tokens_per_s"]
    with pytest.raises(ValueError, match="spill_at"):
        simulate_serving(requests, MODEL, prefill=1, spill_at=0)
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO.format(extra="prefill = 1\nspill_at = 2"))
    assert run_scenario(load_scenario(str(path)))["completed"] == 40
    for bad in ("spill_at = 0", "spill_at = true", 'spill_at = "4"'):
        path.write_text(SCENARIO.format(extra=bad))
        with pytest.raises(ConfigError, match=r"\[serving\]: spill_at must be"):
            load_scenario(str(path))
