"""The sharded trainer (FSDP2 over the mesh's process group): the replicated trainer's losses
and weights, a share of its memory, checkpoints written and read from shards."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import orchestr as oc
from orchestr.roles import (
    Generator,
    ShardedWeightsRef,
    TinyLM,
    TinyLMConfig,
    WeightLoader,
    models,
)
from orchestr.roles.rl._task import PAD
from orchestr.roles.trainer import LOAD_MODEL, publish_weights
from orchestr.roles.trainer._actor import Trainer
from tests.roles.trainer.batches import samples as _samples

# two layers (two FSDP units beside the root)
MODEL = {"d_model": 64, "n_heads": 2, "n_layers": 2, "d_ff": 128}
# micro-batches so small that the two halves of a batch need different numbers of them
UPDATE = {"micro_batch_tokens": 24}


def same_weights(
    got: torch.nn.Module, want: torch.nn.Module, key_bias: Callable[[str], slice | None]
) -> None:
    """Every tensor of ``got`` equals ``want``'s within float tolerance, but the key bias
    (``key_bias(name)``: its part of the tensor): its gradient is zero (softmax ignores what
    every key adds alike), so AdamW turns its rounding noise into steps, which two layouts
    round apart; each step moves it at most about lr (1e-3)."""
    expected = want.state_dict()
    for name, tensor in got.state_dict().items():
        other, keys = expected[name], key_bias(name)
        if keys is not None:
            assert (tensor[keys] - other[keys]).abs().max() < 3e-3, name
            tensor = torch.cat([tensor[: keys.start], tensor[keys.stop :]])
            other = torch.cat([other[: keys.start], other[keys.stop :]])
        torch.testing.assert_close(tensor, other, rtol=1e-5, atol=1e-6, msg=name)


def close(a: list[list[float]], b: list[list[float]]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=1e-5, atol=1e-5)


async def test_a_sharded_pair_trains_as_the_replicated_pair(
    ctx: oc.JobContext, tmp_path: Path
) -> None:
    kwargs = {"model_kwargs": MODEL, "seed": 3, "torch_threads": 1, "update": UPDATE}
    sharded = await ctx.spawn(Trainer, n=2, resources={"cpu": 0.5}, sharding="full", **kwargs)
    replicated = await ctx.spawn(Trainer, n=2, resources={"cpu": 0.5}, **kwargs)
    await ctx.init_distributed(sharded)
    await ctx.init_distributed(replicated)

    async def step(pair: oc.Mesh, batch: list[object]) -> list[dict[str, float]]:
        halves = (batch[:2], batch[2:])  # uneven: one rank runs more micro-batches
        return await asyncio.gather(*(pair[r].train_step.call_one(halves[r], 2) for r in (0, 1)))

    for i in range(3):
        batch = _samples(i)
        got, want = await step(sharded, batch), await step(replicated, batch)
        for key in ("loss", "grad_norm", "tokens", "entropy"):
            assert got[0][key] == pytest.approx(want[0][key], rel=1e-5, abs=1e-6), key
            assert got[1][key] == got[0][key]
    probe = [c for c, _ in _samples(7)]
    after_three = await sharded.completion_logprobs.call(probe)  # every member: collectives
    close(after_three[0], await replicated[0].completion_logprobs.call_one(probe))
    assert after_three[0] == after_three[1]
    digests = await sharded.digest.call()
    assert digests[0]["digest"] == digests[1]["digest"] and digests[0]["version"] == 3

    # published from the shards: each member its rows, a generator lays them together
    ref = await publish_weights(sharded, True)
    assert isinstance(ref, ShardedWeightsRef) and ref.version == 3 and len(ref.parts) == 2
    assert all(part.nbytes < 0.6 * ref.nbytes for part in ref.parts)
    generator = await ctx.spawn(Generator, model_kwargs=MODEL, torch_threads=1)
    assert (await generator.sync_weights.call_one(ref))["loaded"]
    assert (await generator.digest.call_one())["digest"] == digests[0]["digest"]
    await ctx.stop(generator)
    # the updated weights themselves, read here from both pairs' publishes, agree
    got_w, want_w = TinyLM(TinyLMConfig(**MODEL)), TinyLM(TinyLMConfig(**MODEL))
    assert await WeightLoader(borrow=False).load(got_w, ref)
    assert await WeightLoader(borrow=False).load(want_w, await publish_weights(replicated, False))
    d = MODEL["d_model"]
    same_weights(got_w, want_w, lambda name: slice(d, 2 * d) if name.endswith("qkv.bias") else None)

    # each rank holds half the parameters, gradients and AdamW moments (and a little padding)
    held = await sharded.memory.call()
    full = await replicated.memory.call()
    for mine, theirs in zip(held, full, strict=True):
        assert mine["model_states"] <= 0.6 * theirs["model_states"]
        assert mine["optimizer"] > 0 and mine["params"] > 0

    # a checkpoint from the shards, read back after one more step
    folder = str(tmp_path / "sharded")
    assert await sharded.checkpoint.call(folder) == [folder, folder]
    pieces = [name for name in os.listdir(folder) if name.endswith(".distcp")]
    assert len(pieces) == 2  # a file of pieces per rank
    await step(sharded, _samples(3))
    assert await sharded.completion_logprobs.call(probe) != after_three
    assert await sharded.restore.call(folder) == [3, 3]
    close((await sharded.completion_logprobs.call(probe))[0], after_three[0])
    # and the next step from it (after evaluations: gathered weights) is the replicated pair's
    got, want = await step(sharded, _samples(3)), await step(replicated, _samples(3))
    for key in ("loss", "grad_norm"):
        assert got[0][key] == pytest.approx(want[0][key], rel=1e-5, abs=1e-6), key
    with pytest.raises(oc.ActorError, match="sharded checkpoint: restore it with sharding"):
        await replicated[0].restore.call_one(folder)


async def test_a_sharded_pair_reads_only_its_rows_of_a_checkpoint(
    ctx: oc.JobContext, tmp_path: Path
) -> None:
    """A checkpoint's model is never whole on a sharded member: it holds nothing until its
    group exists, then its rows, read from the files. It trains as a replicated pair of the
    same checkpoint does."""
    # qwen2: biases and a tied head; an odd vocabulary, cut into uneven rows
    folder = models.make_tiny("qwen2", tmp_path / "m", layers=2, hidden=64, vocab=301)
    kwargs: dict[str, object] = {"model_factory": LOAD_MODEL, "update": UPDATE}
    kwargs |= {"model_kwargs": {"folder": folder}}
    kwargs |= {"torch_threads": 1, "pad_id": PAD}
    sharded = await ctx.spawn(Trainer, n=2, resources={"cpu": 0.5}, sharding="full", **kwargs)
    replicated = await ctx.spawn(Trainer, n=2, resources={"cpu": 0.5}, **kwargs)
    assert [m["params"] for m in await sharded.memory.call()] == [0, 0]  # shapes alone
    await ctx.init_distributed(sharded)
    await ctx.init_distributed(replicated)
    for i in range(2):
        halves = (_samples(i)[:2], _samples(i)[2:])
        got, want = [
            await asyncio.gather(*(pair[r].train_step.call_one(halves[r], 2) for r in (0, 1)))
            for pair in (sharded, replicated)
        ]
        for key in ("loss", "grad_norm"):
            assert got[0][key] == pytest.approx(want[0][key], rel=1e-5, abs=1e-6), key
    held, full = await sharded.memory.call(), await replicated.memory.call()
    for mine, theirs in zip(held, full, strict=True):
        assert 0.4 * theirs["params"] < mine["params"] < 0.6 * theirs["params"]
    got_w, want_w = models.load_model(folder), models.load_model(folder)
    assert await WeightLoader(borrow=False).load(got_w, await publish_weights(sharded, True))
    assert await WeightLoader(borrow=False).load(want_w, await publish_weights(replicated, False))
    same_weights(got_w, want_w, lambda name: slice(0, 1 << 30) if "k_proj.bias" in name else None)
    # files missing a tensor: refused at the spawn, before any group is formed
    from safetensors.torch import load_file, save_file

    await ctx.stop(sharded)
    await ctx.stop(replicated)
    weights = f"{folder}/model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if "layers.1.mlp" not in k}, weights)
    with pytest.raises(oc.SpawnError, match="missing tensor 'model.layers.1.mlp"):
        await ctx.spawn(Trainer, n=2, resources={"cpu": 0.5}, sharding="full", **kwargs)


async def test_bad_sharding_settings_are_refused(ctx: oc.JobContext) -> None:
    with pytest.raises(oc.SpawnError, match="sharding must be one of none, full"):
        await ctx.spawn(Trainer, model_kwargs=MODEL, sharding="half")
    alone = await ctx.spawn(Trainer, model_kwargs=MODEL, sharding="full", torch_threads=1)
    with pytest.raises(oc.ActorError, match="call ctx.init_distributed"):
        await alone.train_step.call_one(_samples(0), 2)
