"""Actor-call microbenchmarks on PyTorch Monarch, mirroring ``ray_calls.py``.

Run with the Monarch venv's interpreter (see ``bench/_venvs.py``)::

    bench/.venvs/monarch/bin/python bench/peers/monarch_calls.py [--quick]

Written against torchmonarch 0.7.0 (``monarch.actor``: ``Actor``,
``endpoint``, ``this_host().spawn_procs(...)``, ``ProcMesh.spawn``,
``endpoint.call_one`` / ``endpoint.call``).  Every actor lives in its own OS
process: each proc mesh spawned on ``this_host()`` is a set of child
processes of the driver.  The driver is an ``asyncio`` program; endpoint calls
return Monarch futures that are awaited, and "N calls in flight" means
creating N ``call_one`` futures and then gathering them.

Metrics (same names and meaning as the Ray peer):

``1_1_actor_calls_sync_p50_us``
    The driver awaits sequential round trips to one actor (small int in, same
    int out); median latency of one repetition's calls, in microseconds.
``1_1_actor_calls_async_per_s``
    The driver issues 1,000 calls to one actor, then waits for all of them;
    batches repeat for about a second.  Calls per second.
``n_n_actor_calls_async_per_s``
    Two caller actors (a proc mesh of two processes) each repeatedly issue
    1,000 calls spread round-robin over two target actors (another proc mesh
    of two processes, passed to the callers' constructor as an actor mesh and
    sliced per target) and wait for them.  Total calls per second over both
    callers, timed by the driver from start until both callers are done.
``1_1_actor_calls_with_64KiB_arg_per_s``
    Like ``1_1_actor_calls_async_per_s`` but each call carries a 64 KiB
    ``bytes`` argument; the method returns its length.

Each metric is measured in several repetitions (one warm-up round first) and
reported as median, min and max.  Human-readable lines go to stderr; the last
line of stdout is one JSON object with every metric plus ``_versions``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from monarch.actor import Actor, ProcMesh, endpoint, this_host

IN_FLIGHT = 1_000
PAYLOAD = b"x" * (64 * 1024)


@dataclass(frozen=True)
class Settings:
    """How much work each metric does."""

    repetitions: int
    seconds_per_repetition: float
    sync_calls: int


FULL = Settings(repetitions=5, seconds_per_repetition=1.0, sync_calls=2_000)
QUICK = Settings(repetitions=2, seconds_per_repetition=0.2, sync_calls=300)


class Target(Actor):
    """The actor being called: trivial endpoints only.

    Endpoint names must not collide with actor-mesh attributes (``size``,
    ``slice``, ``stop``, ...), hence ``length`` rather than ``size``.
    """

    @endpoint
    def echo(self, value: int) -> int:
        return value

    @endpoint
    def length(self, data: bytes) -> int:
        return len(data)


class Caller(Actor):
    """An actor that drives calls to every actor of a target mesh."""

    def __init__(self, targets: Target) -> None:
        self.targets = [targets.slice(procs=i) for i in range(targets.size())]

    @endpoint
    async def call_for(self, seconds: float) -> int:
        """Issue batches of IN_FLIGHT calls until ``seconds`` pass; return the count."""
        deadline = time.perf_counter() + seconds
        count = 0
        n = len(self.targets)
        while True:
            await asyncio.gather(*(self.targets[i % n].echo.call_one(i) for i in range(IN_FLIGHT)))
            count += IN_FLIGHT
            if time.perf_counter() >= deadline:
                return count


def summarize(samples: list[float]) -> dict[str, float]:
    """Median, min and max of one metric's repetitions."""
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
    }


async def batches_per_second(batch: Callable[[], Awaitable[object]], seconds: float) -> float:
    """Await ``batch`` (IN_FLIGHT calls) repeatedly for ``seconds``; return calls/s."""
    calls = 0
    start = time.perf_counter()
    while True:
        await batch()
        calls += IN_FLIGHT
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return calls / elapsed


async def sync_p50_us(target: Target, calls: int) -> float:
    """Median latency of ``calls`` sequential round trips, in microseconds."""
    latencies: list[float] = []
    for i in range(calls):
        start = time.perf_counter()
        await target.echo.call_one(i)
        latencies.append(time.perf_counter() - start)
    return statistics.median(latencies) * 1e6


async def measure(settings: Settings) -> dict[str, dict[str, float]]:
    """Run all four metrics and return their summaries."""
    results: dict[str, dict[str, float]] = {}
    seconds = settings.seconds_per_repetition

    async def record(name: str, unit: str, run_once: Callable[[], Awaitable[float]]) -> None:
        await run_once()  # warm-up
        samples = [await run_once() for _ in range(settings.repetitions)]
        results[name] = summarize(samples)
        s = results[name]
        print(
            f"{name:40s} median {s['median']:>12,.1f} {unit}"
            f"  (min {s['min']:,.1f}, max {s['max']:,.1f}, n={len(samples)})",
            file=sys.stderr,
            flush=True,
        )

    meshes: list[ProcMesh] = []

    def procs(count: int) -> ProcMesh:
        mesh = this_host().spawn_procs(per_host={"procs": count})
        meshes.append(mesh)
        return mesh

    try:
        target = procs(1).spawn("target", Target)
        if await target.length.call_one(PAYLOAD) != len(PAYLOAD):
            raise RuntimeError("64 KiB argument did not arrive intact")

        await record(
            "1_1_actor_calls_sync_p50_us", "us", lambda: sync_p50_us(target, settings.sync_calls)
        )

        def async_batch() -> Awaitable[list[int]]:
            return asyncio.gather(*(target.echo.call_one(i) for i in range(IN_FLIGHT)))

        await record(
            "1_1_actor_calls_async_per_s",
            "calls/s",
            lambda: batches_per_second(async_batch, seconds),
        )

        targets = procs(2).spawn("targets", Target)
        callers = procs(2).spawn("callers", Caller, targets)
        await targets.echo.call(0)

        async def n_n_once() -> float:
            start = time.perf_counter()
            counts = await callers.call_for.call(seconds)
            total: int = sum(count for _, count in counts.items())
            return total / (time.perf_counter() - start)

        await record("n_n_actor_calls_async_per_s", "calls/s", n_n_once)

        def arg_batch() -> Awaitable[list[int]]:
            return asyncio.gather(*(target.length.call_one(PAYLOAD) for _ in range(IN_FLIGHT)))

        await record(
            "1_1_actor_calls_with_64KiB_arg_per_s",
            "calls/s",
            lambda: batches_per_second(arg_batch, seconds),
        )
    finally:
        for mesh in meshes:
            await mesh.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: fewer, shorter repetitions"
    )
    args = parser.parse_args()
    settings = QUICK if args.quick else FULL

    results: dict[str, object] = dict(asyncio.run(measure(settings)))
    results["_versions"] = {
        "monarch": importlib.metadata.version("torchmonarch"),
        "torch": importlib.metadata.version("torch"),
        "python": platform.python_version(),
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
