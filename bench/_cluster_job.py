"""The orchestr half of ``bench/cluster.py``: a job's controller on a running two-node cluster.

    ORCHESTR_TOKEN=... python bench/_cluster_job.py --address HEAD:PORT --plan PLAN_JSON

``bench/cluster.py`` runs it in the head's namespace once the head daemon and a node daemon on
each of the two namespace hosts serve; ``PLAN_JSON`` says how much of each case to run. The
actors are :class:`LightActor`: no state, one endpoint that answers at once, no resources but a
token ``cpu`` of 0.001 (as Ray's bundles ask for a token ``slot``). Cases:

- ``mesh``: ``ctx.spawn(LightActor, n=2, strategy="STRICT_SPREAD")`` then ``ctx.stop(mesh)``,
  one member per host; each spawn starts two worker processes and returns once both actors
  exist. Timed one at a time, and ``batch`` at once (spawn all, then stop all).
- ``actors``: ``ctx.spawn(LightActor, n=N, per_process=K)`` over both hosts, then one call to
  every member; timed from the spawn to the last answer, with the spawn's own share, the
  worker processes that hosted them and their memory (``Pss`` summed). Then the stop is
  timed.
- ``reserve``: ``ctx.reserve(2, strategy="STRICT_SPREAD")`` then ``release()``: a reservation
  of one bundle per host held by the head and given back, the same operation as a Ray placement
  group's create and removal. Timed one at a time, and ``batch`` at once.
- ``place``: the head's placement alone, in this process: ``HeadState.place`` of a
  ``STRICT_SPREAD`` mesh of 2 on two nodes and the release of both members (no I/O: what the
  head does for a reservation, without a round trip).
- ``head_rtt``: sequential ``ListNodes`` round trips to the head over the control plane.

The last line of stdout is one JSON object with every case's samples.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

import orchestr as oc
from orchestr._cluster._headstate import HeadState
from orchestr._log import configure_logging

#: What each light actor (and each reservation's bundle) asks for: a token of CPU.
LIGHT = {"cpu": 0.001}


class LightActor(oc.Actor):
    @oc.endpoint
    def ping(self) -> int:
        return os.getpid()


def log(message: str) -> None:
    print(f"[cluster] orchestr: {message}", file=sys.stderr, flush=True)


def pss(pids: set[int]) -> int:
    """The proportional set sizes of ``pids`` summed (shared pages divided among their users),
    in bytes: what these processes cost the machine."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    return total


async def spawn_stop(ctx: oc.JobContext) -> tuple[float, float]:
    """Create a mesh of 2 and remove it; the seconds each took."""
    start = time.perf_counter()
    mesh = await ctx.spawn(LightActor, n=2, strategy="STRICT_SPREAD", resources=LIGHT)
    spawned = time.perf_counter()
    await ctx.stop(mesh)
    return spawned - start, time.perf_counter() - spawned


async def mesh_sequential(ctx: oc.JobContext, iters: int, reps: int) -> dict[str, list[float]]:
    """``reps`` samples of meshes created and removed per second, one mesh at a time, and the
    seconds of every spawn and every stop."""
    out: dict[str, list[float]] = {"per_s": [], "spawn_s": [], "stop_s": []}
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters):
            spawn_s, stop_s = await spawn_stop(ctx)
            out["spawn_s"].append(spawn_s)
            out["stop_s"].append(stop_s)
        out["per_s"].append(iters / (time.perf_counter() - start))
    return out


async def mesh_batch(ctx: oc.JobContext, batch: int, reps: int) -> list[float]:
    """``reps`` samples of meshes per second, ``batch`` created at once and then removed at once
    (the shape of Ray's placement-group benchmark)."""
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        meshes = await asyncio.gather(
            *(
                ctx.spawn(LightActor, n=2, strategy="STRICT_SPREAD", resources=LIGHT)
                for _ in range(batch)
            )
        )
        await asyncio.gather(*(ctx.stop(m) for m in meshes))
        samples.append(batch / (time.perf_counter() - start))
    return samples


async def reserve_release(ctx: oc.JobContext) -> None:
    """Reserve a bundle on each host and give them back."""
    gang = await ctx.reserve(2, resources=LIGHT, strategy="STRICT_SPREAD")
    await gang.release()


async def reserve_sequential(ctx: oc.JobContext, iters: int, reps: int) -> list[float]:
    """``reps`` samples of reservations made and released per second, one at a time."""
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters):
            await reserve_release(ctx)
        samples.append(iters / (time.perf_counter() - start))
    return samples


async def reserve_batch(ctx: oc.JobContext, batch: int, reps: int) -> list[float]:
    """``reps`` samples of reservations per second, ``batch`` made at once, then released at
    once (as Ray's placement groups are timed)."""
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        gangs = await asyncio.gather(
            *(ctx.reserve(2, resources=LIGHT, strategy="STRICT_SPREAD") for _ in range(batch))
        )
        await asyncio.gather(*(g.release() for g in gangs))
        samples.append(batch / (time.perf_counter() - start))
    return samples


async def many_actors(ctx: oc.JobContext, n: int, per_process: int) -> dict[str, Any]:
    """Spawn ``n`` light actors ``per_process`` to a worker and call each once."""
    start = time.perf_counter()
    mesh = await ctx.spawn(LightActor, n=n, per_process=per_process, resources=LIGHT)
    spawned = time.perf_counter() - start
    pids = set(await mesh.ping.call())
    ready = time.perf_counter() - start
    memory = pss(pids)  # the job runs in the nodes' PID namespace: their workers are visible
    nodes = {a.node_id for a in await ctx.actors() if a.mesh_id == mesh.mesh_id}
    start = time.perf_counter()
    await ctx.stop(mesh)
    stopped = time.perf_counter() - start
    out = {
        "n": n,
        "per_process": per_process,
        "seconds": ready,
        "spawn_seconds": spawned,
        "stop_seconds": stopped,
        "processes": len(pids),
        "nodes": len(nodes),
        "memory_bytes": memory,
    }
    log(
        f"{n} actors, {per_process} a process ({out['processes']} processes on "
        f"{out['nodes']} hosts): all answered in {ready:.2f} s (spawn {spawned:.2f} s), "
        f"stopped in {stopped:.2f} s, {memory >> 20} MiB (Pss)"
    )
    return out


def place_only(iters: int, reps: int) -> list[float]:
    """``reps`` samples of STRICT_SPREAD placements of 2 (and their release) per second."""
    state = HeadState()
    for name in ("a", "b"):
        state.register_node(f"n-{name}", f"{name}:1", {"cpu": 2.0}, {"host": name}, 0.0)
    samples = []
    serial = 0
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters):
            serial += 1
            ids = {0: f"a-{serial}-0", 1: f"a-{serial}-1"}
            records = state.place(
                f"m-{serial}", "light", "x:Light", 2, LIGHT, {}, ids, "STRICT_SPREAD"
            )
            for record in records:
                state.actor_ended(record.actor_id, stopped=True)
                del state.actors[record.actor_id]  # a long run keeps no records
        samples.append(iters / (time.perf_counter() - start))
    return samples


async def head_rtt(ctx: oc.JobContext, seconds: float) -> list[float]:
    """Round-trip times (s) of sequential ``ListNodes`` requests for about ``seconds``."""
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        await ctx.nodes()
        times.append(time.perf_counter() - start)
    return times


async def wait_for_nodes(ctx: oc.JobContext, count: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while sum(1 for n in await ctx.nodes() if n.alive) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {count} nodes joined within {seconds:.0f} s")
        await asyncio.sleep(0.1)


async def main(ctx: oc.JobContext, plan: dict[str, Any]) -> dict[str, Any]:
    await wait_for_nodes(ctx, 2, 60)
    out: dict[str, Any] = {"plan": plan}
    out["head_rtt_s"] = await head_rtt(ctx, plan["rtt_seconds"])
    out["place_per_s"] = place_only(plan["place_iters"], plan["reps"])
    log(f"head placement alone: {max(out['place_per_s']):,.0f}/s (best)")

    await reserve_release(ctx)  # warm-up
    out["reserve_sequential_per_s"] = await reserve_sequential(
        ctx, plan["reserve_iters"], plan["reps"]
    )
    out["reserve_batch_per_s"] = await reserve_batch(ctx, plan["batch"], plan["reps"])
    log(
        f"reserve/release of 2, one at a time: {max(out['reserve_sequential_per_s']):.0f}/s, "
        f"{plan['batch']} at once: {max(out['reserve_batch_per_s']):.0f}/s (best)"
    )

    spread = await ctx.spawn(LightActor, n=2, strategy="STRICT_SPREAD", resources=LIGHT)
    hosts = {a.node_id for a in await ctx.actors() if a.mesh_id == spread.mesh_id}
    await spread.ping.call()
    await ctx.stop(spread)
    if len(hosts) != 2:
        raise RuntimeError(f"a STRICT_SPREAD mesh of 2 landed on {len(hosts)} node(s)")
    await spawn_stop(ctx)  # warm-up
    sequential = await mesh_sequential(ctx, plan["mesh_iters"], plan["reps"])
    out["mesh_sequential_per_s"] = sequential["per_s"]
    out["mesh_spawn_s"], out["mesh_stop_s"] = sequential["spawn_s"], sequential["stop_s"]
    log(
        f"mesh create/remove, one at a time: {max(sequential['per_s']):.2f}/s (best); spawn "
        f"{statistics.median(out['mesh_spawn_s']) * 1e3:.0f} ms, stop "
        f"{statistics.median(out['mesh_stop_s']) * 1e3:.0f} ms (medians)"
    )
    out["mesh_batch_per_s"] = await mesh_batch(ctx, plan["batch"], plan["reps"])
    log(f"mesh create/remove, {plan['batch']} at once: {max(out['mesh_batch_per_s']):.2f}/s (best)")

    out["actors"] = []
    for n, per_process, reps in plan["actors"]:
        for _ in range(reps):
            out["actors"].append(await many_actors(ctx, n, per_process))
    return out


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="the head, HOST:PORT")
    parser.add_argument("--plan", required=True, help="the cases, as JSON (see bench/cluster.py)")
    args = parser.parse_args()
    configure_logging(json=False, level="WARNING")
    plan = json.loads(args.plan)
    token = os.environ["ORCHESTR_TOKEN"]

    async def job(ctx: oc.JobContext) -> dict[str, Any]:
        return await main(ctx, plan)

    result = oc.run(job, address=args.address, token=token)
    print(json.dumps(result))


if __name__ == "__main__":
    run()
