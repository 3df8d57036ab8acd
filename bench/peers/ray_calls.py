"""Actor-call microbenchmarks on Ray, named after Ray's own microbenchmark.

Run with the Ray venv's interpreter (see ``bench/_venvs.py``)::

    bench/.venvs/ray/bin/python bench/peers/ray_calls.py [--quick]

Metrics (Ray runs locally with ``num_cpus=2``, no dashboard):

``1_1_actor_calls_sync_p50_us``
    The driver makes sequential round trips to one actor (small int in, same
    int out); median latency of one repetition's calls, in microseconds.
``1_1_actor_calls_async_per_s``
    The driver submits 1,000 calls to one actor, then waits for all of them;
    batches repeat for about a second.  Calls per second.
``n_n_actor_calls_async_per_s``
    Two caller actors (separate worker processes, so they run concurrently)
    each repeatedly submit 1,000 calls spread round-robin over two target
    actors and wait for them.  Total calls per second over both callers,
    timed by the driver from start to the moment both callers are done.
``1_1_actor_calls_with_64KiB_arg_per_s``
    Like ``1_1_actor_calls_async_per_s`` but each call carries a 64 KiB
    ``bytes`` argument; the method returns its length.

Each metric is measured in several repetitions (one warm-up round first) and
reported as median, min and max.  Human-readable lines go to stderr; the last
line of stdout is one JSON object with every metric plus ``_versions``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray

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


@ray.remote
class Target:
    """The actor being called: trivial methods only."""

    def echo(self, value: int) -> int:
        return value

    def size(self, data: bytes) -> int:
        return len(data)


@ray.remote
class Caller:
    """An actor that drives calls to a list of target actors."""

    def __init__(self, targets: list[ray.actor.ActorHandle[Target]]) -> None:
        self.targets = targets

    def ready(self) -> bool:
        return True

    def call_for(self, seconds: float) -> int:
        """Issue batches of IN_FLIGHT calls until ``seconds`` pass; return the count."""
        deadline = time.perf_counter() + seconds
        count = 0
        n = len(self.targets)
        while True:
            ray.get([self.targets[i % n].echo.remote(i) for i in range(IN_FLIGHT)])
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


def batches_per_second(batch: Callable[[], None], seconds: float) -> float:
    """Run ``batch`` (IN_FLIGHT calls) repeatedly for ``seconds``; return calls/s."""
    calls = 0
    start = time.perf_counter()
    while True:
        batch()
        calls += IN_FLIGHT
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return calls / elapsed


def sync_p50_us(target: ray.actor.ActorHandle[Target], calls: int) -> float:
    """Median latency of ``calls`` sequential round trips, in microseconds."""
    latencies: list[float] = []
    for i in range(calls):
        start = time.perf_counter()
        ray.get(target.echo.remote(i))
        latencies.append(time.perf_counter() - start)
    return statistics.median(latencies) * 1e6


def measure(settings: Settings) -> dict[str, dict[str, float]]:
    """Run all four metrics and return their summaries."""
    results: dict[str, dict[str, float]] = {}
    seconds = settings.seconds_per_repetition

    def record(name: str, unit: str, run_once: Callable[[], float]) -> None:
        run_once()  # warm-up
        samples = [run_once() for _ in range(settings.repetitions)]
        results[name] = summarize(samples)
        s = results[name]
        print(
            f"{name:40s} median {s['median']:>12,.1f} {unit}"
            f"  (min {s['min']:,.1f}, max {s['max']:,.1f}, n={len(samples)})",
            file=sys.stderr,
            flush=True,
        )

    target = Target.remote()
    if ray.get(target.size.remote(PAYLOAD)) != len(PAYLOAD):
        raise RuntimeError("64 KiB argument did not arrive intact")

    record("1_1_actor_calls_sync_p50_us", "us", lambda: sync_p50_us(target, settings.sync_calls))

    def async_batch() -> None:
        ray.get([target.echo.remote(i) for i in range(IN_FLIGHT)])

    record(
        "1_1_actor_calls_async_per_s", "calls/s", lambda: batches_per_second(async_batch, seconds)
    )

    targets = [Target.remote() for _ in range(2)]
    callers = [Caller.remote(targets) for _ in range(2)]
    ray.get([c.ready.remote() for c in callers] + [t.echo.remote(0) for t in targets])

    def n_n_once() -> float:
        start = time.perf_counter()
        counts: list[int] = ray.get([c.call_for.remote(seconds) for c in callers])
        return sum(counts) / (time.perf_counter() - start)

    record("n_n_actor_calls_async_per_s", "calls/s", n_n_once)

    def arg_batch() -> None:
        # Passed by value: 64 KiB is below Ray's limit for inlining arguments
        # into the task spec, so no object-store put is involved.
        ray.get([target.size.remote(PAYLOAD) for _ in range(IN_FLIGHT)])

    record(
        "1_1_actor_calls_with_64KiB_arg_per_s",
        "calls/s",
        lambda: batches_per_second(arg_batch, seconds),
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: fewer, shorter repetitions"
    )
    args = parser.parse_args()
    settings = QUICK if args.quick else FULL

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:
        results: dict[str, object] = dict(measure(settings))
    finally:
        ray.shutdown()
    results["_versions"] = {"ray": ray.__version__, "python": platform.python_version()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
