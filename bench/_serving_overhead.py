"""What the front door adds to the time to first token (``bench/serving.py`` runs this with
orchestr's venv): the same prompts, one at a time, three ways:

- **engine**: :class:`orchestr.roles.PagedEngine` in this process, submitted and stepped here
  (submit to the first token), on one torch thread as the generator's steps are;
- **frontdoor**: :meth:`FrontDoor.stream` in this process over one generator actor (the actor
  hop and the streaming reader, no HTTP);
- **http**: ``POST /v1/completions`` with ``stream: true`` through uvicorn on loopback, timed
  by an HTTP client in this process to the first chunk with a choice.

Each prompt is new (random token ids) so no prefix cache helps; one output token. Prints one
JSON line: the p50 and mean of each, in milliseconds.

    python bench/_serving_overhead.py CHECKPOINT [--requests N] [--prompt-len N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import time
from typing import Any

import httpx2
import torch
import uvicorn

import orchestr as oc
from orchestr.roles import Generator, Request, models
from orchestr.roles.serving import FrontDoor, ServedModel, openai_app


def prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def engine_ttft(folder: str, batch: list[list[int]]) -> list[float]:
    # built as a Generator builds its engine (the same backend choice and options)
    from orchestr.roles._common._backend import choose_backend
    from orchestr.roles._common._factory import DEFAULT_MODEL
    from orchestr.roles.generator import KVOptions
    from orchestr.roles.generator._engines._build import build_engine

    _, engine = build_engine(
        choose_backend(None), DEFAULT_MODEL, 0, 32, engine=None, checkpoint=folder,
        kv=KVOptions(token_budget=2048), vllm=None, model_kwargs=None, version=0, eos_id=None,
        pad_id=None, max_seq_len=None, vocab_size=None,
    )  # fmt: skip
    out = []
    for i, p in enumerate(batch):
        t0 = time.perf_counter()
        engine.submit([Request(f"e{i}", p, 1, temperature=0.0)])
        while not engine.step():
            pass
        out.append(time.perf_counter() - t0)
    return out


async def served_ttft(ctx: oc.JobContext, folder: str, batch: list[list[int]]) -> dict[str, Any]:
    gen = await ctx.spawn(Generator, checkpoint=folder, torch_threads=1, kv={"token_budget": 2048})
    front_times, http_times = [], []
    async with FrontDoor(gen) as front:
        app = openai_app(front, ServedModel(folder, ["m"]))
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
        task = asyncio.create_task(server.serve())
        while not server.started:  # noqa: ASYNC110 (uvicorn has no event)
            await asyncio.sleep(0.02)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        async with httpx2.AsyncClient(base_url=url, timeout=60) as h:
            for i, p in enumerate(batch):
                if i % 2 == 0:  # alternate, so drift in the machine falls on both
                    front_times.append(await _front(front, p))
                    http_times.append(await _http(h, p))
                else:
                    http_times.append(await _http(h, p))
                    front_times.append(await _front(front, p))
        server.should_exit = True
        await task
    return {"frontdoor": front_times, "http": http_times}


async def _front(front: FrontDoor, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    async for _ in front.stream(list(prompt), max_new_tokens=1, temperature=0.0):
        break
    return time.perf_counter() - t0


async def _http(h: httpx2.AsyncClient, prompt: list[int]) -> float:
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = None
    async with h.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if first is None and line.startswith('data: {"id"'):
                first = time.perf_counter() - t0
    assert first is not None
    return first


def summary(times: list[float], warmup: int) -> dict[str, float]:
    ms = [t * 1000 for t in times[warmup:]]
    return {"p50_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=256)
    args = parser.parse_args()
    vocab = models.read_config(args.checkpoint).vocab_size
    warmup = 4
    batch = prompts(vocab, args.requests + warmup, args.prompt_len, 1)
    # one torch thread, as the generator's steps have (torch_threads=1)
    torch.set_num_threads(1)
    result = {"engine": summary(engine_ttft(args.checkpoint, batch), warmup)}

    async def go(ctx: oc.JobContext) -> dict[str, Any]:
        return await served_ttft(
            ctx, args.checkpoint, prompts(vocab, len(batch), args.prompt_len, 2)
        )

    served = oc.run(go)
    result.update({k: summary(v, warmup) for k, v in served.items()})
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
