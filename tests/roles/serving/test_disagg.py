"""Prefill/decode disaggregation behind the front door, on real generators and a real HTTP
client: long prompts are prefilled on the prefill pool and decoded on the other with the
tokens one generator gives alone, short ones stay where they decode, a prefill generator
killed with SIGKILL only moves prompts back to their decode side (and fails the requests it
was serving whole, spilled there from a full decode pool), and a client that goes away leaves
no block held on either side."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import openai
import pytest

import orchestr as oc
from orchestr.roles import Generator, models
from orchestr.roles.serving import FrontDoor, ServedModel

from .test_frontdoor import client_of, http, kv_usage, pid_of, until_idle

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return pathlib.Path(models.make_tiny("llama", tmp_path_factory.mktemp("m") / "llama"))


async def spawn(ctx: oc.JobContext, folder: pathlib.Path, name: str) -> oc.Mesh:
    return await ctx.spawn(
        Generator, name=name, checkpoint=str(folder), torch_threads=1, supervise="handle"
    )


def words(n: int) -> str:
    return " ".join(f"w{i % 37}" for i in range(n))


async def streaming(client: openai.AsyncOpenAI, prompt: str) -> tuple[Any, AsyncIterator[Any]]:
    """A long streamed completion of ``prompt``, once its first chunk has arrived: the
    stream, and its chunks from the second on."""
    stream = await client.completions.create(
        model="m", prompt=prompt, max_tokens=3000, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = aiter(stream)
    await anext(chunks)
    return stream, chunks


@contextlib.asynccontextmanager
async def served(
    ctx: oc.JobContext, folder: pathlib.Path, **options: Any
) -> AsyncIterator[tuple[oc.Mesh, oc.Mesh, FrontDoor, str, openai.AsyncOpenAI]]:
    """A prefill and a decode generator behind a front door served over HTTP: yields them,
    the front door, its URL and an OpenAI client of it."""
    pre, dec = await asyncio.gather(spawn(ctx, folder, "prefill"), spawn(ctx, folder, "decode"))
    async with (
        FrontDoor(dec, prefill=pre, **options) as front,
        http(front, ServedModel(folder, ["m"])) as url,
        client_of(url) as client,
    ):
        yield pre, dec, front, url, client


async def test_long_prompts_are_prefilled_on_the_prefill_pool(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    alone = await spawn(ctx, folder, "alone")
    model = ServedModel(folder, ["m"])
    async with served(ctx, folder, prefill_min_tokens=32) as (pre, dec, front, url, client):
        # the second shares 3 blocks with the first: its decode side reads only the 4th
        for ids in (list(range(5, 65)), list(range(5, 85)), [5, 6, 7]):
            r = await client.completions.create(
                model="m", prompt=ids, max_tokens=12, temperature=0.0, logprobs=1
            )
            (want,) = await alone.generate.call_one(
                [{"id": "x", "prompt": ids, "max_new_tokens": 12, "temperature": 0.0}]
            )
            assert r.choices[0].text == model.tokenizer.decode(want.tokens)
            assert r.choices[0].logprobs is not None
            got = r.choices[0].logprobs.token_logprobs or []
            assert max(abs(a - b) for a, b in zip(got, want.logprobs, strict=True)) <= 1e-5
        assert front.prefill is not None
        assert front.prefill.counts == {
            "prefill_remote": 2,
            "prefill_local": 1,
            "prefill_fallback": 0,
            "prefill_spilled": 0,
        }
        stats = await dec.stats.call_one()
        assert stats["orchestr:kv_transfers"] == 2
        assert stats["orchestr:kv_transfer_failures"] == 0
        async with httpx2.AsyncClient(base_url=url) as h:
            text = (await h.get("/metrics")).text
        assert 'orchestr:frontdoor_prefill_remote_total{model_name="m"} 2.0' in text
        assert 'orchestr:frontdoor_prefill_local_total{model_name="m"} 1.0' in text
        assert 'orchestr:kv_transfers_total{model_name="m"} 2.0' in text
        assert "orchestr:kv_transfer_reads_total" in text  # streamed: one read or more each
        assert "orchestr:kv_transfer_exposed_seconds_total" in text
        await until_idle(dec)
        await until_idle(pre)
        assert (await pre.stats.call_one())["held"] == 0


async def test_a_prefill_generator_killed_moves_prompts_to_their_decode_side(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    async with served(ctx, folder, prefill_min_tokens=8) as (pre, dec, front, _, client):
        assert front.prefill is not None
        first = await client.completions.create(model="m", prompt=words(40), max_tokens=4)
        os.kill(await pid_of(ctx, pre, 0), signal.SIGKILL)
        for i in range(3):
            r = await client.completions.create(model="m", prompt=words(40 + i), max_tokens=4)
            assert r.choices[0].finish_reason in ("length", "stop")
        assert first.choices[0].finish_reason in ("length", "stop")
        counts = front.prefill.counts
        assert counts["prefill_remote"] == 1 and counts["prefill_fallback"] == 3
        assert front.prefill.door.workers == []
        await until_idle(dec)


async def test_a_client_that_goes_away_frees_blocks_on_both_sides(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    async with served(ctx, folder, prefill_min_tokens=8) as (pre, dec, front, _, client):
        stream, _ = await streaming(client, words(80))
        assert (await kv_usage(dec))[0] > 0
        await stream.close()
        await until_idle(dec)
        deadline = time.monotonic() + 20
        while (await pre.stats.call_one())["held"]:  # ended by the decode side's read
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await until_idle(pre)
        assert front.pending == 0


async def test_a_request_abandoned_during_its_prefill_leaves_nothing_held(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    pre = await spawn(ctx, folder, "prefill")
    dec = await spawn(ctx, folder, "decode")
    async with FrontDoor(dec, prefill=pre, prefill_min_tokens=8, hold_s=0.2) as front:
        with pytest.raises(ValueError, match="longer than|context|max"):  # refused, not lost
            await front.open([5] * 5000, max_new_tokens=4)
        assert front.prefill is not None and front.prefill.counts["prefill_fallback"] == 0
        await pre.pause.call_one()  # the prefill waits until the caller has gone
        opening = asyncio.create_task(front.open(list(range(5, 105)), max_new_tokens=4))
        deadline = time.monotonic() + 20
        while (await pre.stats.call_one())["waiting"] == 0:
            assert time.monotonic() < deadline, "the prefill never reached its generator"
            await asyncio.sleep(0.02)
        opening.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await opening
        await pre.resume.call_one()
        while (s := await pre.stats.call_one())["held"] or s["waiting"] or s["running"]:
            assert time.monotonic() < deadline, f"the prefill generator still holds work: {s}"
            await asyncio.sleep(0.05)
        await until_idle(pre)
        await until_idle(dec)
        assert front.pending == 0


async def test_a_decode_generator_killed_fails_its_requests_and_holds_nothing(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    async with served(ctx, folder, prefill_min_tokens=8) as (pre, dec, front, _, client):
        _, chunks = await streaming(client, words(60))
        os.kill(await pid_of(ctx, dec, 0), signal.SIGKILL)
        with pytest.raises(openai.APIError, match="^no generator could serve this request now"):
            async for _ in chunks:
                pass
        assert front.workers == [] and front.pending == 0
        assert front.prefill is not None and front.prefill.counts["prefill_remote"] == 1
        assert (await pre.stats.call_one())["held"] == 0  # the read had ended the lease
        await until_idle(pre)


async def reported(door: FrontDoor, running: int) -> None:
    """Wait until the generator's own report (not the front door's count of what it sent
    since) says it has ``running`` requests, so the next routing decision is settled."""
    (worker,) = door.workers
    deadline = time.monotonic() + 20
    while door._requests.get(worker) != running:
        assert time.monotonic() < deadline, f"{worker} reports {door._requests.get(worker)}"
        await asyncio.sleep(0.02)


async def test_a_full_decode_pool_spills_whole_requests_to_the_prefill_pool(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    alone = await spawn(ctx, folder, "alone")
    model = ServedModel(folder, ["m"])
    async with served(ctx, folder, prefill_min_tokens=8, spill_at=2) as (pre, dec, front, url, c):
        assert front.prefill is not None
        door = front.prefill.door
        streams = [await streaming(c, words(40 + i)) for i in range(2)]  # handed off
        await dec.pause.call_one()  # so they keep running, however fast this machine is
        await reported(front, 2)
        await reported(door, 0)
        # the decode generator is full: this one is served whole on the prefill generator,
        # with the tokens and log-probs one generator gives alone
        ids = list(range(5, 45))
        r = await c.completions.create(
            model="m", prompt=ids, max_tokens=12, temperature=0.0, logprobs=1
        )
        (want,) = await alone.generate.call_one(
            [{"id": "x", "prompt": ids, "max_new_tokens": 12, "temperature": 0.0}]
        )
        assert r.choices[0].text == model.tokenizer.decode(want.tokens)
        got = (r.choices[0].logprobs and r.choices[0].logprobs.token_logprobs) or []
        assert max(abs(a - b) for a, b in zip(got, want.logprobs, strict=True)) <= 1e-5
        assert (await pre.stats.call_one())["finished"] == 3  # two prefills and the whole one
        assert (
            front.prefill.counts["prefill_remote"],
            front.prefill.counts["prefill_spilled"],
        ) == (
            2,
            1,
        )
        # spills go on while the prefill generator has fewer requests than the decode one
        await reported(door, 0)
        streams += [await streaming(c, words(60 + i)) for i in range(2)]  # both spilled
        await reported(door, 2)
        await dec.resume.call_one()
        streams.append(await streaming(c, words(70)))  # 2 against 2: handed off again
        assert front.prefill.counts["prefill_spilled"] == 3
        assert front.prefill.counts["prefill_remote"] == 3
        assert front.pending == 5
        async with httpx2.AsyncClient(base_url=url) as h:
            text = (await h.get("/metrics")).text
        assert 'orchestr:frontdoor_prefill_spilled_total{model_name="m"} 3.0' in text
        # clients that go away free the blocks on both sides
        for stream, _ in streams:
            await stream.close()
        await until_idle(dec)
        await until_idle(pre)
        assert front.pending == 0


async def test_a_prefill_generator_killed_fails_the_requests_it_was_serving_whole(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    async with served(ctx, folder, prefill_min_tokens=8, spill_at=1) as (pre, dec, front, _, c):
        assert front.prefill is not None
        held, _ = await streaming(c, words(40))  # handed off
        await dec.pause.call_one()  # so it keeps running, however fast this machine is
        await reported(front, 1)
        await reported(front.prefill.door, 0)
        _, chunks = await streaming(c, words(50))  # spilled
        assert front.prefill.counts["prefill_spilled"] == 1
        await dec.resume.call_one()
        os.kill(await pid_of(ctx, pre, 0), signal.SIGKILL)
        with pytest.raises(openai.APIError, match="^no generator could serve this request now"):
            async for _ in chunks:
                pass
        # the decode side serves on, prefilling long prompts itself
        r = await c.completions.create(model="m", prompt=words(45), max_tokens=4)
        assert r.choices[0].finish_reason in ("length", "stop")
        assert front.prefill.counts["prefill_fallback"] == 1
        await held.close()
        await until_idle(dec)
        assert front.pending == 0


async def test_with_its_decode_generators_dead_a_spilling_front_door_serves_on_the_prefill_pool(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    async with served(ctx, folder, prefill_min_tokens=8, spill_at=4) as (pre, dec, front, _, c):
        assert front.prefill is not None
        with pytest.raises(ValueError, match="give prefill too"):
            FrontDoor(dec, spill_at=4)
        with pytest.raises(ValueError, match="spill_at must be a positive int"):
            FrontDoor(dec, prefill=pre, spill_at=0)
        os.kill(await pid_of(ctx, dec, 0), signal.SIGKILL)
        deadline = time.monotonic() + 20
        while front.workers:  # its reader finds it dead
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        r = await c.completions.create(model="m", prompt=words(40), max_tokens=4)
        assert r.choices[0].finish_reason in ("length", "stop")
        assert front.prefill.counts["prefill_spilled"] == 1
        with pytest.raises(openai.APIError):  # a short prompt has nowhere to go
            await c.completions.create(model="m", prompt="w1 w2", max_tokens=4)
        await until_idle(pre)
        assert front.pending == 0
