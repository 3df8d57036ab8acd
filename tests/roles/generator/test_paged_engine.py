"""The paged engine keeps the recompute engine's contract: the same sampled tokens and
log-probs for the same requests, versions per token across weight loads (its KV kept or
recomputed), cancellation that frees blocks, and vLLM-named metrics; stop strings and the
likeliest tokens' log-probs in both engines."""

from __future__ import annotations

import asyncio
import pathlib
import urllib.request

import pytest
import torch

import orchestr as oc
from orchestr.roles import Completion, Generator, RecomputeEngine, Request, models
from orchestr.roles.generator._engines._paged import PagedEngine
from orchestr.roles.generator._runner._paged import AttentionMode
from orchestr.roles.generator._runner._token_choice import check_sampling, choose_tokens


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return pathlib.Path(models.make_tiny("llama", tmp_path_factory.mktemp("m") / "llama"))


def requests(tok: models.Tokenizer, n: int = 6, max_new: int = 24) -> list[Request]:
    texts = ["reverse 1 2 3 -> ", "the model is", "a", "please answer the user: reverse 4 5"]
    narrow = [(0, 1.0), (5, 1.0), (0, 0.8), (8, 0.9)]  # top_k, top_p
    out = []
    for i in range(n):
        k, p = narrow[i % len(narrow)]
        prompt = tok.encode(texts[i % len(texts)], special=True)
        out.append(Request(f"r{i}", prompt, max_new, seed=i, top_k=k, top_p=p))
    return out


def scrape(address: str | None) -> str:
    """A scrape every worker answered (one that is slow to answer is left out of a scrape,
    and counted: on a loaded machine the first may miss one)."""
    for _ in range(20):
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
            text: str = r.read().decode()
        if 'orchestr_scrape_workers{result="failed"} 0\n' in text:
            return text
    raise AssertionError(f"no scrape had every worker answer: {text}")


def series(text: str, name: str) -> float:
    """The value of the one sample line that starts with ``name`` (its labels in order)."""
    (line,) = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(line.rsplit(" ", 1)[1])


def drain(engine: RecomputeEngine | PagedEngine) -> dict[str, Completion]:
    done = {}
    while engine.has_work():
        for c in engine.step():
            done[c.id] = c
    return done


@pytest.mark.parametrize("attention", ["kernel", "torch"])
def test_the_same_tokens_and_logprobs_as_the_recompute_engine(
    folder: pathlib.Path, attention: AttentionMode
) -> None:
    model, tok = models.load_model(folder), models.Tokenizer(folder)
    reqs = requests(tok)
    reference = RecomputeEngine(model, max_batch=8, pad_id=0, vocab_size=model.config.vocab_size)
    reference.submit(reqs)
    want = drain(reference)
    paged = PagedEngine(
        model, num_blocks=48, block_size=4, max_batch=3, token_budget=9, attention=attention
    )
    paged.submit(reqs)  # another batch shape, chunked prefill, prefix hits
    got = drain(paged)
    assert got.keys() == want.keys()
    for rid, c in got.items():
        w = want[rid]
        assert c.tokens == w.tokens, rid
        diff = torch.tensor(c.logprobs) - torch.tensor(w.logprobs)
        assert diff.abs().max().item() < 1e-4
    metrics = paged.metrics()
    assert metrics["vllm:prefix_cache_hits"] > 0
    assert metrics["vllm:prefix_cache_queries"] >= metrics["vllm:prefix_cache_hits"]
    assert metrics["vllm:kv_cache_usage_perc"] == 0.0  # every block back
    ttft, itl = paged.take_latencies()
    assert len(ttft) == len(reqs) and len(ttft) + len(itl) == sum(
        len(c.tokens) for c in got.values()
    )
    assert paged.take_latencies() == ([], [])  # taken
    assert paged.stats().finished == len(reqs)
    assert paged.take_kv_events()


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_new_weights_mid_flight_record_each_tokens_version(
    folder: pathlib.Path, policy: str
) -> None:
    model, tok = models.load_model(folder), models.Tokenizer(folder)
    engine = PagedEngine(model, num_blocks=64, block_size=4, on_new_weights=policy)
    engine.submit(requests(tok, n=3, max_new=12))
    for _ in range(5):
        engine.step()
    state = {k: v + 0.01 for k, v in model.state_dict().items()}
    engine.load_weights(state, 1)
    done = drain(engine)
    for c in done.values():
        versions = c.versions
        assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
        assert c.version == 0
    preempted = engine.metrics()["vllm:num_preemptions"]
    assert preempted == (3 if policy == "recompute" else 0)
    with pytest.raises(ValueError, match="older than the loaded 1"):
        engine.load_weights(state, 0)
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights({}, 2)


def test_bad_requests_and_cancellation(folder: pathlib.Path) -> None:
    model, tok = models.load_model(folder), models.Tokenizer(folder)
    engine = PagedEngine(model, num_blocks=8, block_size=4)
    prompt = tok.encode("the model", special=True)
    with pytest.raises(
        ValueError, match="can never fit: it needs 10 blocks of 4 tokens; the cache has 8"
    ):
        engine.submit([Request("big", prompt, 36 - len(prompt) + 1)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([Request("x", [10**6], 4)])
    with pytest.raises(ValueError, match="already waiting or running"):
        engine.submit([Request("a", prompt, 4), Request("a", prompt, 4)])
    assert engine.request_ids() == []  # none of a refused batch is queued
    engine.submit([Request("a", prompt, 8), Request("b", prompt, 8)])
    engine.step()
    cancelled = engine.cancel("a")
    assert cancelled.finish_reason == "cancelled"
    with pytest.raises(KeyError, match="no request 'a'"):
        engine.cancel("a")
    drain(engine)
    assert engine.metrics()["vllm:kv_cache_usage_perc"] == 0.0
    with pytest.raises(ValueError, match="on_new_weights is 'keep' or 'recompute'"):
        PagedEngine(model, on_new_weights="drop")


def test_stop_strings_and_top_logprobs(folder: pathlib.Path) -> None:
    model, tok = models.load_model(folder), models.Tokenizer(folder)
    prompt = tok.encode("please answer the user: reverse 4 5", special=True)
    free = PagedEngine(model, num_blocks=32, block_size=4, detokenize=tok.decode)
    free.submit([Request("free", prompt, 40, temperature=0.0, top_logprobs=4)])
    (whole,) = drain(free).values()
    text = tok.decode(whole.tokens)
    # a stop string that ends inside the output, found by the token that completes it
    cut = next(i for i in range(6, len(whole.tokens)) if len(tok.decode(whole.tokens[:i])) > 8)
    head = tok.decode(whole.tokens[:cut])
    stop = head[-3:]
    at = text.find(stop)
    assert 0 <= at
    for engine in (
        PagedEngine(model, num_blocks=32, block_size=4, detokenize=tok.decode),
        RecomputeEngine(model, pad_id=0, vocab_size=model.config.vocab_size, detokenize=tok.decode),
    ):
        engine.submit([Request("s", prompt, 40, temperature=0.0, stop=["never here", stop])])
        (c,) = drain(engine).values()
        assert (c.finish_reason, c.stop_reason, c.text) == ("stop", stop, text[:at])
        assert c.tokens == whole.tokens[: len(c.tokens)]
        assert stop in tok.decode(c.tokens) and stop not in tok.decode(c.tokens[:-1])
        assert c.top_logprobs is None
    # top-n: the likeliest first, the greedy token at the head, values the untempered log-probs
    assert whole.top_logprobs is not None and len(whole.top_logprobs) == len(whole.tokens)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + whole.tokens]))[0, len(prompt) - 1 : -1]
    for i, top in enumerate(whole.top_logprobs):
        ids, values = list(top), list(top.values())
        assert len(ids) == 4 and ids[0] == whole.tokens[i] and values == sorted(values)[::-1]
        want = torch.log_softmax(logits[i].float(), dim=-1)[ids]
        assert (torch.tensor(values) - want).abs().max().item() < 1e-4
        assert abs(values[0] - whole.logprobs[i]) < 1e-6
    first = whole.tokens[0]  # greedy's first token, made the end-of-sequence one
    eng = RecomputeEngine(model, pad_id=0, vocab_size=model.config.vocab_size, eos_id=first)
    eng.submit(
        [
            Request("e", prompt, 5, temperature=0.0),
            Request("i", prompt, 5, temperature=0.0, ignore_eos=True),
        ]
    )
    ended = drain(eng)
    assert ended["e"].tokens == [first] and ended["e"].stop_reason == first
    assert ended["i"].tokens == whole.tokens[:5] and ended["i"].finish_reason == "length"
    bare = RecomputeEngine(model, pad_id=0, vocab_size=model.config.vocab_size)
    for bad, match in [
        ({"stop": ["x"]}, "stop strings need a tokenizer"),
        ({"stop": "x"}, "stop must be a list of strings"),
        ({"top_logprobs": 21}, r"top_logprobs must be an int in \[0, 20\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            bare.submit([Request("bad", prompt, 4, **bad)])
    with pytest.raises(ValueError, match="stop strings must have 1 to 256 characters"):
        free.submit([Request("bad", prompt, 4, stop=[""])])
    assert bare.request_ids() == free.request_ids() == []


async def test_a_generator_actor_serves_a_checkpoint_on_the_paged_engine(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    tok = models.Tokenizer(folder)
    reqs = requests(tok, n=4, max_new=10)
    reqs[0].stop, reqs[1].top_logprobs = [" the"], 3  # through the wire too
    kv = {"num_blocks": 32, "block_size": 4, "token_budget": 16}
    local = PagedEngine(models.load_model(folder), detokenize=tok.decode, **kv)
    local.submit(reqs)
    want = drain(local)
    gen = await ctx.spawn(Generator, checkpoint=str(folder), kv=kv, torch_threads=1)
    done = await gen.generate.call_one(reqs)
    assert {c.id: (c.tokens, c.text) for c in done} == {
        rid: (c.tokens, c.text) for rid, c in want.items()
    }
    got_top, want_top = next(c for c in done if c.id == "r1").top_logprobs, want["r1"].top_logprobs
    assert got_top is not None and want_top is not None and want["r0"].text is not None
    for got_row, want_row in zip(got_top, want_top, strict=True):  # int keys over the wire
        assert len(got_row) == 3 and all(type(k) is int for k in got_row)
        # (one thread there, two here: a near tie may order the tail differently)
        assert all(abs(got_row[k] - v) < 1e-4 for k, v in want_row.items() if k in got_row)
    stats = await gen.stats.call_one()
    assert stats["finished"] == len(reqs) and stats["running"] == 0
    # the engine's metrics, under vLLM's names, in the head's /metrics
    text = await asyncio.to_thread(scrape, ctx.metrics_address)
    tags = f'engine="Generator[0]",model_name="{folder}"'
    assert series(text, f"vllm:generation_tokens_total{{{tags}}}") == sum(
        len(c.tokens) for c in done
    )
    assert series(text, f'vllm:time_to_first_token_seconds_bucket{{{tags},le="+Inf"}}') == len(reqs)
    assert series(text, f"vllm:prefix_cache_queries_total{{{tags}}}") > 0
    assert series(text, f"vllm:kv_cache_usage_perc{{{tags}}}") == 0.0
    assert series(text, f"vllm:num_requests_running{{{tags}}}") == 0.0
    with pytest.raises(oc.SpawnError, match=r"unknown kv option\(s\) \[.blocks.\]"):
        await ctx.spawn(Generator, checkpoint=str(folder), kv={"blocks": 3}, name="bad")


def test_top_k_and_top_p_narrow_what_is_sampled() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    probs = torch.softmax(logits[0], dim=-1)
    top3 = set(probs.topk(3).indices.tolist())
    nucleus = []  # the likeliest tokens until their mass reaches 0.5
    for i in probs.argsort(descending=True).tolist():
        nucleus.append(i)
        if probs[nucleus].sum() >= 0.5:
            break
    for req, allowed in [
        (Request("k", [1], 1, top_k=3), top3),
        (Request("p", [1], 1, top_p=0.5), set(nucleus)),
        (Request("one", [1], 1, top_k=1), {int(logits.argmax())}),
    ]:
        seen = set()
        for seed in range(200):
            gen = torch.Generator().manual_seed(seed)
            (tok,), (lp,), (slp,), (top,) = choose_tokens(logits, [req], [gen])
            assert top is None  # not asked for
            seen.add(tok)
            kept = sorted(allowed)
            want = torch.log_softmax(logits[0, kept], dim=-1)[kept.index(tok)]
            assert abs(slp - want.item()) < 1e-5  # under the narrowed distribution
            assert abs(lp - torch.log_softmax(logits[0], dim=-1)[tok].item()) < 1e-6
        assert seen <= allowed and (len(seen) > 1 or len(allowed) == 1)
    for bad, match in [({"top_k": -1}, "top_k must be an int from 0"), ({"top_p": 0.0}, "top_p")]:
        with pytest.raises(ValueError, match=match):
            check_sampling(Request("x", [1], 1, **bad))
