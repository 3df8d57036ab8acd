"""The generator: its continuous-batching engine without threads, then the real actor."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable, Iterator

import pytest
import torch

import orchestr as oc
from orchestr.roles.generator import RecomputeEngine
from orchestr.roles.generator._actor import Generator
from orchestr.roles.generator._core._types import Completion, Request
from tests.roles.engine_actors import tiny_lm

FACTORY = "tests.roles.engine_actors:tiny_lm"


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Models this small run fastest on one thread, and a shared CI box punishes spinning."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return tiny_lm()


def fake_clock() -> Callable[[], float]:
    ticks = itertools.count()
    return lambda: float(next(ticks))


def run(engine: RecomputeEngine) -> list[tuple[int, Completion]]:
    """Step until idle; (step number from 1, completion) in finishing order."""
    out: list[tuple[int, Completion]] = []
    for n in itertools.count(1):
        if not engine.has_work():
            return out
        out += [(n, c) for c in engine.step()]
    raise AssertionError("unreachable")


def recomputed(m: torch.nn.Module, c: Completion) -> torch.Tensor:
    """log_softmax of the completion's tokens from one forward pass over prompt + tokens."""
    seq = torch.tensor([c.prompt + c.tokens])
    with torch.inference_mode():
        logp = torch.log_softmax(m(seq)[0].float(), dim=-1)
    positions = torch.arange(len(c.prompt) - 1, seq.shape[1] - 1)
    return logp[positions, torch.tensor(c.tokens)]


def assert_logprobs(m: torch.nn.Module, c: Completion, span: slice = slice(None)) -> None:
    diff = (recomputed(m, c)[span] - torch.tensor(c.logprobs)[span]).abs().max().item()
    assert diff < 1e-5, (c.id, diff)


# -- scheduling --------------------------------------------------------------------------------
def test_requests_join_and_leave_the_batch_every_step() -> None:
    e = RecomputeEngine(model(), max_batch=2, clock=fake_clock())
    e.submit([Request("a", [1], 3), Request("b", [2, 3], 1), Request("c", [4], 2)])
    assert [c.id for c in e.step()] == ["b"]  # b leaves at once...
    assert e.request_ids() == ["a", "c"]  # ...and c takes its slot at the next step
    e.step()
    assert sorted(c.id for c in e.step()) == ["a", "c"]
    assert not e.has_work() and e.step() == []
    s = e.stats()
    assert (s.steps, s.tokens, s.finished, s.running, s.waiting) == (3, 6, 3, 0, 0)
    assert s.mean_batch == 2.0


def test_waiting_requests_are_admitted_as_others_finish_and_do_not_wait_for_a_long_one() -> None:
    e = RecomputeEngine(model(), max_batch=2, clock=fake_clock())
    e.submit([Request("long", [1], 20)] + [Request(f"s{i}", [2], 2) for i in range(5)])
    done = run(e)
    assert [c.id for _, c in done] == ["s0", "s1", "s2", "s3", "s4", "long"]
    assert [n for n, _ in done] == [2, 4, 6, 8, 10, 20]
    assert all(len(c.tokens) == c.steps == 2 and c.finish_reason == "length" for _, c in done[:5])
    by_id = {c.id: c for _, c in done}
    # the fake clock ticks once per reading: queueing grows down the FIFO
    assert by_id["s0"].queue_s < by_id["s1"].queue_s < by_id["s4"].queue_s
    assert by_id["s4"].queue_s <= by_id["s4"].ttft_s <= by_id["s4"].latency_s
    assert e.stats().mean_batch == (5 * 2 + 20) / 20


def test_stop_token_ends_a_completion_and_is_kept() -> None:
    greedy = RecomputeEngine(model())
    greedy.submit([Request("g", [1, 2], 8, temperature=0)])
    tokens = run(greedy)[0][1].tokens
    stop = tokens[2]
    e = RecomputeEngine(model())
    e.submit([Request("g", [1, 2], 8, temperature=0, stop_token=stop)])
    c = run(e)[0][1]
    assert c.finish_reason == "stop" and c.tokens == tokens[: tokens.index(stop) + 1]
    e = RecomputeEngine(model(), eos_id=stop)  # the engine's eos applies when a request names none
    e.submit([Request("g", [1, 2], 8, temperature=0)])
    assert run(e)[0][1].tokens == c.tokens


def test_cancel_returns_what_was_generated() -> None:
    e = RecomputeEngine(model(), max_batch=1)
    e.submit([Request("run", [1], 10), Request("wait", [1], 10)])
    e.step()
    e.step()
    c = e.cancel("run")
    assert (c.finish_reason, len(c.tokens), c.version) == ("cancelled", 2, 0)
    w = e.cancel("wait")
    assert w.tokens == [] and w.ttft_s != w.ttft_s  # NaN: it never ran
    assert not e.has_work()


# -- what is recorded --------------------------------------------------------------------------
def test_recorded_logprobs_equal_a_separate_forward_pass() -> None:
    m = model()
    e = RecomputeEngine(m, max_batch=3)
    temps = [1.0, 0.7, 0.0, 1.5, 1.0, 0.0]
    e.submit(
        [
            Request(f"r{i}", list(range(1, 2 + 3 * i)), 6 + 4 * i, temperature=t, seed=i)
            for i, t in enumerate(temps)
        ]
    )
    done = [c for _, c in run(e)]
    assert len(done) == 6
    for c in done:
        assert_logprobs(m, c)
        t = temps[int(c.id[1:])]
        assert c.versions == [0] * len(c.tokens) and c.version == 0
        if t == 1.0:
            assert c.sample_logprobs == c.logprobs
        if t == 0.0:  # greedy: the argmax of the recomputed logits, with probability 1
            assert c.sample_logprobs == [0.0] * len(c.tokens)
            with torch.inference_mode():
                logits = m(torch.tensor([c.prompt + c.tokens]))[0]
            argmax = logits[len(c.prompt) - 1 : -1].argmax(-1).tolist()
            assert argmax == c.tokens


def test_a_requests_tokens_do_not_depend_on_its_batch() -> None:
    alone = RecomputeEngine(model())
    alone.submit([Request("x", [3, 1, 4], 24, seed=7)])
    ((_, x_alone),) = run(alone)
    crowd = RecomputeEngine(model(), max_batch=4)
    others = [Request(f"o{i}", [5] * (1 + 7 * i), 3 + 5 * i) for i in range(7)]
    crowd.submit([*others[:3], Request("x", [3, 1, 4], 24, seed=7), *others[3:]])
    x_crowd = next(c for _, c in run(crowd) if c.id == "x")
    assert x_crowd.tokens == x_alone.tokens
    assert max(abs(a - b) for a, b in zip(x_crowd.logprobs, x_alone.logprobs, strict=True)) < 1e-5
    other = RecomputeEngine(model())
    other.submit([Request("x", [3, 1, 4], 24, seed=8)])
    assert run(other)[0][1].tokens != x_alone.tokens
    by_id = RecomputeEngine(
        model(), seed=3
    )  # no seed: one from the engine's seed and the request id
    by_id.submit([Request("y", [3], 24)])
    again = RecomputeEngine(model(), seed=3)
    again.submit([Request("y", [3], 24)])
    assert run(by_id)[0][1].tokens == run(again)[0][1].tokens


def test_pause_load_resume_records_the_version_of_every_token() -> None:
    old, new = model(0), model(1)
    m = model(0)
    e = RecomputeEngine(m, max_batch=4)
    e.submit([Request("r", [1, 2], 10, seed=1)])
    for _ in range(4):
        assert e.step() == []
    e.pause()
    assert not e.has_work() and e.step() == []  # paused: nothing moves
    assert e.stats().steps == 4
    e.load_weights(new.state_dict(), 1)
    e.submit([Request("late", [1, 2], 3, seed=2)])  # queued while paused
    e.resume()
    done = {c.id: c for _, c in run(e)}
    r = done["r"]
    assert r.versions == [0] * 4 + [1] * 6 and r.version == 0
    assert_logprobs(old, r, slice(0, 4))
    assert_logprobs(new, r, slice(4, None))
    assert done["late"].versions == [1, 1, 1] and done["late"].version == 1
    assert_logprobs(new, done["late"])
    # without a pause, a load takes effect at the next step
    e.submit([Request("hot", [1], 4)])
    e.step()
    e.load_weights(old.state_dict(), 2)
    hot = run(e)[0][1]
    assert hot.versions == [1, 2, 2, 2] and hot.version == 1
    assert_logprobs(old, hot, slice(1, None))


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (Request("e", [], 4), "empty prompt"),
        (Request("z", [1], 0), "max_new_tokens must be an int from 1"),
        (Request("v", [1, 99], 4), "outside the vocabulary"),
        (Request("f", [1, 1.5], 4), "is not an int"),  # type: ignore[list-item]
        (Request("t", [1], 4, temperature=-1.0), "temperature must be >= 0"),
        (Request("s", [1], 4, stop_token=32), "stop_token of 's'.*outside the vocabulary"),
        (Request("", [1], 4), "string of 1 to 256 characters"),
        (Request("l", [1] * 500, 20), "exceeds the model's max_seq_len 512"),
        # every field at values no kernel type holds, or that are not numbers at all
        *(
            (Request("k", [1], 4, top_k=k), "top_k must be an int from 0")
            for k in (2**63, 2**64, -(2**63), 10**30, -1, True, 1.5)
        ),
        *(
            (Request("t", [1], 4, temperature=t), "temperature must be >= 0 and finite")
            for t in (math.nan, math.inf, -math.inf, 10**400, -(2**63), "1")
        ),
        *(
            (Request("p", [1], 4, top_p=p), r"top_p must be in \(0, 1\]")
            for p in (math.nan, math.inf, 0.0, 2**64, -1.0)
        ),
        *(
            (Request("m", [1], m), "max_new_tokens must be an int from 1 to 2\\*\\*31-1")
            for m in (2**31, 2**63, 2**64, -(2**63), 4.0)
        ),
        *(
            (Request("x", [1], 4, seed=x), "seed must be a 64-bit integer")
            for x in (2**64, -(2**63) - 1, 10**30, 1.5, True)
        ),
        *(
            (Request("n", [1], 4, top_logprobs=n), "top_logprobs must be an int in")
            for n in (21, 2**63, -1)
        ),
        (Request("v2", [1, 2**63], 4), "outside the vocabulary"),
        (Request("v3", [1, -(2**63)], 4), "outside the vocabulary"),
        (Request("s2", [1], 4, stop_token=2**64), "outside the vocabulary"),
        (Request("i", [1], 4, ignore_eos=1), "ignore_eos must be a bool"),
        (Request("c", [1], 4, cache_salt=""), "cache_salt must be a string of 1 to 256"),
        (Request("c2", [1], 4, cache_salt="x" * 257), "cache_salt must be a string of 1 to 256"),
        (Request("y" * 257, [1], 4), "string of 1 to 256 characters"),
        (Request("st", [1], 4, stop=["x"] * 17), "at most 16 stop strings"),
        (Request("sl", [1], 4, stop=["x" * 257]), "stop strings must have 1 to 256 characters"),
    ],
)
def test_bad_requests_are_refused_and_none_is_queued(request_: Request, message: str) -> None:
    e = RecomputeEngine(model())
    with pytest.raises(ValueError, match=message):
        e.submit([Request("ok", [1], 4), request_])
    assert e.request_ids() == []


def test_the_choices_of_one_request_hold_one_list_of_stop_strings() -> None:
    from orchestr.roles.generator._engines._requests import Intake

    intake = Intake(vocab=32, max_len=64, eos=frozenset(), seed=0, detokenize=str)
    stops = ["x" * 256] * 16
    lives = [intake.check(Request(f"c{i}", [1], 4, stop=list(stops)), 0.0) for i in range(8)]
    assert all(live.request.stop is lives[0].request.stop for live in lives)
    assert lives[0].request.stop == stops


def test_duplicate_and_unknown_ids() -> None:
    e = RecomputeEngine(model())
    e.submit([Request("a", [1], 2)])
    with pytest.raises(ValueError, match="'a' is already waiting or running"):
        e.submit([Request("a", [1], 2)])
    with pytest.raises(ValueError, match="'b' is already waiting or running"):
        e.submit([Request("b", [1], 2), Request("b", [1], 2)])
    with pytest.raises(KeyError, match="no request 'nope' is waiting or running"):
        e.cancel("nope")
    run(e)
    e.submit([Request("a", [1], 2)])  # a finished id can be used again


def test_weights_that_do_not_fit_change_nothing() -> None:
    m = model()
    e = RecomputeEngine(m, version=3)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    state = model(1).state_dict()
    with pytest.raises(ValueError, match="version 2 is older than the loaded 3"):
        e.load_weights(state, 2)
    with pytest.raises(ValueError, match=r"missing \['head.bias'\]"):
        e.load_weights({k: v for k, v in state.items() if k != "head.bias"}, 4)
    bad = dict(state, **{"head.bias": torch.zeros(7)})
    with pytest.raises(ValueError, match=r"state\['head.bias'\] has shape \(7,\)"):
        e.load_weights(bad, 4)
    assert e.version == 3
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_a_model_with_the_wrong_output_is_named() -> None:
    class Flat(torch.nn.Module):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return tokens.float()

    e = RecomputeEngine(Flat(), vocab_size=8)
    e.submit([Request("a", [1], 2)])
    with pytest.raises(TypeError, match=r"returned \(1, 1\); it must return logits"):
        e.step()


# -- the actor ---------------------------------------------------------------------------------
async def test_generator_actor_streams_completions_and_loads_weights_mid_stream(
    ctx: oc.JobContext,
) -> None:
    gen = await ctx.spawn(Generator, FACTORY, 0, 4, torch_threads=1)
    lengths = {"long": 300, "a": 2, "b": 4, "c": 8, "mid": 150, "d": 3}
    await gen.submit.call_one(
        [Request(k, [1, 2, 3], n, seed=i) for i, (k, n) in enumerate(lengths.items())]
    )
    streamed = await gen.next_completed.call_one(8, 30.0)
    await gen.pause.call_one()
    stats = await gen.stats.call_one()
    assert stats["paused"] and stats["running"] >= 1  # "long" is still going
    new = model(1)
    await gen.load_weights.call_one(new.state_dict(), 1)
    await gen.resume.call_one()
    while len(streamed) < len(lengths):
        streamed += await gen.next_completed.call_one(8, 30.0)
    # max_batch 4: slots free up as short ones finish; the long one finishes last
    assert [c.id for c in streamed] == ["a", "b", "d", "c", "mid", "long"]
    by_id = {c.id: c for c in streamed}
    assert [len(by_id[k].tokens) for k in lengths] == list(lengths.values())
    long = by_id["long"]
    switch = long.versions.index(1)
    assert long.versions == [0] * switch + [1] * (300 - switch) and long.version == 0
    assert_logprobs(model(0), long, slice(0, switch))  # the actor built the same weights
    assert_logprobs(new, long, slice(switch, None))

    out = await gen.generate.call_one(
        [Request("g1", [5], 5, seed=1), {"id": "g2", "prompt": [6, 7], "max_new_tokens": 3}]
    )
    assert [(c.id, len(c.tokens), c.version) for c in out] == [("g1", 5, 1), ("g2", 3, 1)]
    assert await gen.next_completed.call_one(8, 0.05) == []  # generate's own do not stream
    with pytest.raises(oc.ActorError, match="empty prompt") as info:
        await gen.submit.call_one([Request("e", [], 3)])
    assert info.value.remote_type == "ValueError"
    with pytest.raises(oc.ActorError, match="no request 'nope'") as info:
        await gen.cancel.call_one("nope")
    assert info.value.remote_type == "KeyError"
    assert (await gen.stats.call_one())["finished"] == 8
    await gen.aclose.call_one()
    await gen.aclose.call_one()
    with pytest.raises(oc.ActorError, match="generator was closed") as info:
        await gen.submit.call_one([Request("x", [1], 3)])
    assert info.value.remote_type == "ClosedResourceError"


# -- the actor's shell, in this process --------------------------------------------------------
async def test_a_cancelled_generate_call_drops_its_requests() -> None:
    g = Generator(FACTORY, 0, 3)
    call = asyncio.ensure_future(g.generate([Request("slow", [1], 500), Request("s2", [1], 500)]))
    await asyncio.sleep(0)  # let it submit
    await g.submit([Request("probe", [1], 2)])
    assert [c.id for c in await g.next_completed(8, 10.0)] == ["probe"]  # they are running
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await g.submit([Request("after", [1], 2)])
    (after,) = await g.next_completed(8, 10.0)  # the cancelled ones never stream
    assert after.id == "after"
    stats = await g.stats()
    assert (stats["running"], stats["waiting"], stats["finished"]) == (0, 0, 4)
    await g.aclose()


async def test_an_engine_failure_reaches_every_caller() -> None:
    g = Generator("tests.roles.engine_actors:broken_lm")
    with pytest.raises(RuntimeError, match="engine failed.*the model broke"):
        await g.generate([Request("a", [1], 2)])
    with pytest.raises(RuntimeError, match="engine failed.*the model broke"):
        await g.submit([Request("b", [1], 2)])
    await g.aclose()
