"""A fleet of simulated generators behind one front door: ``orchestr serve --engine sim`` with
``--generators`` of them (32 by default) on this machine, loaded by concurrent clients.

    python bench/sim_fleet.py [--generators 32] [--per-generator 4] [--rounds 4] [--record]

Each simulated generator runs the paged engine's scheduler, block pool and KV pool with no
model, its steps lasting what a step-time profile says (``--profile``: the default is a GPU-like
4 ms step plus 0.3 ms per decoding sequence). The front door routes with its KV-aware router.
The clients send ``--generators`` x ``--per-generator`` requests at once (64-token prompts, a
prefix shared by groups of 8, 32 tokens out, ``ignore_eos``), ``--rounds`` times.

Reported: the seconds from the command to its serving line (``startup_s``, every generator
spawned and its engine built); requests and output tokens per second; the median and p95
request latency; the memory all its processes hold (RSS, GiB, after the load). Beside the
rate, its limit: what the profile allows when every generator runs its share of the batch
concurrently (``ideal_output_tokens_per_s``) and the ratio to it. On 2 cores the 33 processes
(and the front door) share two CPUs, so the ratio says how much of the profile's time the
host's own work adds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from typing import Any

from _procs import Processes, exit_on_signal

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROFILE = {"base_s": 0.004, "prefill_token_s": 2e-5, "decode_s": 3e-4}
PROMPT, OUT = 64, 32


def _rss_gib(marker: str) -> float:
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{entry}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
    return total / 2**30


def _complete(url: str, model: str, i: int) -> tuple[float, int]:
    prompt = [*range(10, 10 + PROMPT - 8), *(100 + (i // 8) % 50 for _ in range(4)), *range(4)]
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": OUT, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(
        url + "/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": "Bearer bench"},
    )
    began = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as r:
        answer = json.loads(r.read())
    return time.perf_counter() - began, int(answer["usage"]["completion_tokens"])


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generators", type=int, default=32)
    parser.add_argument("--per-generator", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--profile", help="a step-time profile (JSON); default: see above")
    add_record_flag(parser)
    args = parser.parse_args()
    import signal

    signal.signal(signal.SIGTERM, exit_on_signal)
    from orchestr.roles import models

    procs = Processes()
    with tempfile.TemporaryDirectory() as tmp:
        folder = models.make_tiny("llama", pathlib.Path(tmp) / "llama", vocab=301)
        profile = pathlib.Path(args.profile or pathlib.Path(tmp) / "profile.json")
        if not args.profile:
            profile.write_text(json.dumps(PROFILE))
        steps = json.loads(profile.read_text())
        marker = uuid.uuid4().hex
        env = dict(os.environ, ORCHESTR_API_KEY="bench", ORCHESTR_BENCH_MARKER=marker)
        command = [sys.executable, "-m", "orchestr.cli", "serve", str(folder), "--port", "0"]
        command += ["--engine", "sim", "--profile", str(profile)]
        command += ["--generators", str(args.generators), "--max-pending", "100000"]
        began = time.perf_counter()
        server = procs.start(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        try:
            assert server.stdout is not None
            line = server.stdout.readline()
            startup = time.perf_counter() - began
            found = re.search(r"on (http://127\.0\.0\.1:\d+/v1)", line)
            if not found:
                raise SystemExit(f"orchestr serve did not start: {line!r}")
            n = args.generators * args.per_generator
            rounds = []
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                for _ in range(args.rounds):
                    t = time.perf_counter()
                    done = list(pool.map(lambda i: _complete(found[1], str(folder), i), range(n)))
                    wall = time.perf_counter() - t
                    latencies = sorted(s for s, _ in done)
                    rounds.append(
                        {
                            "requests_per_s": n / wall,
                            "output_tokens_per_s": sum(k for _, k in done) / wall,
                            "latency_s_p50": statistics.median(latencies),
                            "latency_s_p95": latencies[int(0.95 * (n - 1))],
                        }
                    )
                    print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
            rss = _rss_gib(marker)
        finally:
            procs.stop_all()
    k = args.per_generator
    step = steps.get("base_s", 0.0) + steps.get("decode_s", 0.0) * k
    ideal = args.generators * k / step  # every generator decoding its k at once
    rate = statistics.median(r["output_tokens_per_s"] for r in rounds)
    summary: dict[str, Any] = {
        "generators": args.generators,
        "concurrent_requests": args.generators * k,
        "startup_s": startup,
        "requests_per_s": statistics.median(r["requests_per_s"] for r in rounds),
        "output_tokens_per_s": rate,
        "output_tokens_per_s_min": min(r["output_tokens_per_s"] for r in rounds),
        "output_tokens_per_s_max": max(r["output_tokens_per_s"] for r in rounds),
        "latency_s_p50": statistics.median(r["latency_s_p50"] for r in rounds),
        "latency_s_p95": statistics.median(r["latency_s_p95"] for r in rounds),
        "rss_gib": rss,
        "ideal_output_tokens_per_s": ideal,
        "ratio_to_ideal": rate / ideal,
    }
    print(json.dumps(summary))
    if args.record:
        record("sim_fleet", summary)


if __name__ == "__main__":
    main()
