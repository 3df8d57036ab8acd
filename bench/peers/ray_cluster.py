"""Placement groups and many actors on a Ray cluster: the peer half of ``bench/cluster.py``.

Run with the Ray venv's interpreter (``ray==2.60.0``; see ``bench/_venvs.py``), as a driver of
a running cluster whose two worker nodes carry the custom resources ``slot`` (many) and
``hostA`` / ``hostB``::

    bench/.venvs/ray/bin/python bench/peers/ray_cluster.py --address HEAD:6379 --plan PLAN_JSON

Cases (``PLAN_JSON`` says how much of each):

- ``pg``: ``placement_group([{"slot": 0.001}] * 2, strategy="STRICT_SPREAD")``,
  ``ray.get(pg.ready())`` (a task runs in the group's first bundle: the group is usable), then
  ``remove_placement_group(pg)``. One at a time, and ``batch`` at once (create all, wait for
  all, remove all).
- ``pg_wait``: Ray's own ``placement group create/removal`` microbenchmark
  (``ray/_private/ray_perf.py``): 100 groups created, ``pg.wait(timeout_seconds=30)`` on each
  (the GCS says it is created; no task runs), all removed. Its bundles here are the two above.
- ``pg_actors``: a group as in ``pg``, then one actor (``num_cpus=0``) in each bundle, one call
  to each, both killed and the group removed: what an orchestr mesh of 2 does (each member is
  a process of its own on Ray as on orchestr). One at a time, and ``batch`` at once.
- ``actors``: ``N`` actors (``num_cpus=0``; ``hostA`` and ``hostB`` alternately) created at once
  and called once each; timed from the first ``.remote()`` to the last answer. Then all are
  killed, timed until their processes are gone; their memory is their ``Pss`` summed. Each
  actor is a process: ``N`` is lowered when the machine has not the memory for it (about its
  measured ``Pss`` per actor, plus a margin), and the output says so.

Progress goes to stderr; the last line of stdout is one JSON object with every case's samples.
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
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

BUNDLES = [{"slot": 0.001}, {"slot": 0.001}]
#: What one more Ray actor process is assumed to take until one has been measured, and what
#: the machine keeps free besides.
WORKER_ESTIMATE = 80 << 20
MARGIN = 3 << 30


@ray.remote(num_cpus=0)
class LightActor:
    def ping(self) -> int:
        return os.getpid()


def log(message: str) -> None:
    print(f"[cluster] ray: {message}", file=sys.stderr, flush=True)


def available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))


def new_group() -> Any:
    return placement_group(BUNDLES, strategy="STRICT_SPREAD")


def pg_once() -> None:
    pg = new_group()
    ray.get(pg.ready())
    remove_placement_group(pg)


def pg_batch(batch: int) -> None:
    pgs = [new_group() for _ in range(batch)]
    ray.get([pg.ready() for pg in pgs])
    for pg in pgs:
        remove_placement_group(pg)


def pg_wait_batch(batch: int) -> None:
    """Ray's release microbenchmark's shape: create, ``pg.wait``, remove."""
    pgs = [new_group() for _ in range(batch)]
    for pg in pgs:
        if not pg.wait(timeout_seconds=30):
            raise RuntimeError("a placement group was not created within 30 s")
    for pg in pgs:
        remove_placement_group(pg)


def actors_in(pg: Any) -> list[Any]:
    return [
        LightActor.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i
            )
        ).remote()
        for i in range(len(BUNDLES))
    ]


def pg_actors_batch(batch: int) -> None:
    """``batch`` groups with an actor in each bundle: create, call each actor, kill, remove."""
    pgs = [new_group() for _ in range(batch)]
    ray.get([pg.ready() for pg in pgs])
    actors = [a for pg in pgs for a in actors_in(pg)]
    ray.get([a.ping.remote() for a in actors])
    for a in actors:
        ray.kill(a)
    for pg in pgs:
        remove_placement_group(pg)


def rates(per_rep: int, reps: int, once: Any, warm_up: Any) -> list[float]:
    """``reps`` samples of ``per_rep / seconds`` of ``once()``, after ``warm_up()``."""
    warm_up()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        once()
        samples.append(per_rep / (time.perf_counter() - start))
    return samples


def wait_gone(pids: list[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(os.path.exists(f"/proc/{p}") for p in pids):
        if time.monotonic() > deadline:
            raise RuntimeError(f"actor processes still alive {seconds:.0f} s after ray.kill")
        time.sleep(0.05)


def many_actors(n: int, per_actor: int) -> dict[str, Any]:
    """``n`` actors over both hosts, each called once; then killed. ``n`` is lowered to what
    the machine's memory allows at ``per_actor`` bytes each."""
    fits = max(0, (available() - MARGIN) // per_actor)
    asked = n
    if fits < n:
        n = int(fits)
        log(f"memory allows {n} of the {asked} actors asked for ({per_actor >> 20} MiB each)")
    if n < 2:
        return {"n": n, "asked": asked, "error": "not enough memory for two actors"}
    start = time.perf_counter()
    actors = [
        LightActor.options(resources={"hostA" if i % 2 == 0 else "hostB": 0.001}).remote()
        for i in range(n)
    ]
    pids = ray.get([a.ping.remote() for a in actors])
    ready = time.perf_counter() - start
    sizes = [pss(p) for p in set(pids)]
    start = time.perf_counter()
    for a in actors:
        ray.kill(a)
    wait_gone(pids, 120)
    stopped = time.perf_counter() - start
    log(
        f"{n} actors: all answered in {ready:.2f} s, gone {stopped:.2f} s after ray.kill, "
        f"{sum(sizes) >> 20} MiB (Pss)"
    )
    return {
        "n": n,
        "asked": asked,
        "seconds": ready,
        "stop_seconds": stopped,
        "processes": len(set(pids)),
        "memory_bytes": sum(sizes),
        "pss_median_bytes": statistics.median(sizes),
    }


def wait_for_nodes(count: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while sum(1 for n in ray.nodes() if n.get("Alive")) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {count} Ray nodes alive after {seconds:.0f} s")
        time.sleep(0.2)


def measure(plan: dict[str, Any]) -> dict[str, Any]:
    wait_for_nodes(3, 90)
    reps, batch = plan["reps"], plan["batch"]
    out: dict[str, Any] = {"plan": plan}
    iters = plan["mesh_iters"]
    out["pg_sequential_per_s"] = rates(
        iters, reps, lambda: [pg_once() for _ in range(iters)], pg_once
    )
    log(f"placement group create/ready/remove, one at a time: {out['pg_sequential_per_s']}")
    out["pg_batch_per_s"] = rates(batch, reps, lambda: pg_batch(batch), lambda: pg_batch(batch))
    log(f"placement groups, {batch} at once: {out['pg_batch_per_s']}")
    out["pg_wait_batch100_per_s"] = rates(
        100, reps, lambda: pg_wait_batch(100), lambda: pg_wait_batch(100)
    )
    log(f"placement groups, Ray's microbenchmark (100, pg.wait): {out['pg_wait_batch100_per_s']}")
    iters = plan["pg_actors_iters"]
    out["pg_actors_sequential_per_s"] = rates(
        iters, reps, lambda: [pg_actors_batch(1) for _ in range(iters)], lambda: pg_actors_batch(1)
    )
    log(f"placement group + 2 actors, one at a time: {out['pg_actors_sequential_per_s']}")
    out["pg_actors_batch_per_s"] = rates(
        batch, reps, lambda: pg_actors_batch(batch), lambda: pg_actors_batch(1)
    )
    log(f"placement group + 2 actors, {batch} at once: {out['pg_actors_batch_per_s']}")

    per_actor = WORKER_ESTIMATE
    out["actors"] = []
    for n, count in plan["ray_actors"]:
        for _ in range(count):
            result = many_actors(n, per_actor)
            out["actors"].append(result)
            if result.get("pss_median_bytes"):
                per_actor = max(per_actor, int(result["pss_median_bytes"] * 1.25))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="the cluster's head, HOST:PORT")
    parser.add_argument("--plan", required=True, help="the cases, as JSON (see bench/cluster.py)")
    args = parser.parse_args()
    ray.init(address=args.address, log_to_driver=False, logging_level=logging.ERROR)
    try:
        out = measure(json.loads(args.plan))
    finally:
        ray.shutdown()
    out["_versions"] = {"ray": ray.__version__, "python": platform.python_version()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
