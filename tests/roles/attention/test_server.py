"""Attention servers: tasks whose keys are read one-sided from a pool where they live,
rebatched into one product, merged by the caller to the attention over all; and a generator
whose long decodes attend on two servers giving the tokens and log-probs of one engine."""

from __future__ import annotations

import asyncio
import math
import pathlib

import pytest
import torch

import orchestr as oc
from orchestr.roles import AttentionServer, Generator, Request, models
from orchestr.roles.attention import Shard, attend, layer_spans, merge
from orchestr.roles.generator._engines._paged import PagedEngine
from orchestr.roles.generator._runner._cache import KVCache
from tests.roles.generator.test_handoff import close
from tests.roles.generator.test_kv_offload import folder, prompt
from tests.roles.generator.test_paged_engine import drain

__all__ = ["folder"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(240)


def test_layer_spans_cover_a_layers_keys_then_values() -> None:
    # 4 planes (2 layers) of 10 blocks of 8 bytes: layer 1 is planes 1 and 3
    assert layer_spans([2, 3, 7], 1, (4, 80, 8)) == [
        (96, 16, 0),
        (136, 8, 16),
        (256, 16, 24),
        (296, 8, 40),
    ]


async def test_tasks_read_where_the_keys_live_and_are_rebatched(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    servers = await ctx.spawn(AttentionServer, n=2, torch_threads=1)
    model = models.load_model(folder)
    cfg = model.config
    kv = KVCache(model, 16, 4)
    gen = torch.Generator().manual_seed(0)
    for t in (*kv.keys, *kv.values):
        t.copy_(torch.randn(t.shape, generator=gen))
    pool = oc.Buffer(kv.memory)
    heads, dim = cfg.num_attention_heads, cfg.head_dim
    blocks = [5, 6, 9, 2, 3]  # a sequence of 19 tokens in five blocks of 4
    q = torch.randn(1, heads, dim, generator=gen)
    scale = 1 / math.sqrt(dim)

    def task(lo: int, hi: int) -> dict:  # type: ignore[type-arg]
        return {
            "q": q,
            "q_positions": [18],
            "source": pool,
            "layer": 1,
            "blocks": blocks[lo // 4 : -(-hi // 4)],
            "tokens": [lo, hi],
            "layout": list(kv.layout),
            "block_size": 4,
            "kv_heads": cfg.num_key_value_heads,
            "head_dim": dim,
            "dtype": "float32",
        }

    answers = await asyncio.gather(
        servers[0].attend.call_one([task(0, 8), task(8, 12)], scale),
        servers[1].attend.call_one([task(12, 19)], scale),
    )
    got, _ = merge([part for answer in answers for part in answer])
    keys = kv.keys[1][blocks].reshape(-1, cfg.num_key_value_heads, dim)[:19]
    values = kv.values[1][blocks].reshape(-1, cfg.num_key_value_heads, dim)[:19]
    want, _ = attend(Shard(q, keys, values), scale)
    assert torch.allclose(got, want, atol=1e-5)
    stats = await servers.stats.call()
    assert [s["tasks"] for s in stats] == [2, 1]
    assert stats[0]["batches"] == 1 and stats[0]["largest_batch"] == 2  # one product for two
    with pytest.raises(oc.ActorError, match="ValueError: tokens \\[0, 19\\) need 5 blocks"):
        await servers[0].attend.call_one([{**task(0, 19), "blocks": blocks[:3]}], scale)
    with pytest.raises(oc.ActorError, match="a task gives its keys"):
        await servers[0].attend.call_one([{"q": q}], scale)

    # a generator whose decodes past 40 tokens attend on the two servers
    remote = await ctx.spawn(
        Generator,
        checkpoint=str(folder),
        torch_threads=1,
        attention={"servers": servers, "min_tokens": 40},
        kv={"num_blocks": 64, "block_size": 16},
    )
    reqs = [
        Request(f"r{i}", prompt(n, salt=i), 12, temperature=1.0, seed=i, top_logprobs=1)
        for i, n in enumerate((20, 33, 90))  # the first crosses 40 while decoding
    ]
    done = await remote.generate.call_one(reqs)
    alone = PagedEngine(models.load_model(folder), num_blocks=64, block_size=16, model_id="m")
    alone.submit(reqs)
    want_c = drain(alone)
    for c in done:
        close(c, want_c[c.id])
    offloaded = (await remote.stats.call_one())["attention"]
    assert offloaded["offloaded_decodes"] > 0
    with pytest.raises(oc.SpawnError, match="unknown attention option"):
        await ctx.spawn(
            Generator,
            checkpoint=str(folder),
            attention={"servers": servers, "min": 3},
            name="bad",
        )
