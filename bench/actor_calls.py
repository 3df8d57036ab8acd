"""Actor-call microbenchmarks: orchestr, Ray and PyTorch Monarch side by side, with the
machine's limits: a bare asyncio msgpack echo on uvloop for small calls, raw loopback TCP for
the 64 KiB case (see ``_limit_echo.py``).

    python bench/actor_calls.py [--quick] [--peers ray,monarch | --peers none]

Metric names follow Ray's microbenchmark:

- ``1_1_actor_calls_sync_p50_us``: one caller, one actor, sequential round trips; p50 in µs.
- ``1_1_actor_calls_async_per_s``: 1,000 calls in flight to one actor, then wait; calls/s.
- ``n_n_actor_calls_async_per_s``: 2 caller actors each keep 1,000 calls in flight, spread over
  2 target actors; total calls/s.
- ``1_1_actor_calls_with_64KiB_arg_per_s``: like the async 1:1 case with a 64 KiB ``bytes``
  argument (the method returns its length); calls/s.

Each peer is installed into its own virtual environment under ``bench/.venvs`` on first use
(see ``bench/_venvs.py``); none is a dependency of orchestr. Every figure is the median of
several repetitions, printed with min and max. The last line of stdout is one JSON object:
``{"orchestr": {...}, "ray": {...}, "monarch": {...}, "limit": {...}}`` (medians).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import uvloop  # noqa: E402
from _venvs import MONARCH_PRE, MONARCH_REQUIREMENTS, RAY_REQUIREMENTS, ensure_venv  # noqa: E402

import orchestr as oc  # noqa: E402
from orchestr._log import configure_logging  # noqa: E402

IN_FLIGHT = 1_000
PAYLOAD = b"x" * (64 * 1024)
METRICS = (
    "1_1_actor_calls_sync_p50_us",
    "1_1_actor_calls_async_per_s",
    "n_n_actor_calls_async_per_s",
    "1_1_actor_calls_with_64KiB_arg_per_s",
)


class Target(oc.Actor):
    @oc.endpoint
    def echo(self, value: int) -> int:
        return value

    @oc.endpoint
    def size(self, data: bytes) -> int:
        return len(data)


class Driver(oc.Actor):
    """A caller actor for the n:n case: keeps IN_FLIGHT calls going over the targets."""

    @oc.endpoint
    async def call_for(self, targets: oc.Mesh, seconds: float) -> int:
        endpoints = [targets[i].echo for i in range(len(targets))]
        n = len(endpoints)
        count = 0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            await asyncio.gather(*(endpoints[i % n].call_one(i) for i in range(IN_FLIGHT)))
            count += IN_FLIGHT
        return count


Summary = dict[str, Any]  # median, min, max and the repeats' values


def summarize(samples: list[float]) -> Summary:
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "values": samples,
    }


async def _repeat(reps: int, once: Callable[[], Awaitable[float]]) -> Summary:
    await once()  # warm-up
    return summarize([await once() for _ in range(reps)])


async def _rate(seconds: float, batch: Callable[[], Awaitable[object]]) -> float:
    calls, start = 0, time.perf_counter()
    while True:
        await batch()
        calls += IN_FLIGHT
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return calls / elapsed


async def measure_orchestr(reps: int, seconds: float, sync_calls: int) -> dict[str, Summary]:
    out: dict[str, Summary] = {}
    async with oc.open_local_cluster() as ctx:
        target = await ctx.spawn(Target)
        if await target.size.call_one(PAYLOAD) != len(PAYLOAD):
            raise RuntimeError("the 64 KiB argument did not arrive intact")
        echo, size = target.echo, target.size

        async def sync_once() -> float:
            lat = []
            for i in range(sync_calls):
                t = time.perf_counter()
                await echo.call_one(i)
                lat.append(time.perf_counter() - t)
            return statistics.median(lat) * 1e6

        out[METRICS[0]] = await _repeat(reps, sync_once)
        out[METRICS[1]] = await _repeat(
            reps,
            lambda: _rate(
                seconds, lambda: asyncio.gather(*(echo.call_one(i) for i in range(IN_FLIGHT)))
            ),
        )
        targets = await ctx.spawn(Target, n=2)
        drivers = await ctx.spawn(Driver, n=2)

        async def n_n_once() -> float:
            start = time.perf_counter()
            counts = await drivers.call_for.call(targets, seconds)
            return sum(counts) / (time.perf_counter() - start)

        out[METRICS[2]] = await _repeat(reps, n_n_once)
        out[METRICS[3]] = await _repeat(
            reps,
            lambda: _rate(
                seconds, lambda: asyncio.gather(*(size.call_one(PAYLOAD) for _ in range(IN_FLIGHT)))
            ),
        )
    return out


def measure_limit(reps: int, seconds: float, sync_calls: int) -> dict[str, Summary]:
    """The bare msgpack echo over uvloop TCP, in its own processes (see _limit_echo.py)."""
    cmd = [sys.executable, str(HERE / "_limit_echo.py"), str(reps), str(seconds), str(sync_calls)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    result: dict[str, Summary] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def measure_peer(name: str, quick: bool) -> dict[str, Summary]:
    if name == "ray":
        python = ensure_venv("ray", RAY_REQUIREMENTS)
    else:
        python = ensure_venv("monarch", MONARCH_REQUIREMENTS, pre=MONARCH_PRE)
    cmd = [str(python), str(HERE / "peers" / f"{name}_calls.py"), *(["--quick"] if quick else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"the {name} benchmark failed:\n{proc.stderr[-3000:]}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: v for k, v in data.items() if k in METRICS}


def machine() -> str:
    load = os.getloadavg()
    return (
        f"{platform.node()} | {os.cpu_count()} cores | load {load[0]:.2f} {load[1]:.2f} | "
        f"Python {platform.python_version()} | orchestr {oc.__version__}"
    )


def print_table(results: dict[str, dict[str, Summary]]) -> None:
    peers = [p for p in ("ray", "monarch") if p in results]
    cols = ["orchestr", *peers, "limit"]
    print(
        f"{'metric':40s}"
        + "".join(f"{c:>22s}" for c in cols)
        + f"{'vs best peer':>14s}{'of limit':>10s}"
    )
    for metric in METRICS:
        lower_is_better = metric.endswith("_us")
        row = f"{metric:40s}"
        for c in cols:
            s = results[c][metric]
            row += f"{s['median']:>10,.0f} [{s['min']:,.0f}-{s['max']:,.0f}]".rjust(22)
        ours = results["orchestr"][metric]["median"]
        limit = results["limit"][metric]["median"]
        if peers:
            best = min if lower_is_better else max
            peer = best(results[p][metric]["median"] for p in peers)
            row += f"{ours / peer:>13.2f}x"
        else:
            row += f"{'-':>14s}"
        row += f"{(limit / ours if lower_is_better else ours / limit):>9.2f}x"
        print(row)
    print("vs best peer: latency as orchestr/peer (lower is better), throughput as orchestr/peer;")
    print(
        "of limit: the share of the limit that orchestr reaches (latency: limit/orchestr). Limits:"
    )
    print("a bare msgpack echo for small calls, raw loopback TCP chunks for 64 KiB.")


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--peers", default="ray,monarch", help="comma list of ray,monarch, or none")
    add_record_flag(parser)
    args = parser.parse_args()
    reps, seconds, sync_calls = (2, 0.2, 300) if args.quick else (5, 1.0, 2000)
    peers = [] if args.peers == "none" else [p for p in args.peers.split(",") if p]
    unknown = set(peers) - {"ray", "monarch"}
    if unknown:
        parser.error(f"unknown peer(s): {', '.join(sorted(unknown))}")

    configure_logging(json=False, level="WARNING")
    print(machine(), flush=True)
    results: dict[str, dict[str, Summary]] = {}
    results["orchestr"] = uvloop.run(measure_orchestr(reps, seconds, sync_calls))
    results["limit"] = measure_limit(reps, seconds, sync_calls)
    for peer in peers:
        results[peer] = measure_peer(peer, args.quick)
    print(machine(), flush=True)
    print_table(results)
    print(
        json.dumps(
            {name: {m: round(s["median"], 1) for m, s in r.items()} for name, r in results.items()}
        )
    )
    if args.record:
        packages = {"ray": "ray", "monarch": "torchmonarch"}
        record("actor_calls", results, peers=[packages[p] for p in peers])


if __name__ == "__main__":
    main()
