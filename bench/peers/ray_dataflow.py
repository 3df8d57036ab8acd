"""Fan-out/fan-in step overhead on Ray, the peer half of ``bench/dataflow.py``.

Run with the Ray venv's interpreter (see ``bench/_venvs.py``)::

    bench/.venvs/ray/bin/python bench/peers/ray_dataflow.py CASES [--reps R] [--depth D]

``CASES`` is a comma list of ``N:STEPS``. Ray starts locally (``num_cpus=2``, no dashboard);
the actors ask for ``num_cpus=0``, so 256 of them fit. Groups grow in ascending size: the
actors of the 64 case are the first 64 of the 256. For each size, one step is:

- ``ray``: ``ray.get([a.step.remote(i) for a in actors])``, the dynamic path;
- ``ray_compiled``: a Ray Compiled Graph ``MultiOutputNode([a.step.bind(inp) ...])`` built
  with ``experimental_compile()`` (shared-memory channels on CPU), then
  ``ray.get(compiled.execute(i))`` per step; ``pipelined`` keeps ``D`` executions in flight.

``RAY_CGRAPH_get_timeout`` is raised to 300 s (default 10 s): at 256 actors on 2 cores the
first executions after compiling took longer than 10 s and failed with
``RayChannelTimeoutError``. ``step`` returns its argument at once. Each repetition times STEPS back-to-back steps after a
warm-up repetition; figures are wall time per step in µs (median, min, max). Each actor's
resident set (``VmRSS``) and proportional set (``Pss``) are read from ``/proc`` after the
group is up. A size or system that fails is reported with its error instead of figures.

Progress goes to stderr; the last line of stdout is one JSON object:
``{"ray": {"N": {...}}, "ray_compiled": {"N": {...}}, "_versions": {...}}``.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# With 256 actors on a small machine the first executions after compiling take longer than
# the default 10 s a compiled graph waits for a result.
os.environ.setdefault("RAY_CGRAPH_get_timeout", "300")

import ray
from ray.dag import InputNode, MultiOutputNode

#: What one more Ray worker is assumed to need (bytes) until one has been measured (then: its
#: proportional set size, plus a quarter for growth); a size is skipped unless the machine has
#: that much available per new actor, plus a margin.
WORKER_ESTIMATE = 64 << 20
MARGIN = 2 << 30


@ray.remote(num_cpus=0)
class Leaf:
    def step(self, x: int) -> int:
        return x

    def pid(self) -> int:
        return os.getpid()


def log(message: str) -> None:
    print(f"ray: {message}", file=sys.stderr, flush=True)


def summarize(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def memory(pid: int) -> tuple[int, int]:
    """VmRSS and Pss of a process, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/smaps_rollup") as f:
        pss = next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    return rss * 1024, pss * 1024


def available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def per_step_us(steps: int, reps: int, run: Callable[[int], None]) -> dict[str, float]:
    """Time ``run(steps)`` ``reps`` times after one warm-up; µs per step."""
    run(steps)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        run(steps)
        samples.append((time.perf_counter() - start) / steps * 1e6)
    return summarize(samples)


def dynamic(actors: list[Any], steps: int, reps: int) -> dict[str, float]:
    def run(count: int) -> None:
        for i in range(count):
            ray.get([a.step.remote(i) for a in actors])

    return per_step_us(steps, reps, run)


def compiled(actors: list[Any], steps: int, reps: int, depth: int) -> dict[str, Any]:
    with InputNode() as inp:
        dag = MultiOutputNode([a.step.bind(inp) for a in actors])
    start = time.perf_counter()
    graph = dag.experimental_compile()
    compile_s = time.perf_counter() - start
    try:
        if ray.get(graph.execute(7)) != [7] * len(actors):
            raise RuntimeError("the compiled graph returned wrong results")

        def sequential(count: int) -> None:
            for i in range(count):
                ray.get(graph.execute(i))

        def pipelined(count: int) -> None:
            inflight: collections.deque[Any] = collections.deque()
            for i in range(count):
                if len(inflight) == depth:
                    ray.get(inflight.popleft())
                inflight.append(graph.execute(i))
            while inflight:
                ray.get(inflight.popleft())

        out: dict[str, Any] = per_step_us(steps, reps, sequential)
        out["pipelined"] = per_step_us(steps, reps, pipelined)
        out["pipeline_depth"] = depth
        out["compile_s"] = compile_s
        return out
    finally:
        graph.teardown()


def error(exc: BaseException) -> dict[str, str]:
    text = str(exc).strip().splitlines()
    return {"error": f"{type(exc).__name__}: {text[0] if text else ''}"[:400]}


def measure(cases: list[tuple[int, int]], reps: int, depth: int) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {"ray": {}, "ray_compiled": {}}
    actors: list[Any] = []
    pids: list[int] = []
    per_worker = WORKER_ESTIMATE
    for n, steps in sorted(cases):
        need = (n - len(actors)) * per_worker + MARGIN
        if need > available():
            reason = {
                "error": f"not enough memory for {n} Ray actors: {need >> 20} MiB wanted "
                f"(about {per_worker >> 20} MiB per new worker plus {MARGIN >> 20} MiB), "
                f"{available() >> 20} MiB available"
            }
            results["ray"][str(n)] = results["ray_compiled"][str(n)] = reason
            log(reason["error"])
            continue
        start = time.perf_counter()
        new = [Leaf.remote() for _ in range(n - len(actors))]
        pids += ray.get([a.pid.remote() for a in new])
        actors += new
        log(f"{n} actors up ({len(new)} new in {time.perf_counter() - start:.1f} s)")
        mem = [memory(p) for p in pids]
        per_worker = int(statistics.median(p for _, p in mem) * 1.25)
        group = actors[:n]
        try:
            dyn = dynamic(group, steps, reps)
            dyn.update(
                worker_rss=statistics.median(r for r, _ in mem),
                worker_pss=statistics.median(p for _, p in mem),
                steps=steps,
                reps=reps,
            )
            results["ray"][str(n)] = dyn
            log(f"dynamic N={n}: {dyn['median']:,.0f} us/step")
        except Exception as exc:  # a failed size is reported, the others still run
            results["ray"][str(n)] = error(exc)
            log(f"dynamic N={n} failed: {results['ray'][str(n)]['error']}")
        try:
            cg = compiled(group, steps, reps, depth)
            cg.update(steps=steps, reps=reps)
            results["ray_compiled"][str(n)] = cg
            log(
                f"compiled N={n}: {cg['median']:,.0f} us/step, pipelined "
                f"{cg['pipelined']['median']:,.0f} (compiled in {cg['compile_s']:.1f} s)"
            )
        except Exception as exc:
            results["ray_compiled"][str(n)] = error(exc)
            log(f"compiled N={n} failed: {results['ray_compiled'][str(n)]['error']}")
    for a in actors:
        ray.kill(a)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", help="comma list of N:STEPS, e.g. 64:200,256:50")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--depth", type=int, default=3, help="executions in flight, pipelined")
    args = parser.parse_args()
    cases = [(int(n), int(s)) for n, s in (c.split(":") for c in args.cases.split(","))]

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:
        results: dict[str, Any] = measure(cases, args.reps, args.depth)
    finally:
        ray.shutdown()
    results["_versions"] = {"ray": ray.__version__, "python": platform.python_version()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
