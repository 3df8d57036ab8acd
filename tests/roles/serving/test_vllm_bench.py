"""vLLM's own benchmark client (``vllm bench serve``, through ``bench/vllm_bench_serve.py``)
against the front door: the ``openai`` and ``openai-chat`` backends, random prompts, at
concurrency 1, 8 and 32, with no failed request; over orchestr's paged engine, and once over
vLLM's engine in the generators (``--engine vllm``).

The client comes with vLLM, so this module runs in ``.venv-vllm`` (``make test``); elsewhere
it is skipped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

import orchestr as oc
from orchestr.roles import Generator, models
from orchestr.roles.serving import FrontDoor, ServedModel
from tests.roles.serving.test_frontdoor import http

pytest.importorskip("vllm", reason="vLLM is not installed here; make test runs this in .venv-vllm")

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.timeout(600),
]

ROOT = pathlib.Path(__file__).resolve().parents[3]
CLIENT = ROOT / "bench" / "vllm_bench_serve.py"
PROMPTS, INPUT, OUTPUT = 48, 64, 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("m") / "llama"
    return pathlib.Path(models.make_tiny("llama", path, hidden=128, heads=4, kv_heads=2))


@contextlib.asynccontextmanager
async def serving(generators: oc.Mesh, folder: pathlib.Path) -> AsyncIterator[str]:
    async with FrontDoor(generators) as front, http(front, ServedModel(folder, ["tiny"])) as url:
        yield url


async def bench(url: str, folder: pathlib.Path, backend: str, levels: str) -> list[dict[str, Any]]:
    """``vllm bench serve`` at each concurrency of ``levels``; the results."""
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(CLIENT),
        "--concurrencies",
        levels,
        "--backend",
        backend,
        "--base-url",
        url,
        "--endpoint",
        endpoint,
        "--model",
        "tiny",
        "--tokenizer",
        str(folder),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(INPUT),
        "--random-output-len",
        str(OUTPUT),
        "--num-prompts",
        str(PROMPTS),
        "--seed",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    return [json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")]


def check(results: list[dict[str, Any]], levels: list[int]) -> None:
    assert [r["max_concurrency"] for r in results] == levels
    for r in results:
        assert (r["completed"], r["failed"]) == (PROMPTS, 0), r
        # ignore_eos (sent for the random dataset): every output is as long as asked
        assert r["total_output_tokens"] == PROMPTS * OUTPUT, r
        assert r["mean_ttft_ms"] > 0 and r["mean_tpot_ms"] > 0


async def test_vllm_bench_serve_against_the_paged_engine(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    gens = await ctx.spawn(Generator, n=2, checkpoint=str(folder), torch_threads=1)
    async with serving(gens, folder) as url:
        for backend in ("openai", "openai-chat"):
            check(await bench(url, folder, backend, "1,8,32"), [1, 8, 32])


async def test_vllm_bench_serve_against_vllms_engine(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    options = {"block_size": 32, "max_model_len": 512, "kv_cache_memory_bytes": 32 << 20}
    gens = await ctx.spawn(
        Generator, checkpoint=str(folder), engine="vllm", vllm=options, torch_threads=1
    )
    async with serving(gens, folder) as url:
        check(await bench(url, folder, "openai", "8"), [8])
