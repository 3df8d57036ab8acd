"""Prefill/decode handoff: one generator computes a prompt and holds its KV blocks under a
lease, another reads them one-sided from the first one's memory and continues the request,
with the tokens and log-probs of one engine doing it all. First the engines alone (the spans
of held blocks copied by hand), then real generator actors: a decode side that already holds
part of the prefix, a lease nobody reads, and a prefill generator killed before the read."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import time
from typing import Any

import pytest
import torch

import orchestr as oc
from orchestr.roles import (
    Completion,
    Generator,
    Handoff,
    HandoffOptions,
    Request,
    kv_block_bytes,
    models,
)
from orchestr.roles.generator._core._types import as_handoff
from orchestr.roles.generator._engines._paged import PagedEngine
from orchestr.roles.generator._runner._spans import block_spans
from tests.roles.generator.test_kv_offload import folder, prompt
from tests.roles.generator.test_paged_engine import drain

__all__ = ["folder"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(180)

BLOCK = 16


def engine(folder: pathlib.Path) -> PagedEngine:
    return PagedEngine(models.load_model(folder), num_blocks=64, block_size=BLOCK, model_id="m")


def close(a: Completion, b: Completion) -> None:
    assert a.tokens == b.tokens
    assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_block_spans_merge_runs_of_consecutive_blocks() -> None:
    # 2 planes of 10 rows of 4 bytes: blocks 3,4,5 are one run, 8 another
    assert block_spans([3, 4, 5, 8], 2, 40, 4) == [
        (12, 12, 0),
        (32, 4, 12),
        (52, 12, 16),
        (72, 4, 28),
    ]
    assert block_spans([], 2, 40, 4) == []


def test_held_blocks_read_by_another_engine_continue_the_request_exactly(
    folder: pathlib.Path,
) -> None:
    pre, dec, alone = engine(folder), engine(folder), engine(folder)
    p = prompt(100)  # 6 full blocks before its last token
    pre.submit([Request("p", p, 1, temperature=0.0)])
    drain(pre)
    keys, blocks = pre.hold_prefix(p)
    assert len(keys) == len(blocks) == 6
    # held: a burst of other prompts that needs every block cannot take them
    pre.submit([Request(f"o{i}", prompt(200, salt=i + 1), 1) for i in range(5)])
    drain(pre)
    assert pre.prefix_plan(p)[1] == 6  # still cached, as held
    spans = block_spans(blocks, *pre.kv_layout)
    assert len(spans) == pre.kv_layout[0]  # allocated one after another: one span a plane
    memory = pre.kv_memory.view(torch.uint8)
    data = torch.empty(len(blocks) * pre.block_nbytes, dtype=torch.uint8)
    for at, n, to in spans:
        data[to : to + n] = memory[at : at + n]
    want, local = dec.prefix_plan(p)
    assert want == keys and local == 0
    assert dec.adopt(p, want, 0, data) == 6 * BLOCK
    request = Request("r", p, 12, temperature=1.0, seed=7, top_logprobs=2)
    dec.submit([request])
    alone.submit([request])
    got, reference = drain(dec)["r"], drain(alone)["r"]
    close(got, reference)
    assert dec.stats().tokens == 100 - 6 * BLOCK + 11  # the prompt's last 4 tokens, 11 decodes
    # copied in place instead: straight from the pool into blocks reserved in another one
    inplace = engine(folder)
    inplace.submit([Request("other", prompt(40, salt=9), 1)])  # its blocks are not 0..5 there
    drain(inplace)
    reserved = inplace.reserve(want, 0, len(want))
    assert reserved[0] == 0 and len(reserved[2]) == 6 and reserved[2] != blocks
    inplace.copy_blocks_in(reserved[2], memory, blocks, pre.kv_layout[1])
    assert inplace.enter_reserved(p, want, reserved, keep=True) == 6 * BLOCK
    inplace.submit([request])
    close(drain(inplace)["r"], reference)
    pre.release_blocks(blocks)
    assert pre.metrics()["vllm:kv_cache_usage_perc"] == 0.0
    with pytest.raises(ValueError, match="a block of this engine is"):
        dec.adopt(p, want, 0, torch.zeros(5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="not a block pool of this layout"):
        inplace.copy_blocks_in([1], memory[:-1], [2], pre.kv_layout[1])
    with pytest.raises(ValueError, match="1 blocks here for 2 there"):
        inplace.copy_blocks_in([1], memory, [2, 3], pre.kv_layout[1])
    with pytest.raises(ValueError, match="outside its pool"):  # never read past the memory
        inplace.copy_blocks_in([1], memory, [64], pre.kv_layout[1])
    with pytest.raises(ValueError, match="outside its pool"):
        inplace.copy_blocks_in([-1], memory, [2], pre.kv_layout[1])


async def spawn(
    ctx: oc.JobContext, folder: pathlib.Path, name: str, kv: dict[str, Any] | None = None, **kw: Any
) -> oc.Mesh:
    return await ctx.spawn(
        Generator,
        name=name,
        checkpoint=str(folder),
        torch_threads=1,
        supervise="handle",
        kv={"num_blocks": 64, "block_size": BLOCK, **(kv or {})},
        **kw,
    )


async def handoff(pre: oc.Mesh, request: Request, hold_s: float = 10.0) -> Handoff:
    h: Handoff = await pre.prefill.call_one(request, hold_s=hold_s)
    return h.sent_from(pre)


async def usage(gen: oc.Mesh) -> float:
    u = await gen.updates.call_one("probe", timeout_s=0)
    await gen.unsubscribe.call_one("probe")
    return float(u.metrics["vllm:kv_cache_usage_perc"])


async def test_a_decode_generator_continues_what_a_prefill_generator_computed(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    pre, dec, alone = await asyncio.gather(
        *(spawn(ctx, folder, name) for name in ("prefill", "decode", "alone"))
    )
    shared = prompt(160)
    first = Request("a", shared + prompt(41, salt=3), 10, temperature=1.0, seed=3)
    second = Request("b", shared + prompt(57, salt=4), 10, temperature=0.0)
    for r in (first, second):
        h = await handoff(pre, r)
        assert h.tokens == (len(r.prompt) - 1) // BLOCK * BLOCK and h.lease > 0
        (got,) = await dec.generate.call_one([r], kv_from={r.id: h})
        (want,) = await alone.generate.call_one([r])
        close(got, want)
    stats = await dec.stats.call_one()
    assert stats["orchestr:kv_transfers"] == 2 and stats["orchestr:kv_transfer_failures"] == 0
    # the second request shares 10 blocks the decode side holds already: only 3 were read
    size = kv_block_bytes(str(folder), BLOCK)
    assert stats["orchestr:kv_transfer_bytes"] == (200 // BLOCK + 216 // BLOCK - 10) * size
    pre_stats = await pre.stats.call_one()
    assert pre_stats["orchestr:kv_handoff_leases"] == 2 and pre_stats["held"] == 0
    assert pre_stats["orchestr:kv_handoff_expired"] == 0
    assert await usage(pre) == 0.0 and await usage(dec) == 0.0


async def test_a_lease_nobody_reads_expires_and_a_late_reader_recomputes(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    pre, dec, strict = await asyncio.gather(
        spawn(ctx, folder, "prefill"),
        spawn(ctx, folder, "decode"),
        spawn(ctx, folder, "strict", handoff={"on_failure": "fail"}),
    )
    r = Request("late", prompt(120), 6, temperature=0.0)
    h = await handoff(pre, r, hold_s=0.05)
    deadline = time.monotonic() + 30
    while (await pre.stats.call_one())["held"]:
        assert time.monotonic() < deadline, "the lease never expired"
        await asyncio.sleep(0.05)
    assert (await pre.stats.call_one())["orchestr:kv_handoff_expired"] == 1
    # read after the expiry: the lease's end says so, what was read is not used
    (got,) = await dec.generate.call_one([r], kv_from={r.id: h})
    (want,) = await pre.generate.call_one([r])
    close(got, want)
    stats = await dec.stats.call_one()
    assert stats["orchestr:kv_transfer_failures"] == 1 and stats["orchestr:kv_transfers"] == 0
    assert stats["tokens"] == 120 + 5  # the whole prompt computed here
    assert await usage(pre) == 0.0
    # copied in place, then the lease's end refused: under "fail" the request is refused
    with pytest.raises(oc.ActorError, match="could not be read") as e:
        await strict.generate.call_one([r], kv_from={r.id: h})
    assert e.value.remote_type == "HandoffError"
    assert (await strict.stats.call_one())["orchestr:kv_transfer_failures"] == 1
    assert await usage(strict) == 0.0 and (await strict.stats.call_one())["waiting"] == 0


async def pid_of(ctx: oc.JobContext, mesh: oc.Mesh) -> int:
    return next(a.pid for a in await ctx.actors() if a.name == mesh.name)


async def test_a_prefill_generator_killed_before_the_read(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    pre, dec, strict = await asyncio.gather(
        spawn(ctx, folder, "prefill"),
        spawn(ctx, folder, "decode"),
        spawn(ctx, folder, "strict", handoff={"on_failure": "fail"}),
    )
    r = Request("k", prompt(90), 5, temperature=0.0)
    h = await handoff(pre, r)
    os.kill(await pid_of(ctx, pre), signal.SIGKILL)
    with pytest.raises(oc.ActorError, match="could not be read") as e:
        await strict.generate.call_one([r], kv_from={r.id: h})
    assert e.value.remote_type == "HandoffError"
    (got,) = await dec.generate.call_one([r], kv_from={r.id: h})  # recomputed there
    (want,) = await strict.generate.call_one([r])  # nothing was queued by the refused call
    close(got, want)
    assert (await dec.stats.call_one())["orchestr:kv_transfer_failures"] == 1
    assert await usage(dec) == 0.0 and await usage(strict) == 0.0


async def test_bad_handoffs_are_refused_clearly(ctx: oc.JobContext, folder: pathlib.Path) -> None:
    dec = await spawn(ctx, folder, "decode")
    r = Request("x", prompt(40), 2)
    with pytest.raises(oc.ActorError, match="kv_from names requests not submitted"):
        await dec.generate.call_one([r], kv_from={"other": {}})
    with pytest.raises(oc.ActorError, match="hold_s must be positive"):
        await dec.prefill.call_one(r, hold_s=0)
    with pytest.raises(oc.ConfigError, match="handoff on_failure is one of recompute, fail"):
        Generator(checkpoint=str(folder), handoff=HandoffOptions(on_failure="retry"))
    with pytest.raises(oc.ConfigError, match="handoff read is one of direct, staged, got 'copy'"):
        Generator(checkpoint=str(folder), handoff={"read": "copy"})
    with pytest.raises(oc.ConfigError, match=r"unknown handoff option\(s\) \['policy'\]"):
        Generator(checkpoint=str(folder), handoff={"policy": "fail"})
    toy = await ctx.spawn(Generator, name="toy")
    with pytest.raises(oc.ActorError, match="prefill hands off KV blocks of the paged engine"):
        await toy.prefill.call_one(Request("t", [1, 2, 3], 2))
    assert await usage(dec) == 0.0


def test_a_handoff_as_a_dict_still_reads_for_one_release_with_a_warning() -> None:
    h = Handoff(3, None, [5, 6], [b"a", b"b"], 4, 4096, 64, 32, 10.0, 2, source="prefill[0]")
    old = {
        "lease": 3,
        "buffer": None,
        "blocks": [5, 6],
        "keys": [b"a", b"b"],
        "planes": 4,
        "plane_bytes": 4096,
        "row_bytes": 64,
        "tokens": 32,
        "ttl": 10.0,
        "version": 2,
        "source": "prefill[0]",
    }
    with pytest.warns(DeprecationWarning, match=r"handoff.sent_from\(mesh\)"):
        assert as_handoff(old) == h
    assert as_handoff(h) is h
    with pytest.raises(ValueError, match=r"lacks \['lease'\] or has unknown \['leased'\]"):
        as_handoff({**{k: v for k, v in old.items() if k != "lease"}, "leased": 3})
    with pytest.raises(TypeError, match="a handoff is a Handoff"):
        as_handoff([3])
