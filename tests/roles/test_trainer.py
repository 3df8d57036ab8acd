"""The trainer role: GRPO steps, data parallel through the runtime's torch.distributed group,
checkpoints, and versioned weights."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
import torch

import orchestr as oc
from orchestr.roles._generate import token_logprobs
from orchestr.roles.trainer import Trainer, build_model

SMALL = {"d_model": 32, "n_heads": 2, "n_layers": 1, "d_ff": 64, "positions": "from_start"}
START = 6


def _batch(rows: range, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 10, (8, 12), generator=g)[list(rows)]
    model = build_model("orchestr.roles._model:TinyLM", SMALL, seed=3)
    with torch.no_grad():
        behaviour = token_logprobs(model, tokens, START)
    rewards = torch.rand(8, generator=g)[list(rows)]
    return {
        "tokens": tokens.tolist(),
        "start": START,
        "mask": torch.ones_like(behaviour).tolist(),
        "behaviour": behaviour.tolist(),
        "rewards": rewards.tolist(),
        "group_size": 2,
    }


async def test_data_parallel_replicas_stay_equal_and_match_one_process(
    ctx: oc.JobContext,
) -> None:
    kwargs = {"model_kwargs": SMALL, "seed": 3, "torch_threads": 1}
    pair = await ctx.spawn(Trainer, n=2, resources={"cpu": 0.5}, **kwargs)
    single = await ctx.spawn(Trainer, resources={"cpu": 0.5}, **kwargs)
    await ctx.init_distributed(pair)
    for step in range(3):
        halves = [_batch(range(0, 4), step), _batch(range(4, 8), step)]
        stats = await asyncio.gather(
            pair[0].train_step.call_one(halves[0]), pair[1].train_step.call_one(halves[1])
        )
        assert [s["version"] for s in stats] == [step + 1] * 2
        await single.train_step.call_one(_batch(range(8), step))
    digests = await pair.digest.call()
    assert digests[0]["digest"] == digests[1]["digest"]  # bitwise equal replicas
    assert [d["rank"] for d in digests] == [0, 1] and digests[0]["world_size"] == 2
    tokens = _batch(range(8))["tokens"]
    dp = torch.tensor(await pair[0].logprobs.call_one(tokens, START))
    one = torch.tensor(await single.logprobs.call_one(tokens, START))
    assert torch.allclose(dp, one, atol=1e-4)  # averaging halves = the whole batch


async def test_checkpoint_restore_and_publish(ctx: oc.JobContext, tmp_path: Any) -> None:
    trainer = await ctx.spawn(Trainer, model_kwargs=SMALL, seed=1, torch_threads=1)
    await trainer.train_step.call_one(_batch(range(8)))
    path = await trainer.checkpoint.call_one(str(tmp_path / "ckpt.pt"))
    saved = await trainer.digest.call_one()
    await trainer.train_step.call_one(_batch(range(8), seed=5))
    assert (await trainer.digest.call_one())["digest"] != saved["digest"]
    assert await trainer.restore.call_one(path) == 1
    assert await trainer.digest.call_one() == saved
    ref = await trainer.publish.call_one()
    assert ref.version == 1 and ref.nbytes > 0
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


async def test_bad_batches_and_models_are_refused(ctx: oc.JobContext) -> None:
    trainer = await ctx.spawn(Trainer, model_kwargs=SMALL, torch_threads=1)
    bad = _batch(range(8))
    bad["group_size"] = 3
    with pytest.raises(oc.ActorError, match="do not split into groups of 3"):
        await trainer.train_step.call_one(bad)
    with pytest.raises(oc.SpawnError, match="cannot import model factory"):
        await ctx.spawn(Trainer, "no.such:model")
