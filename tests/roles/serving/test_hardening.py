"""The front door and its generators against hostile requests, over real HTTP clients: every
numeric field of the request schema out of range is a 400 naming the field, and the next
request is served; a generator reached without the front door refuses the same values; a step
that fails ends its requests with a fixed message and the generator comes back in rotation;
``cache_salt`` keeps one tenant's prefix blocks from another's; nesting and size limits."""

from __future__ import annotations

import asyncio
import json
import pathlib
from typing import Any

import httpx2
import pytest

import orchestr as oc
from orchestr.roles import Generator, Request, models
from orchestr.roles.serving import FrontDoor, ServedModel

from .faulty import POISON
from .test_frontdoor import http, pid_of

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return pathlib.Path(models.make_tiny("llama", tmp_path_factory.mktemp("m") / "llama"))


NAN, INF = float("nan"), float("inf")
#: (route, a field's bad value, the field the 400 names): every number a request carries, at
#: values no kernel type holds, non-finite floats, negative counts, and wrong types.
BAD: list[tuple[str, dict[str, Any], str]] = [
    *(("c", {"top_k": v}, "top_k") for v in (2**63, 2**64, -(2**63), 10**30, -2, 1.5, "5", True)),
    *(("c", {"temperature": v}, "temperature") for v in (NAN, INF, -INF, 10**400, -1, 3, "1")),
    *(("c", {"top_p": v}, "top_p") for v in (0, -0.5, 1.5, NAN, 10**400)),
    *(("c", {"n": v}, "n") for v in (0, 129, 2**64, -1, 2.0)),
    *(("c", {"max_tokens": v}, "max_tokens") for v in (0, -1, 2.5)),
    *(("c", {"seed": v}, "seed") for v in (2**63, 2**64, -(2**63) - 1, 1.5, True)),
    *(("c", {"logprobs": v}, "logprobs") for v in (21, -1, 2**64)),
    *(("c", {"prompt": v}, "prompt") for v in ([2**63], [-1], [10**6], [[1, 2**64]], [1.5])),
    ("c", {"stop": ["x" * 257]}, "stop"),
    ("c", {"stop": ["a"] * 17}, "stop"),
    ("c", {"stop": 5}, "stop"),
    ("c", {"stop": "\ud800"}, "stop"),  # a lone surrogate cannot travel to a generator
    ("c", {"stop": ["a", "\udfff"]}, "stop"),
    ("c", {"cache_salt": "\ud800"}, "cache_salt"),
    ("c", {"prompt": [[1], [2], [3]], "n": 128}, "n"),  # more than the front door ever admits
    ("c", {"best_of": 2**64}, "best_of"),
    ("c", {"cache_salt": ""}, "cache_salt"),
    ("c", {"cache_salt": 5}, "cache_salt"),
    ("c", {"stream": True, "stream_options": {"include_usage": 2}}, "include_usage"),
    ("c", {"min_tokens": 2**64}, "min_tokens"),
    ("c", {"priority": NAN}, "priority"),
    ("chat", {"top_logprobs": 2**63, "logprobs": True}, "top_logprobs"),
    ("chat", {"max_completion_tokens": 2**64}, "max_completion_tokens"),
    ("chat", {"max_completion_tokens": -(2**64)}, "max_completion_tokens"),
    ("chat", {"top_k": 2**63}, "top_k"),
    ("chat", {"temperature": NAN}, "temperature"),
]


def _post(kind: str, fields: dict[str, Any]) -> tuple[str, bytes]:
    if kind == "c":
        body = {"model": "m", "prompt": "hello", "max_tokens": 2, **fields}
        path = "/v1/completions"
    else:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
        path = "/v1/chat/completions"
    return path, json.dumps(body).encode()  # NaN and Infinity as Python writes them


async def test_every_field_out_of_range_is_a_400_and_the_generator_serves_on(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    gen = await ctx.spawn(Generator, checkpoint=str(folder), torch_threads=1)
    async with (
        FrontDoor(gen) as front,
        http(front, ServedModel(folder, ["m"])) as url,
        httpx2.AsyncClient(base_url=url, timeout=60) as client,
    ):
        for kind, fields, param in BAD:
            path, body = _post(kind, fields)
            r = await client.post(path, content=body)
            assert r.status_code == 400, (fields, r.text)
            error = r.json()["error"]
            assert error["param"] == param or error["param"].endswith(param), (fields, error)
            assert error["type"] == "invalid_request_error"
        # nesting deeper than the parser goes is a 400 too, and so is a prompt that cannot fit
        for body in (b"[" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000):
            r = await client.post("/v1/completions", content=body)
            assert r.status_code == 400 and "nested too deeply" in r.text, r.text[:200]
        r = await client.post(
            "/v1/completions", json={"model": "m", "prompt": "word " * 2_000_000, "max_tokens": 1}
        )
        assert r.status_code in (400, 413), r.text[:300]
        r = await client.post("/tokenize", json={"prompt": "x" * 1_000_000})
        assert r.status_code in (400, 413), r.text[:300]
        # the generator is untouched: still in rotation, and the next request is served
        r = await client.post(
            "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in (
            "length",
            "stop",
        )
        assert front.workers == ["Generator[0]"]
        # reached without the front door, the generator refuses the same values itself
        for bad in (
            {"top_k": 2**63},
            {"temperature": NAN},
            {"top_p": INF},
            {"max_new_tokens": 2**63},
            {"stop": ["x" * 300]},
            {"top_logprobs": 2**63},
        ):
            request = Request("direct", [1, 2, 3], **{"max_new_tokens": 2, **bad})
            with pytest.raises(oc.ActorError) as info:
                await gen.generate.call_one([request])
            assert info.value.remote_type == "ValueError", info.value
        (done,) = await gen.generate.call_one([Request("after", [1, 2, 3], 2)])
        assert len(done.tokens) == 2


async def test_a_failed_step_ends_its_requests_and_the_generator_comes_back(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    gens = await ctx.spawn(
        "tests.roles.serving.faulty:FaultyGenerator",
        n=1,
        name="gen",
        checkpoint=str(folder),
        torch_threads=1,
        restart=oc.RestartPolicy(max_restarts=2),
        supervise=lambda failure: "restart" if failure.can_restart else "handle",
    )
    before = await pid_of(ctx, gens, 0)
    async with (
        FrontDoor(gens) as front,
        http(front, ServedModel(folder, ["m"])) as url,
        httpx2.AsyncClient(base_url=url, timeout=120) as client,
    ):
        ok = {"model": "m", "prompt": "hi", "max_tokens": 3}
        assert (await client.post("/v1/completions", json=ok)).status_code == 200
        poison = {"model": "m", "prompt": [*POISON, 1, 2], "max_tokens": 50}
        r = await client.post("/v1/completions", json=poison)
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        # a fixed message and the request's id; what failed (and where) is for the log
        assert message.startswith("no generator could serve this request now; retry")
        assert r.headers["x-request-id"] in message
        assert "Traceback" not in r.text and "injected" not in r.text and ".py" not in r.text
        # its worker exits, the restart policy places a new one, the front door takes it back
        async with asyncio.timeout(120):
            while (await client.get("/health")).status_code != 200 or not front.workers:  # noqa: ASYNC110 (polled over HTTP)
                await asyncio.sleep(0.2)
        r = await client.post("/v1/completions", json=ok)
        assert r.status_code == 200, r.text
        assert await pid_of(ctx, gens, 0) != before


async def test_cache_salt_keeps_prefix_blocks_apart(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    gen = await ctx.spawn(Generator, checkpoint=str(folder), torch_threads=1)
    prompt = list(range(5, 5 + 64))  # four full blocks of 16

    async with FrontDoor(gen) as front, http(front, ServedModel(folder, ["m"])) as url:
        async with httpx2.AsyncClient(base_url=url, timeout=60) as client:

            async def cached(salt: str | None) -> float:
                body: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": 1}
                if salt is not None:
                    body["cache_salt"] = salt
                assert (await client.post("/v1/completions", json=body)).status_code == 200
                u = await gen.updates.call_one("probe", timeout_s=0)
                await gen.unsubscribe.call_one("probe")
                return float(u.metrics["vllm:prefix_cache_hits"])

            first = await cached("tenant-a")
            other = await cached("tenant-b")  # the same prompt under another salt: no hit
            unsalted = await cached(None)
            again = await cached("tenant-a")  # its own blocks are found
    assert other == first and unsalted == other, (first, other, unsalted)
    assert again - unsalted >= 48, (unsalted, again)
