"""Generators backed by a KV store: the blocks one computes are offloaded, and another serves a
prompt with that prefix computing only the blocks the store lacks, with the same tokens and
log-probs as computing it all. First the engine's half alone (blocks exported by one engine
and entered into another), then real generator actors and a real store."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal

import pytest
import torch

import orchestr as oc
from orchestr.roles import (
    Completion,
    Generator,
    KVNamespace,
    KVStore,
    Request,
    kv_block_bytes,
    models,
)
from orchestr.roles.generator._core._blocks import BlockPool, BlockStored, hash_block
from orchestr.roles.generator._core._scheduler import Scheduler
from orchestr.roles.generator._engines._paged import PagedEngine
from orchestr.roles.kvstore import KVWriter
from orchestr.roles.serving import FrontDoor, Load
from tests.roles.generator.test_paged_engine import drain

BLOCK = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return pathlib.Path(models.make_tiny("llama", tmp_path_factory.mktemp("m") / "llama"))


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + salt) % 380 + 5 for i in range(n)]


def run(engine: PagedEngine, reqs: list[Request]) -> dict[str, Completion]:
    engine.submit(reqs)
    return drain(engine)


def test_blocks_exported_by_one_engine_serve_another_exactly(folder: pathlib.Path) -> None:
    model = models.load_model(folder)
    a = PagedEngine(model, num_blocks=64, block_size=BLOCK, model_id="m")
    b = PagedEngine(models.load_model(folder), num_blocks=64, block_size=BLOCK, model_id="m")
    assert a.block_nbytes == kv_block_bytes(str(folder), BLOCK)
    a.keep_offload(True)
    p = prompt(100)  # 6 full blocks before its last token, 4 tokens past them
    first = run(a, [Request("x", p, 12, temperature=0.0)])["x"]
    version, keys, copies = a.take_offload()
    assert version == 0 and len(keys) >= 6 and len(copies) == len(keys)
    assert all(c.dtype == torch.uint8 and c.numel() == a.block_nbytes for c in copies)
    want, local = b.prefix_plan(p)
    assert want == keys[:6] and local == 0
    # b enters the first 4 only: it computes 100 - 64 tokens of the prompt
    assert b.adopt(p, want, 0, copies[:4]) == 64
    assert b.prefix_plan(p)[1] == 4
    second = run(b, [Request("y", p, 12, temperature=0.0)])["y"]
    assert second.tokens == first.tokens
    assert torch.allclose(torch.tensor(second.logprobs), torch.tensor(first.logprobs), atol=1e-5)
    assert b.metrics()["vllm:prefix_cache_hits"] == 64
    assert b.stats().tokens == (100 - 64) + 11  # the rest of the prompt, then 11 decodes
    # entering what is cached already, or after a prefix that is not: nothing
    assert b.adopt(p, want, 0, copies[:4]) == 0
    assert b.adopt(prompt(100, salt=1), b.prefix_plan(prompt(100, salt=1))[0], 2, copies[:2]) == 0
    with pytest.raises(ValueError, match="a block of this engine is"):
        b.adopt(p, want, 4, [torch.zeros(8, dtype=torch.uint8)])


def test_the_scheduler_enters_blocks_into_free_room_only() -> None:
    pool = BlockPool(6, 2)
    sched = Scheduler(pool, max_batch=4, token_budget=64, extra_keys=("m", 0))
    p = list(range(13))  # 6 full blocks before the last token
    keys = sched.prompt_keys(p)
    assert len(keys) == 6 and sched.cached_run(keys) == 0
    held = pool.allocate(2)  # another request holds two blocks: four are free
    first, blocks = sched.adopt(keys, p, 0, 6)
    assert first == 0 and len(blocks) == 4 and sched.cached_run(keys) == 4
    assert pool.num_free == 4  # entered blocks are free, cached, as a finished request's
    pool.release(held)
    # the next two, after the four: the four are held meanwhile, so the two free blocks the
    # holder left go first and the prefix stays cached
    first, blocks = sched.adopt(keys, p, 4, 2)
    assert first == 4 and len(blocks) == 2 and sched.cached_run(keys) == 6
    assert pool.num_free == 6 and all(r == 0 for r in pool.refs)
    events = pool.take_events()
    assert [len(e.block_hashes) for e in events if isinstance(e, BlockStored)] == [4, 2]
    assert pool.take_stored() == []  # entered from a store: not offloaded back


async def test_a_second_generator_onboards_a_prefix_the_first_computed(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    size = kv_block_bytes(str(folder), BLOCK)
    store = await ctx.spawn(KVStore, size, 64)
    gens = await ctx.spawn(
        Generator,
        n=2,
        checkpoint=str(folder),
        torch_threads=1,
        kv_store=KVWriter(store, "the deployment's key"),
        kv={"block_size": BLOCK, "num_blocks": 64},
    )
    p = prompt(200)  # 12 full blocks before the last token
    ask = {"prompt": p, "max_new_tokens": 16, "temperature": 0.0}
    (first,) = await gens[0].generate.call_one([{"id": "a", **ask}])
    model_id, keys = await _keys(gens[0], p)
    ns = KVNamespace(model_id, BLOCK, 0)
    for _ in range(1200):  # the offload runs after the step, on its own
        if (await store.match.call_one(ns, keys))["tokens"] == 12 * BLOCK:
            break
        await asyncio.sleep(0.05)
    assert (await store.match.call_one(ns, keys))["tokens"] == 12 * BLOCK
    (second,) = await gens[1].generate.call_one([{"id": "b", **ask}])
    assert second.tokens == first.tokens
    assert torch.allclose(torch.tensor(second.logprobs), torch.tensor(first.logprobs), atol=1e-5)
    metrics = await _metrics(gens[1])
    assert metrics["orchestr:kv_store_onboarded_tokens"] == 12 * BLOCK
    assert metrics["vllm:prefix_cache_hits"] == 12 * BLOCK
    stats = await gens[1].stats.call_one()
    assert stats["tokens"] == (200 - 12 * BLOCK) + 15  # only the missing block, then decodes
    assert (await _metrics(gens[0]))["orchestr:kv_store_offloaded_blocks"] >= 12
    # a generator of another job (no key) neither reads those blocks nor writes beside them
    other = await ctx.spawn(
        Generator,
        name="other",
        checkpoint=str(folder),
        torch_threads=1,
        kv_store=store,
        kv={"block_size": BLOCK, "num_blocks": 64},
    )
    (third,) = await other.generate.call_one([{"id": "c", **ask}])
    assert third.tokens == first.tokens  # computed there
    for _ in range(1200):
        metrics = await _metrics(other)
        if metrics["orchestr:kv_store_offload_dropped_blocks"] >= 1:
            break
        await asyncio.sleep(0.05)
    assert metrics["orchestr:kv_store_onboard_failures"] == 1  # its lease was refused
    assert metrics["orchestr:kv_store_onboarded_tokens"] == 0
    assert metrics["orchestr:kv_store_offload_dropped_blocks"] >= 1  # and its puts
    assert metrics["orchestr:kv_store_offloaded_blocks"] == 0
    # a generator whose engine has no paged cache refuses a store
    with pytest.raises(oc.SpawnError, match="backs the paged engine's prefix cache"):
        await ctx.spawn(Generator, kv_store=store)


async def test_steps_queued_behind_a_slow_store_go_as_one_put(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    store = await ctx.spawn(KVStore, kv_block_bytes(str(folder), BLOCK), 64)
    gen = await ctx.spawn(
        Generator,
        checkpoint=str(folder),
        torch_threads=1,
        kv_store=store,
        kv={"block_size": BLOCK, "num_blocks": 64},
    )
    pid = next(a.pid for a in await ctx.actors() if a.name == store.name)
    os.kill(pid, signal.SIGSTOP)  # the first put waits; what later steps cache queues
    try:  # a prompt under one block: nothing to look up in the store first
        (c,) = await gen.generate.call_one([Request("a", prompt(10), 80, temperature=0.0)])
    finally:
        os.kill(pid, signal.SIGCONT)
    # every 16th token fills a block: 5 steps each cached one (the last token's KV is never
    # computed)
    assert (10 + len(c.tokens) - 1) // BLOCK == 5
    for _ in range(600):
        if (await _metrics(gen))["orchestr:kv_store_offloaded_blocks"] == 5:
            break
        await asyncio.sleep(0.05)
    metrics = await _metrics(gen)
    assert metrics["orchestr:kv_store_offloaded_blocks"] == 5
    assert metrics["orchestr:kv_store_puts"] == 2  # the first, then the four queued as one
    assert metrics["orchestr:kv_store_offload_dropped_blocks"] == 0


async def _keys(gen: oc.Mesh, p: list[int]) -> tuple[str, list[bytes]]:
    """The generator's model id (the store's namespace names it) and the block keys its
    engine gives ``p`` (from the extra keys it reports)."""
    u = await gen.updates.call_one("keys", timeout_s=0)
    await gen.unsubscribe.call_one("keys")
    keys, parent = [], None
    for b in range((len(p) - 1) // u.block_size):
        parent = hash_block(parent, p[b * u.block_size : (b + 1) * u.block_size], u.extra_keys)
        keys.append(parent)
    return u.extra_keys[0], keys


async def _metrics(gen: oc.Mesh) -> dict[str, float]:
    u = await gen.updates.call_one("probe", timeout_s=0)
    await gen.unsubscribe.call_one("probe")
    return dict(u.metrics)


async def test_the_front_doors_router_counts_the_stores_blocks(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    store = await ctx.spawn(KVStore, kv_block_bytes(str(folder), BLOCK), 64)
    gens = await ctx.spawn(
        Generator,
        n=2,
        checkpoint=str(folder),
        torch_threads=1,
        kv_store=store,
        kv={"block_size": BLOCK, "num_blocks": 64},
    )
    p = prompt(200)
    async with FrontDoor(gens, router="kv", store=store) as front:
        deltas = [d async for d in front.stream(p, max_new_tokens=4, temperature=0.0)]
        assert deltas[-1].finish_reason == "length"
        hashes = front.block_hashes(p)
        assert len(hashes) == 12
        for _ in range(1200):  # offloaded, then read from the store's events
            best = front.router.choose(hashes)
            if (
                best.cached_blocks == 12
                and front.router.choose(hashes, {best.worker: Load(decode_blocks=100)}).store_blocks
                == 12
            ):
                break
            await asyncio.sleep(0.05)
        computed = front.router.choose(hashes)
        assert computed.cached_blocks == 12  # where it was computed: cached, the cheapest
        # the other generator, with the first one busy: no block cached, all 12 in the store
        busy = {computed.worker: Load(decode_blocks=100)}
        other = front.router.choose(hashes, busy)
        assert other.worker != computed.worker
        assert (other.cached_blocks, other.store_blocks) == (0, 12)
        assert other.cost == pytest.approx(12 * front.router.store_cost)
