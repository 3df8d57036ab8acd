"""The serving simulator against ``orchestr serve`` on this machine: the configurations
``bench/disagg.py`` compares (co-located: two generators behind the KV-aware router;
disaggregated: one prefill and one decode generator), each generator one thread, on the same
requests, with the signed error of each metric beside the real runs' spread.

    python bench/sim_serving.py [--runs 5] [--rate 1.0] [--requests 24] [--mixes ...]
                                [--checkpoint DIR] [--save PATH]

The checkpoint is ``bench/serving.py``'s (Llama family, 8 layers, hidden 512, float32), made
locally unless ``--checkpoint`` names one. A step-time model is fitted first with one torch
thread (``orchestr.sim._calibrate.calibrate``, what ``orchestr sim calibrate`` runs), and the
data plane's read bandwidth is measured (``bench/disagg.py``'s limit): the simulator's KV
transfer runs at it.

**Real:** ``orchestr serve`` with ``--torch-threads 1`` (as ``bench/disagg.py`` starts it),
driven by the ``openai`` client over HTTP: each request a streamed completion of random token
ids (``ignore_eos``), sent at its arrival. **Simulated:** ``orchestr.sim.simulate_serving``
with the server's engine shape (512 blocks of 16 tokens, 32 sequences, 512 tokens a step),
the same router, and the same threshold for the prefill pool (64 tokens). Both see the same
arrivals (Poisson at ``--rate``, seed 0) and lengths; each real run draws fresh prompt tokens
(so no run hits the prefix cache another left) and the simulator's prompts are as random.

**The serving path.** The engine's profile does not hold what the server adds around it. Before
the workload, five requests at idle, one at a time, measure it on each server
(:func:`serving_path`): a generator step's extra (``step_s``, added to the profile's
``base_s``), a request's way from arrival to its generator (``request_s``), and a handoff's
control calls (``handoff_s``), which the simulator then charges. Then bursts of streamed
tokens measure the CPU work each token costs outside the generators (:func:`token_cpu`): in the
server's own process (the front door) and in this one (the client). The simulator runs the
generators' steps and that work on the machine's cores, shared as the kernel shares them
(``simulate_serving(cpus=, token_cpu_s=)``).

Mixes are ``bench/disagg.py``'s: ``prefill_heavy`` (input 1,024, output 64) and
``decode_heavy`` (input 128, output 512). Metrics as the simulator reports them: output tokens
a second over the run (first arrival to last end), TTFT p50 from arrival, TPOT p50 per request
((end - first token) / (tokens - 1)). ``error`` = sim / real median - 1.

Prints a table and one JSON line ``{"profile": {...}, "kv_gbps": ..., "<system>/<mix>":
{"real": {...}, "sim": {...}, "error": {...}}, ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _sim_compare import compare, table  # noqa: E402
from disagg import MIXES, limit, start  # noqa: E402
from serving import MODEL, free_port, stop, wait_healthy  # noqa: E402
from sim_generation import summary  # noqa: E402

from orchestr.roles import models  # noqa: E402
from orchestr.sim import ServingRequest, simulate_serving  # noqa: E402
from orchestr.sim._calibrate import calibrate  # noqa: E402
from orchestr.sim._generation import attention_pairs  # noqa: E402

SYSTEMS = ("colocated", "disagg")
SHAPE = {"num_blocks": 512, "block_size": 16, "max_batch": 32, "token_budget": 512}


def log(message: str) -> None:
    print(f"[sim_serving] {message}", file=sys.stderr, flush=True)


def arrivals(rate: float, n: int) -> list[float]:
    rng, at, out = random.Random(0), 0.0, []
    for _ in range(n):
        at += rng.expovariate(rate)
        out.append(at)
    return out


def prompts(vocab: int, n: int, length: int, salt: int) -> list[list[int]]:
    rng = random.Random(1000 + salt)
    return [[rng.randrange(5, vocab) for _ in range(length)] for _ in range(n)]


def measured(times: list[tuple[float, float, float, int]]) -> dict[str, float]:
    """:func:`sim_generation.summary` of ``(arrival, first token, end, tokens)`` per request,
    in seconds."""
    return summary(
        [t[1] - t[0] for t in times],
        [(t[2] - t[1]) / (t[3] - 1) for t in times],
        sum(t[3] for t in times),
        max(t[2] for t in times) - min(t[0] for t in times),
    )


async def drive(url: str, at: list[float], sent: list[list[int]], out: int) -> dict[str, float]:
    """Send each prompt at its arrival as a streamed completion; the run's metrics."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    loop = asyncio.get_running_loop()
    start_at = loop.time() + 0.05

    async def one(arrival: float, prompt: list[int]) -> tuple[float, float, float, int]:
        await asyncio.sleep(max(0.0, start_at + arrival - loop.time()))
        first, tokens = None, 0
        stream = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=out, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            if chunk.choices:
                tokens += 1
                if first is None:
                    first = loop.time()
        if first is None or tokens != out:
            raise RuntimeError(f"a request streamed {tokens} tokens, not {out}")
        return start_at + arrival, first, loop.time(), tokens

    try:
        times = await asyncio.gather(*(one(a, p) for a, p in zip(at, sent, strict=True)))
    finally:
        await client.close()
    return measured(list(times))


def serving_path(
    url: str, vocab: int, profile: Any, system: str, found: dict[str, float], kv_s: float
) -> dict[str, float]:
    """The serving path's own costs on this server, from probes at idle (five requests one at
    a time, 128 prompt tokens and 16 out): ``step_s`` on each generator step (the actor's work
    around the engine's; TPOT less the profile's decode steps), ``request_s`` from arrival to
    the generator (TTFT less the prefill step; measured co-located, where nothing else is on
    the path) and ``handoff_s`` (disaggregated TTFT less that, the two generators' steps and
    the KV's transfer ``kv_s``). Each is held at 0 rather than negative."""
    at = [0.6 * i for i in range(5)]
    probe = asyncio.run(drive(url, at, prompts(vocab, len(at), 128, -3), 16))
    decodes = [profile.seconds(0, 1, 0, 128 + i, after_prefill=int(i == 1)) for i in range(1, 16)]
    step_s = max(0.0, probe["tpot_ms_p50"] / 1e3 - statistics.mean(decodes))
    served = dataclasses.replace(profile, base_s=profile.base_s + step_s)
    prefill = served.seconds(128, 0, attention_pairs(0, 128), 0)
    ttft = probe["ttft_ms_p50"] / 1e3
    if system == "colocated":
        return {"step_s": step_s, "request_s": max(0.0, ttft - prefill), "handoff_s": 0.0}
    tail = served.seconds(16, 0, 16 * 112 + attention_pairs(0, 16), 0)  # the last block's 16
    handoff_s = max(0.0, ttft - found["request_s"] - prefill - kv_s - tail)
    return {"step_s": step_s, "request_s": found["request_s"], "handoff_s": handoff_s}


def process_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has run, all its threads (user and system time)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def token_cpu(url: str, pid: int, vocab: int) -> dict[str, float]:
    """The serving path's CPU work on each streamed token, outside the generators: the server's
    own process (the front door, beside the embedded head) and this one (the ``openai``
    client). Eight requests of 16 prompt tokens and 128 out, at once, twice; the server's
    CPU less its rate at idle (it polls its generators), over the tokens streamed."""
    began = process_cpu_s(pid)
    time.sleep(3.0)
    idle_per_s = (process_cpu_s(pid) - began) / 3.0
    server, client, tokens = [], [], 8 * 128
    for burst in range(2):
        cpu, mine, wall = process_cpu_s(pid), time.process_time(), time.monotonic()
        asyncio.run(drive(url, [0.0] * 8, prompts(vocab, 8, 16, -10 - burst), 128))
        wall = time.monotonic() - wall
        server.append((process_cpu_s(pid) - cpu - idle_per_s * wall) / tokens)
        client.append((time.process_time() - mine) / tokens)
    return {"server_s": max(0.0, statistics.mean(server)), "client_s": statistics.mean(client),
            "server_idle_cores": idle_per_s}  # fmt: skip


def simulated(system: str, profile: Any, at: list[float], sent: list[list[int]], out: int,
              kv_gbps: float, kv_bytes_per_token: int,
              path: dict[str, float]) -> dict[str, float]:  # fmt: skip
    requests = [
        ServingRequest(f"r{i}", a, p, out) for i, (a, p) in enumerate(zip(at, sent, strict=True))
    ]
    pools = {"generators": 2} if system == "colocated" else {"generators": 1, "prefill": 1}
    served = dataclasses.replace(profile, base_s=profile.base_s + path["step_s"])
    run = simulate_serving(
        requests, served, policy="kv", min_prefill_tokens=64, kv_gbps=kv_gbps,
        kv_bytes_per_token=kv_bytes_per_token, request_s=path["request_s"],
        handoff_s=path["handoff_s"], cpus=os.cpu_count() or 1,
        token_cpu_s=[path["server_s"], path["client_s"]], **pools, **SHAPE,
    )  # fmt: skip
    s = run.summary()
    return {
        "output_tokens_per_s": s["output_tokens_per_s"],
        "ttft_ms_p50": s["ttft_s_p50"] * 1e3,
        "tpot_ms_p50": s["tpot_s_p50"] * 1e3,
    }


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a model folder instead of a new one")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rate", type=float, default=1.0, help="requests a second (Poisson)")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--mixes", default=",".join(MIXES), help="of " + ", ".join(MIXES))
    parser.add_argument("--save", help="also write the results (JSON) here, for sim_report.py")
    add_record_flag(parser)
    args = parser.parse_args()
    import openai  # noqa: F401  (its loggers are set up on import)

    for name in ("openai", "httpx", "httpx2"):  # one line a request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    mixes = args.mixes.split(",")
    if not set(mixes) <= set(MIXES) or args.runs < 1 or args.requests < 2 or not args.rate > 0:
        parser.error(f"--mixes of {', '.join(MIXES)}; --runs >= 1, --requests >= 2, --rate > 0")
    out: dict[str, Any] = {"runs": args.runs, "rate": args.rate, "requests": args.requests}
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.checkpoint or str(
            models.make_tiny("llama", Path(tmp) / "llama", max_positions=4096, **MODEL)
        )
        log("calibrating (one torch thread)")
        profile, report = calibrate(folder, torch_threads=1)
        out["profile"] = {**profile.to_json(), "fit_median_abs_error": report["median_abs_error"],
                          "fit_max_abs_error": report["max_abs_error"]}  # fmt: skip
        plane = limit(folder, 20)
        kv_gbps = out["kv_gbps"] = plane["read_into_gbps"] * 8  # GB/s -> Gb/s
        per_token = plane["bytes"] // 1024
        vocab = report["model"]["vocab"]
        at = arrivals(args.rate, args.requests)
        paths: dict[str, dict[str, float]] = {}
        out["serving_path"] = paths
        for system in SYSTEMS:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = start(system, folder, port, 0)  # never spilling, as the simulator here
            try:
                wait_healthy(url, proc)
                asyncio.run(drive(url, at[:2], prompts(vocab, 2, 64, -1), 4))  # warm-up
                kv_s = 128 * per_token / (kv_gbps * 1e9 / 8)
                found = paths[system] = serving_path(
                    url, vocab, profile, system, paths.get("colocated", {}), kv_s
                )
                found.update(token_cpu(url, proc.pid, vocab))
                log(f"{system}: serving path {found}")
                for mix in mixes:
                    length, tokens = MIXES[mix]
                    log(f"{system} {mix}: {args.runs} real runs at {args.rate}/s")
                    runs = [
                        asyncio.run(drive(url, at, prompts(vocab, len(at), length, r), tokens))
                        for r in range(args.runs)
                    ]
                    sim = simulated(system, profile, at, prompts(vocab, len(at), length, -2),
                                    tokens, kv_gbps, per_token, found)  # fmt: skip
                    out[f"{system}/{mix}"] = compare(runs, sim)
            finally:
                stop(proc)
                time.sleep(1.0)
    table(out, 24)
    print(json.dumps(out))
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps(out, indent=1) + "\n")
    if args.record:
        record("sim_serving", out)


if __name__ == "__main__":
    main()
