"""A handoff streamed layer by layer: the decode side reads a prompt's KV while the prefill
side computes it. First the prefill side alone (everything it reports ready, copied at the
moment it says so, equals what the pool holds at the end; a change of weights mid-prefill
fails the stream), then real generator actors: the same tokens as one engine (read staged
as the prompt is computed, or copied in place once it is done), a prefill generator
SIGKILLed mid-stream, and a reader that lets the stream go."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import threading
from typing import Any

import pytest
import torch

import orchestr as oc
from orchestr.roles import Completion, Handoff, Request, kv_block_bytes, models
from orchestr.roles.generator._engines._paged import PagedEngine
from orchestr.roles.generator._kv._leases import Holds
from orchestr.roles.generator._runner._spans import block_spans, plane_spans
from orchestr.roles.kvstore import LeaseExpiredError
from tests.roles.generator.test_handoff import BLOCK, close, pid_of, spawn, usage
from tests.roles.generator.test_kv_offload import folder, prompt

__all__ = ["folder"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(180)

BUDGET = 32  # prompt tokens a step: a long prompt takes several steps


def test_plane_spans_put_blocks_in_their_places() -> None:
    # 4 planes of 10 rows of 4 bytes; blocks 3, 4 go to places 1, 2 of a copy of 3 blocks
    assert plane_spans([3, 4], [1, 2], [0, 2], 40, 4, 3) == [(12, 8, 4), (92, 8, 28)]
    # consecutive blocks to places that are not consecutive are two spans
    assert plane_spans([3, 4], [2, 0], [1], 40, 4, 3) == [(52, 4, 20), (56, 4, 12)]
    assert plane_spans([3, 4], range(2), range(4), 40, 4, 2) == block_spans([3, 4], 4, 40, 4)
    with pytest.raises(ValueError, match="outside a copy of 2"):
        plane_spans([3], [2], [0], 40, 4, 2)


def engine(folder: pathlib.Path, micro_batches: int = 1) -> PagedEngine:
    return PagedEngine(
        models.load_model(folder),
        num_blocks=64,
        block_size=BLOCK,
        token_budget=BUDGET,
        model_id="m",
        micro_batches=micro_batches,
    )


def step(e: PagedEngine, holds: Holds) -> list[Completion]:
    done = e.step()
    holds.after_step(e, done)
    return done


@pytest.mark.parametrize("micro_batches", [1, 2])
async def test_what_a_stream_reports_ready_never_changes_afterwards(
    folder: pathlib.Path, micro_batches: int
) -> None:
    # with 2 micro-batches a request decoding beside the prompt makes each step two halves
    # run at once, each calling the layer hook from its own thread
    e, holds = engine(folder, micro_batches), Holds()
    p = prompt(150)  # 9 full blocks before its last token, computed 32 tokens a step
    e.submit([Request("warm", p[:40], 1)])  # 2 of its blocks are cached already
    while e.has_work():
        step(e, holds)
    r = Request("p", p, 1, temperature=0.0)
    h = holds.stream(e, r, hold_s=10.0)
    assert h.stream and h.tokens == 9 * BLOCK and holds.leases == 1
    s = holds.streamed._running["p"]
    planes, plane_bytes, row_bytes = e.kv_layout
    layers = planes // 2
    memory = e.kv_memory.view(torch.uint8)
    seen: dict[tuple[int, int], torch.Tensor] = {}  # (block, plane) -> its bytes when reported
    running_reports = 0

    guard = threading.Lock()  # the hook runs in both micro-batches' threads

    def snapshot() -> None:
        with guard:
            copy_reported()

    def copy_reported() -> None:
        nonlocal running_reports
        with holds.streamed._lock:  # as a reader's progress call takes it
            v = s.view(layers)
        for i, block in enumerate(v["blocks"]):
            upto = layers if i < v["ready"] else v["written"]
            for layer in range(upto):
                for plane in (layer, layers + layer):
                    if (block, plane) not in seen:
                        at = plane * plane_bytes + block * row_bytes
                        seen[block, plane] = memory[at : at + row_bytes].clone()
                        running_reports += v["state"] == "running"

    inner = e._runner.on_layer
    assert inner is not None

    threads: set[int] = set()

    def hook(st: Any, layer: int) -> None:
        threads.add(threading.get_ident())
        inner(st, layer)
        snapshot()

    e._runner.on_layer = hook
    if micro_batches > 1:
        e.submit([Request("beside", prompt(20, salt=5), 40, temperature=0.0)])
    e.submit([r])
    steps = 0
    while s.state == "running":
        step(e, holds)
        snapshot()
        steps += 1
    # (150 - 32 cached) / 32 tokens a step; beside another prompt the first step shares
    assert steps == 4 + (micro_batches > 1)
    # the halves run at once where the kernels run (else one after the other)
    assert len(threads) == (micro_batches if e._runner.ops is not None else 1)
    while e.has_work():
        step(e, holds)
    assert s.state == "done" and s.keys == e.prefix_plan(p)[0] and len(s.blocks) == 9
    assert s.cursor > 4 * layers  # reported layer by layer, not once at the end
    assert len(seen) == 9 * planes and running_reports == len(seen)  # all before the end
    for (block, plane), was in seen.items():
        at = plane * plane_bytes + block * row_bytes
        assert torch.equal(memory[at : at + row_bytes], was)
    # the stream is now an ordinary lease: its reader ends it and the blocks go back
    assert e.metrics()["vllm:kv_cache_usage_perc"] > 0
    holds.end_now(h.lease)  # as a step may be running: held until the next gap
    assert holds.leases == 0 and holds.ending and e.metrics()["vllm:kv_cache_usage_perc"] > 0
    holds.release_ended(e)
    assert not holds.ending and e.metrics()["vllm:kv_cache_usage_perc"] == 0.0
    with pytest.raises(LeaseExpiredError, match="had expired"):  # ended already
        holds.end_now(h.lease)


async def test_new_weights_mid_prefill_fail_the_stream_and_free_its_blocks(
    folder: pathlib.Path,
) -> None:
    now = [0.0]
    e, holds = engine(folder), Holds(clock=lambda: now[0])
    r = Request("p", prompt(150), 1, temperature=0.0)
    h = holds.stream(e, r, hold_s=10.0)
    e.submit([r])
    step(e, holds)
    e.set_version(1)  # on_new_weights="keep": the prompt's blocks mix two versions now
    while e.has_work():
        step(e, holds)
    progress = await holds.streamed.wait(h.lease, -1)
    assert progress["state"] == "failed" and "weights changed" in progress["error"]
    assert progress["blocks"] == [] and holds.leases == 0
    assert e.metrics()["vllm:kv_cache_usage_perc"] == 0.0
    with pytest.raises(ValueError, match="after is a cursor"):
        await holds.streamed.wait(h.lease, "0")
    # its reader never came: the record goes once its time has passed
    now[0] += 11.0
    assert holds.expire(e) == 0  # no blocks were left to release
    with pytest.raises(LeaseExpiredError):
        await holds.streamed.wait(h.lease, -1)
    assert holds.streamed.release(e, h.lease) is None  # gone: nothing to stop


async def streamed(pre: oc.Mesh, request: Request) -> Handoff:
    h: Handoff = await pre.prefill.call_one(request, stream=True)
    return h.sent_from(pre)


@pytest.mark.parametrize("kv_read", ["staged", "direct"])
async def test_a_streamed_handoff_continues_the_request_as_one_engine(
    ctx: oc.JobContext, folder: pathlib.Path, kv_read: str
) -> None:
    kv = {"num_blocks": 64, "block_size": BLOCK, "token_budget": BUDGET}
    pre, dec, alone = await asyncio.gather(
        spawn(ctx, folder, "prefill", kv={**kv, "num_blocks": 256}),
        spawn(ctx, folder, "decode", kv=kv, handoff={"read": kv_read}),
        spawn(ctx, folder, "alone", kv=kv),
    )
    # the prefill generator keeps stepping another request meanwhile: a stream is granted
    # between its steps, in the lock that queues its request
    busy = asyncio.ensure_future(
        pre.generate.call_one([Request("busy", prompt(20, salt=9), 3000, temperature=0.0)])
    )
    for r in (
        Request("a", prompt(300, salt=1), 8, temperature=1.0, seed=5, top_logprobs=2),
        Request("b", prompt(300, salt=1)[:200] + prompt(30, salt=2), 8, temperature=0.0),
    ):
        h = await streamed(pre, r)
        assert h.stream and h.blocks == []  # granted before any of it was computed
        (got,) = await dec.generate.call_one([r], kv_from={r.id: h})
        (want,) = await alone.generate.call_one([r])
        close(got, want)
    stats = await dec.stats.call_one()
    assert stats["orchestr:kv_transfers"] == 2 and stats["orchestr:kv_transfer_failures"] == 0
    exposed, seconds = (stats[f"orchestr:kv_transfer{k}seconds"] for k in ("_exposed_", "_"))
    if kv_read == "staged":
        assert stats["orchestr:kv_transfer_reads"] > 2  # read as computed, not once at the end
        assert 0 <= exposed <= seconds
    else:  # one copy each, into the pool, once the prompt was done
        assert stats["orchestr:kv_transfer_reads"] == 2
        assert 0 < exposed == seconds
    # "b" shares 12 blocks with "a", held by the decode side already: it read 2
    size = kv_block_bytes(str(folder), BLOCK)
    assert stats["orchestr:kv_transfer_bytes"] == (18 + 2) * size
    assert not busy.done()  # it ran beside both streams (3,000 steps: seconds to go)
    await pre.reset.call_one()
    with pytest.raises(oc.ActorError, match="reset"):
        await busy
    pre_stats = await pre.stats.call_one()
    assert pre_stats["held"] == 0 and pre_stats["orchestr:kv_handoff_expired"] == 0
    assert await usage(pre) == 0.0 and await usage(dec) == 0.0


async def test_a_stream_let_go_stops_its_prefill_and_a_dead_one_is_recomputed(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    kv = {"num_blocks": 128, "block_size": BLOCK, "token_budget": 16}
    pre, dec, strict = await asyncio.gather(
        spawn(ctx, folder, "prefill", kv=kv),
        spawn(ctx, folder, "decode", kv=kv, handoff={"read": "staged"}),  # reading mid-stream
        spawn(ctx, folder, "strict", kv=kv, handoff={"on_failure": "fail"}),  # waiting
    )
    # let go before it is computed: the prefill request is cancelled, its blocks freed
    await pre.pause.call_one()
    h = await streamed(pre, Request("gone", prompt(600), 4, temperature=0.0))
    assert (await pre.handoff_progress.call_one(h.lease, -1))["state"] == "running"
    with pytest.raises(oc.ActorError, match="until_done is a bool"):
        await pre.handoff_progress.call_one(h.lease, -1, "yes")
    assert await pre.release_handoff.call_one(h.lease)
    with pytest.raises(oc.ActorError, match="no streamed handoff"):
        await pre.handoff_progress.call_one(h.lease, -1, True)
    await pre.resume.call_one()
    stats = await pre.stats.call_one()
    assert stats["held"] == 0 and stats["running"] == stats["waiting"] == 0
    assert await usage(pre) == 0.0
    # SIGKILLed mid-stream (63 steps of 16 tokens; killed once 3 blocks are ready): the decode side
    # recomputes, or refuses under "fail"
    k = Request("k", prompt(1000, salt=3), 4, temperature=0.0)
    h = await streamed(pre, k)
    reading = asyncio.ensure_future(dec.generate.call_one([k], kv_from={k.id: h}))
    refusing = asyncio.ensure_future(strict.generate.call_one([k], kv_from={k.id: h}))
    pid, cursor = await pid_of(ctx, pre), -1
    while (p := await pre.handoff_progress.call_one(h.lease, cursor))["ready"] < 3:
        cursor = p["cursor"]
    os.kill(pid, signal.SIGKILL)  # at once: no call in between lets the prefill run on
    assert p["state"] == "running"
    (got,) = await reading
    with pytest.raises(oc.ActorError, match="could not be read") as e:
        await refusing
    assert e.value.remote_type == "HandoffError"
    (want,) = await strict.generate.call_one([k])
    close(got, want)
    assert (await dec.stats.call_one())["orchestr:kv_transfer_failures"] == 1
    assert await usage(dec) == 0.0 and await usage(strict) == 0.0
