"""A generator pool changes its layout (2 x tp1 -> 1 x tp2 -> 2 x tp1): the requests in flight
finish first, the new pool loads the trainer's published version over the data plane, and it
generates what the old one did."""

from __future__ import annotations

import asyncio
import pathlib

import pytest

import orchestr as oc
from orchestr.roles import Generator, Request, models
from orchestr.roles.rl import reshard_pool
from tests.roles.weight_actors import CheckpointTrainer


async def test_a_pool_changes_degree_between_steps(
    ctx: oc.JobContext, tmp_path: pathlib.Path
) -> None:
    folder = models.make_tiny("llama", tmp_path / "llama", vocab=301)
    trainer = await ctx.spawn(CheckpointTrainer, folder, name="trainer")
    ref = await trainer.step.call_one(1)
    spawn = {"checkpoint": folder, "kv": {"num_blocks": 64, "block_size": 4}}
    pool = await ctx.spawn(Generator, n=2, torch_threads=1, name="pool-a", **spawn)
    await asyncio.gather(*(pool[i].sync_weights.call_one(ref) for i in range(2)))
    probe = [Request(f"p{i}", list(range(10 + i, 30 + i)), 8, temperature=0.0) for i in range(2)]
    want = [c.tokens for c in await pool[0].generate.call_one(probe)]
    # requests in flight when the change is asked for finish on the old pool
    long = [Request(f"l{i}", list(range(5, 25)), 40, temperature=0.0, ignore_eos=True)
            for i in range(2)]  # fmt: skip
    flight = [asyncio.ensure_future(pool[i].generate.call_one([long[i]])) for i in range(2)]
    await asyncio.sleep(0.05)
    split, times = await reshard_pool(ctx, pool, 2, 1, ref, name="pool-b", **spawn)
    assert all(len(c.tokens) == 40 for f in flight for c in f.result())
    assert set(times) == {"drain_s", "stop_s", "spawn_s", "load_s", "total_s"}
    assert times["total_s"] >= times["spawn_s"] + times["load_s"]
    assert len(split) == 1
    digest = (await split.digest.call_one())["digest"]
    assert digest == await trainer.digest.call_one()  # the trained version, not the checkpoint's
    assert [c.tokens for c in await split.generate.call_one(probe)] == want
    back, _ = await reshard_pool(ctx, split, 1, 2, ref, name="pool-c", torch_threads=1, **spawn)
    assert len(back) == 2
    assert [c.tokens for c in await back[1].generate.call_one(probe)] == want
    with pytest.raises(oc.ConfigError, match="a pool of 0 generators"):
        await reshard_pool(ctx, back, 1, 0, ref)
    await trainer.close.call_one()
