"""A generator pool changes its layout (2 x tp1 -> 1 x tp2 -> 2 x tp1): the requests in flight
finish first, the new pool loads the trainer's published version over the data plane, and it
generates what the old one did."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib

import pytest

import orchestr as oc
from orchestr.roles import Generator, Request, models
from orchestr.roles.rl import (
    LLAMA_CONFIG,
    GRPOConfig,
    LayoutCosts,
    reshard_pool,
    run_grpo,
)
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


def _costs(**kw: float) -> LayoutCosts:
    """Costs where each decode iteration is reading the weights (a degree of 2 halves it) and
    the all-reduces cost what ``kw`` says."""
    base = {"base_s": 1e-3, "decode_s": 0.0, "attention_s": 0.0, "layers": 2, "row_bytes": 0.0}
    base |= {"allreduce_alpha_s": 0.0, "allreduce_byte_s": 0.0, "device_bytes": 1e12}
    base |= {"weight_bytes": 0.0, "kv_bytes_per_token": 1.0, "reshard_s": 0.0}
    return LayoutCosts(**(base | kw))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("start", "allreduce_s", "change"),
    [
        # reading the weights is every iteration's cost, and a degree of 2 halves it
        ((2, 1), 0.0, ("2xtp1", "1xtp2")),
        # each all-reduce costs more than reading the weights saves
        ((1, 2), 1e-3, ("1xtp2", "2xtp1")),
    ],
)
async def test_the_rl_job_reshards_its_pool_between_batches(
    ctx: oc.JobContext, start: tuple[int, int], allreduce_s: float, change: tuple[str, str]
) -> None:
    # after the first batch (the lengths the policy goes by) the costs call for the other
    # layout: the job re-shards and trains on
    llama = dataclasses.replace(LLAMA_CONFIG, steps=2, eval_every=2, seed=3, threads=1)
    generators, tp = start
    config = GRPOConfig(
        train=llama,
        generators=generators,
        generator_tp=tp,
        layout_degrees=(1, 2),
        layout_costs=_costs(allreduce_alpha_s=allreduce_s),
    )
    phases: list[str] = []
    result = await run_grpo(ctx, config, on_phase=phases.append)
    assert [r.step for r in result.steps] == [0, 1]
    [done] = result.layouts  # the measured change's seconds price the next: none follows
    assert (done["step"], done["from"], done["to"]) == (1, *change)
    new = int(change[1][-1])
    assert done["predicted_s"][str(new)] < done["predicted_s"][str(tp)]
    assert done["load_s"] > 0 and done["total_s"] >= done["spawn_s"] + done["load_s"]
    assert "reshard" in phases
    assert 0.0 <= result.generator_idle_frac < 1.0
    # the pool after the change took the trained weights: the last batch's samples are of
    # the version the trainer published before it
    assert result.steps[-1].max_lag == 0


def test_bad_layout_configs_are_refused() -> None:
    llama = dataclasses.replace(LLAMA_CONFIG, steps=3)
    bad = [
        ({"layout_degrees": (1, 2)}, "needs layout_costs"),
        ({"layout_degrees": (1, 3), "layout_costs": _costs()}, "dividing the pool's 2"),
        ({"layout_degrees": (2,), "layout_costs": _costs()}, "must include generator_tp"),
        ({"layout_costs": _costs()}, "set them too"),
        ({"generator_tp": 0}, "generator_tp must be"),
        ({"layout_degrees": (1, 2), "layout_costs": _costs(), "mode": "stream"}, "sync mode"),
        ({"layout_degrees": (1, 2), "layout_costs": _costs(), "layout_margin": 1.5}, "fraction"),
        (
            {"layout_degrees": (1, 2), "layout_costs": _costs(), "kill": ("generator@1",)},
            "kill another role",
        ),
    ]
    for options, match in bad:
        with pytest.raises(oc.ConfigError, match=match):
            GRPOConfig(train=llama, **options)
    with pytest.raises(oc.ConfigError, match="checkpoint model on the paged engine"):
        GRPOConfig(generator_tp=2)  # the digit task's TinyLM runs on the recompute engine
