"""The trainer role: GRPO steps on scored completions, data parallel through the runtime's
torch.distributed group, staleness, checkpoints, and versioned weights."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any

import pytest
import torch

import orchestr as oc
from orchestr.roles.trainer._actor import Trainer
from tests.roles.trainer.batches import SMALL, as_dicts
from tests.roles.trainer.batches import samples as _samples


async def test_data_parallel_replicas_stay_equal_and_match_one_process(
    ctx: oc.JobContext,
) -> None:
    kwargs = {"model_kwargs": SMALL, "seed": 3, "torch_threads": 1}
    pair = await ctx.spawn(Trainer, n=2, resources={"cpu": 0.5}, **kwargs)
    single = await ctx.spawn(Trainer, resources={"cpu": 0.5}, **kwargs)
    await ctx.init_distributed(pair)
    for step in range(3):
        batch = _samples(step)
        stats = await asyncio.gather(
            pair[0].train_step.call_one(batch[:4], 2), pair[1].train_step.call_one(batch[4:], 2)
        )
        assert [s["version"] for s in stats] == [step + 1] * 2
        alone = await single.train_step.call_one(batch, 2)
        # the shards' statistics are the whole batch's
        assert stats[0]["tokens"] == stats[1]["tokens"] == alone["tokens"]
        assert stats[0]["loss"] == pytest.approx(alone["loss"], abs=1e-6)
    digests = await pair.digest.call()
    assert digests[0]["digest"] == digests[1]["digest"]  # bitwise equal replicas
    assert [d["rank"] for d in digests] == [0, 1] and digests[0]["world_size"] == 2
    probe = _samples(7)
    dp = await pair[0].completion_logprobs.call_one([c for c, _ in probe])
    one = await single.completion_logprobs.call_one([c for c, _ in probe])
    for a, b in zip(dp, one, strict=True):  # summing the shards = the whole batch
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


async def test_data_parallel_options_divide_by_the_whole_batch(ctx: oc.JobContext) -> None:
    """Batch whitening (reinforce_pp), sequence means, the KL penalty, the overlong filter and
    micro-batches on a pair of replicas give the single trainer's numbers."""
    update = {
        "advantage": "reinforce_pp",
        "loss_agg": "seq_mean_token_mean",
        "kl_coef": 0.1,
        "overlong_filter": True,
        "micro_batch_tokens": 40,
    }
    kwargs = {"model_kwargs": SMALL, "seed": 3, "torch_threads": 1, "update": update}
    pair = await ctx.spawn(Trainer, n=2, resources={"cpu": 0.5}, **kwargs)
    single = await ctx.spawn(Trainer, resources={"cpu": 0.5}, **kwargs)
    await ctx.init_distributed(pair)
    batch = as_dicts(_samples(0), ref_shift=0.3)
    for i, sample in enumerate(batch):
        sample["finish_reason"] = "length" if i % 3 == 0 else "stop"
    stats = await asyncio.gather(
        pair[0].train_step.call_one(batch[:4], 2), pair[1].train_step.call_one(batch[4:], 2)
    )
    alone = await single.train_step.call_one(batch, 2)
    for key in ("loss", "kl", "entropy", "ratio_mean", "logprob_gap", "grad_norm"):
        assert stats[0][key] == stats[1][key] == pytest.approx(alone[key], abs=1e-6), key
    assert stats[0]["overlong_filtered"] == alone["overlong_filtered"] == 3
    assert stats[0]["tokens"] == alone["tokens"]
    probe = [c for c, _ in _samples(7)]
    dp = await pair[0].completion_logprobs.call_one(probe)
    one = await single.completion_logprobs.call_one(probe)
    for a, b in zip(dp, one, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


async def test_staleness_bound_refuses_old_samples(ctx: oc.JobContext) -> None:
    trainer = await ctx.spawn(Trainer, model_kwargs=SMALL, max_staleness=1, torch_threads=1)
    stats = await trainer.train_step.call_one(_samples(0, version=0), 2)
    assert (stats["version"], stats["staleness"], stats["oldest_version"]) == (1, 0, 0)
    stats = await trainer.train_step.call_one(_samples(1, version=0), 2)  # 1 - 0 <= 1
    assert stats["staleness"] == 1
    with pytest.raises(oc.ActorError, match="older than the trainer's version 2") as info:
        await trainer.train_step.call_one(_samples(2, version=0), 2)
    assert info.value.remote_type == "StaleWeightsError"
    assert (await trainer.digest.call_one())["version"] == 2  # nothing was trained


async def test_checkpoint_restore_and_publish(ctx: oc.JobContext, tmp_path: Any) -> None:
    schedule = {"lr_schedule": "cosine", "lr_steps": 2, "min_lr_ratio": 0.5}
    trainer = await ctx.spawn(Trainer, model_kwargs=SMALL, seed=1, torch_threads=1, **schedule)
    assert (await trainer.train_step.call_one(_samples(0), 2))["lr"] == pytest.approx(1e-3)
    path = await trainer.checkpoint.call_one(str(tmp_path / "ckpt.pt"))
    saved = await trainer.digest.call_one()
    # halfway down the cosine from 1e-3 to 0.5e-3
    assert (await trainer.train_step.call_one(_samples(1), 2))["lr"] == pytest.approx(0.75e-3)
    assert (await trainer.digest.call_one())["digest"] != saved["digest"]
    assert await trainer.restore.call_one(path) == 1
    assert await trainer.digest.call_one() == saved
    # the rate follows the restored version
    assert (await trainer.train_step.call_one(_samples(1), 2))["lr"] == pytest.approx(0.75e-3)
    assert await trainer.restore.call_one(path) == 1
    ref = await trainer.publish.call_one()
    assert ref.version == 1 and ref.nbytes > 0
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


async def test_bad_batches_and_settings_are_refused(ctx: oc.JobContext) -> None:
    trainer = await ctx.spawn(Trainer, model_kwargs=SMALL, torch_threads=1)
    before = await trainer.digest.call_one()
    batch = _samples(0)
    with pytest.raises(oc.ActorError, match="do not split into groups of 3"):
        await trainer.train_step.call_one(batch, 3)
    with pytest.raises(oc.ActorError, match="numeric reward"):
        await trainer.train_step.call_one([[c, "high"] for c, _ in batch], 2)
    with pytest.raises(oc.ActorError, match="needs prompt, tokens"):
        await trainer.train_step.call_one([{"tokens": [1], "reward": 1.0}] * 2, 2)
    with pytest.raises(oc.ActorError, match="empty batch"):
        await trainer.train_step.call_one([], 2)
    short = [(dataclasses.replace(c, sample_logprobs=c.sample_logprobs[:-1]), r) for c, r in batch]
    with pytest.raises(oc.ActorError, match="log-probs"):
        await trainer.train_step.call_one(short, 2)
    assert await trainer.digest.call_one() == before  # none of them touched the model
    with pytest.raises(oc.SpawnError, match="cannot import model factory"):
        await ctx.spawn(Trainer, "no.such:model")
    with pytest.raises(oc.SpawnError, match="lr_schedule must be one of constant, cosine, linear"):
        await ctx.spawn(Trainer, model_kwargs=SMALL, lr_schedule="step")
    with pytest.raises(oc.SpawnError, match="min_ratio in"):
        await ctx.spawn(Trainer, model_kwargs=SMALL, lr_schedule="cosine", min_lr_ratio=2.0)
    with pytest.raises(oc.SpawnError, match="updates must be >= 1"):
        await ctx.spawn(Trainer, model_kwargs=SMALL, update={"updates": 0})
    with pytest.raises(oc.SpawnError, match="refused"):
        await ctx.spawn(Trainer, model_kwargs={"d_model": 30, "n_heads": 4})
