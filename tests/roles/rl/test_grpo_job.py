"""The GRPO job over real actors: the controls, weight-sync equality, and the sync mode
reproducing the single-process reference. Learning in every mode (off-policy within the
staleness bound too), through the example while each role's worker is killed, is in
test_grpo_faults.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import sys

import pytest
import torch

import orchestr as oc
from orchestr.roles import (
    SMALL_CONFIG,
    Generator,
    GRPOConfig,
    LengthRanker,
    Request,
    Trainer,
    models,
    reverse_task,
    run_grpo,
    train,
)
from orchestr.roles._common._weightplan import weights_digest
from orchestr.roles.rl import LLAMA_CONFIG
from orchestr.roles.rl._reference import step_requests


@pytest.mark.timeout(180)
async def test_controls_through_the_roles(ctx: oc.JobContext) -> None:
    def config(scale: float, steps: int) -> GRPOConfig:
        tc = dataclasses.replace(SMALL_CONFIG, steps=steps, advantage_scale=scale, eval_every=20)
        return GRPOConfig(train=tc, mode="sync")

    # zeroed advantages (nothing to learn from) are the control of the learning tests through
    # run_rl and run_sft: test_rl_learning.py
    negated = await run_grpo(ctx, config(-1.0, 20))  # negated: it unlearns
    first = sum(r.reward for r in negated.steps[:10]) / 10
    assert negated.mean_reward(last=10) < first - 0.02
    assert negated.mean_reward(last=10) < negated.steps[0].reward - 0.03
    # each batch is in the job's event log too, where the head's dashboard draws its curves
    lines = (await asyncio.to_thread(pathlib.Path(ctx.events.path).read_text)).splitlines()
    logged = [e for e in map(json.loads, lines) if e["kind"] == "rl_step"]
    assert [(e["step"], e["reward"], e["mean_length"]) for e in logged] == [
        (r.step, r.reward, r.mean_length) for r in negated.steps
    ]


@pytest.mark.timeout(180)
async def test_sync_mode_reproduces_the_single_process_run(
    ctx: oc.JobContext, tmp_path: pathlib.Path
) -> None:
    # the main job's model: a Llama checkpoint the job makes, sampled on the paged engine.
    # One generator holding the whole batch and one trainer: the reference's computation,
    # bit for bit
    llama = dataclasses.replace(LLAMA_CONFIG, steps=4, eval_every=2, seed=5, threads=1)
    reference = await asyncio.to_thread(train, llama)  # roles run one torch thread each too
    export = str(tmp_path / "policy")
    one = await run_grpo(
        ctx, GRPOConfig(train=llama, generators=1, max_batch=512, export_dir=export)
    )
    assert [r.loss for r in one.steps] == [s.loss for s in reference.steps]
    assert [a for _, a, _ in one.evals] == [e.accuracy for e in reference.evals]
    assert one.final_digest == weights_digest(reference.model)
    # the trained policy, out as a Hugging Face folder: the same weights, bit for bit
    assert one.exported == export
    assert weights_digest(models.load_model(export)) == one.final_digest
    # TinyLM on the recompute engine, two generators and two data-parallel trainers: the
    # same samples and steps up to float rounding between batch shapes (a near-tie can flip a
    # rare token)
    tc = dataclasses.replace(SMALL_CONFIG, steps=3, eval_every=3, seed=5, threads=1)
    reference = await asyncio.to_thread(train, tc)
    two = await run_grpo(ctx, GRPOConfig(train=tc, generators=2, trainers=2))
    assert two.trainer_digests_equal
    for got, want in zip(two.steps, reference.steps, strict=True):
        assert got.reward == pytest.approx(want.mean_reward, abs=2e-3)
        assert got.loss == pytest.approx(want.loss, abs=2e-3)
    assert [a for _, a, _ in two.evals] == pytest.approx(
        [e.accuracy for e in reference.evals], abs=0.02
    )


async def test_weights_are_bitwise_equal_after_every_sync(ctx: oc.JobContext) -> None:
    tc = dataclasses.replace(SMALL_CONFIG, prompts_per_step=8)
    model = dataclasses.asdict(tc.model)
    trainer = await ctx.spawn(Trainer, model_kwargs=model, seed=1, torch_threads=1)
    gens = await ctx.spawn(Generator, model_kwargs=model, seed=2, torch_threads=1, n=2)
    assert (await gens[0].digest.call_one())["digest"] != (await trainer.digest.call_one())[
        "digest"
    ]  # different seeds: the first sync really moves the weights
    for step in range(3):
        ref = await trainer.publish.call_one()
        reports = await gens.sync_weights.call(ref)
        assert all(r["loaded"] and r["version"] == step for r in reports)
        want = await trainer.digest.call_one()
        for got in await gens.digest.call():
            assert (got["digest"], got["version"]) == (want["digest"], step)
        requests = step_requests(tc, step)
        half = len(requests) // 2
        done = await asyncio.gather(
            gens[0].generate.call_one(requests[:half]), gens[1].generate.call_one(requests[half:])
        )
        completions = [c for part in done for c in part]
        assert {c.version for c in completions} == {step}
        # on-policy: the trainer's log-probs of the generators' tokens are the recorded ones
        mine = await trainer.completion_logprobs.call_one(completions)
        gap = max(
            float((torch.tensor(m) - torch.tensor(c.logprobs)).abs().max())
            for m, c in zip(mine, completions, strict=True)
        )
        assert gap < 1e-4
        rewards = [reverse_task.reward(c.prompt[1:-1], c.tokens) for c in completions]
        await trainer.train_step.call_one(list(zip(completions, rewards, strict=True)), 8)
    # a ref of an older version is refused and changes nothing
    old = ref
    await gens.sync_weights.call(await trainer.publish.call_one())
    with pytest.raises(oc.ActorError, match="older than version 3") as info:
        await gens[0].sync_weights.call_one(old)
    assert info.value.remote_type == "StaleWeightsError"
    with pytest.raises(oc.ActorError, match="takes a WeightsRef"):
        await gens[0].sync_weights.call_one({"version": 9})


def test_length_ranker_learns_lengths_and_balances_the_pools() -> None:
    ranker = LengthRanker()
    short = Request("s", [1, 2, 3], max_new_tokens=8)
    assert ranker.predict(short.prompt, short.max_new_tokens) == 8.0  # the prior: the cap
    ranker.observe([1, 2, 3], 2)
    ranker.observe([4, 5, 6], 4)
    assert ranker.predict(short.prompt, 8) == 3.0
    requests = [Request(str(n), [0] * n, max_new_tokens=n) for n in (2, 16, 3, 12, 2, 2)]
    long = ranker.split(requests, 0.5)
    assert long == [False, True, False, False, False, False]  # 16 alone is half the work
    assert ranker.split(requests[:1], 0.1) == [True]  # at least one when there is any


def test_bad_job_configs_are_refused() -> None:
    with pytest.raises(oc.ConfigError, match="mode must be one of"):
        GRPOConfig(mode="async")
    with pytest.raises(oc.ConfigError, match="long_generators"):
        GRPOConfig(mode="stream+skew", generators=1)
    with pytest.raises(oc.ConfigError, match="split evenly"):
        GRPOConfig(train=dataclasses.replace(SMALL_CONFIG, prompts_per_step=5), trainers=2)
    with pytest.raises(oc.ConfigError, match="eta"):
        GRPOConfig(eta=-1)
    with pytest.raises(oc.ConfigError, match="engine 'paged' does not run this job's model"):
        GRPOConfig(engine="paged")  # a TinyLM runs on the recompute engine
    with pytest.raises(oc.ConfigError, match="engine 'recompute' does not run"):
        GRPOConfig(train=LLAMA_CONFIG, engine="recompute")
    with pytest.raises(oc.ConfigError, match="vllm options apply to engine='vllm'"):
        GRPOConfig(train=LLAMA_CONFIG, vllm={"block_size": 32})
    with pytest.raises(oc.ConfigError, match="export_dir writes a Hugging Face folder"):
        GRPOConfig(export_dir="out")  # a TinyLM is no Hugging Face format model


async def test_roles_run_on_the_backend_they_are_given(ctx: oc.JobContext) -> None:
    tc = dataclasses.replace(SMALL_CONFIG, prompts_per_step=4)
    model = dataclasses.asdict(tc.model)
    wide = {"name": "cpu", "dtype": "float64"}
    trainer = await ctx.spawn(Trainer, model_kwargs=model, backend=wide, torch_threads=1)
    gen = await ctx.spawn(Generator, model_kwargs=model, backend=wide, torch_threads=1)
    await gen.sync_weights.call_one(await trainer.publish.call_one())
    mine, theirs = await trainer.digest.call_one(), await gen.digest.call_one()
    assert (
        mine["backend"]
        == theirs["backend"]
        == {
            "name": "cpu",
            "device": "cpu",
            "dtype": "float64",
            "compiled": False,
        }
    )
    assert mine["digest"] == theirs["digest"]
    completions = await gen.generate.call_one(step_requests(tc, 0))
    logp = await trainer.completion_logprobs.call_one(completions)
    for m, c in zip(logp, completions, strict=True):
        assert torch.allclose(torch.tensor(m), torch.tensor(c.logprobs), atol=1e-4)
    rewards = [reverse_task.reward(c.prompt[1:-1], c.tokens) for c in completions]
    stats = await trainer.train_step.call_one(list(zip(completions, rewards, strict=True)), 8)
    assert stats["version"] == 1
    with pytest.raises(oc.SpawnError, match="cannot run on this node") as info:
        await ctx.spawn(Generator, model_kwargs=model, backend="cuda")
    assert "no GPU" in str(info.value) or "CUDA" in str(info.value)


@pytest.mark.timeout(240)
async def test_sync_mode_does_not_depend_on_timing(ctx: oc.JobContext) -> None:
    """Prompts go to generators by their place in the batch, never by which generator is
    free: the same seed run again while another process loads the machine gives the same
    weights, bit for bit."""
    tc = dataclasses.replace(SMALL_CONFIG, steps=4, eval_every=4, seed=7)
    config = GRPOConfig(train=tc, generators=2)
    quiet = await run_grpo(ctx, config)
    burner = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "while True: pass", stdout=asyncio.subprocess.DEVNULL
    )
    try:
        loaded = await run_grpo(ctx, config)
    finally:
        burner.kill()
        await burner.wait()
    assert loaded.final_digest == quiet.final_digest
    assert [r.loss for r in loaded.steps] == [r.loss for r in quiet.steps]
