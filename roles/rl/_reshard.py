"""A generator pool changing its layout: ``n`` generators of one tensor-parallel degree
replaced by ``m`` of another (2 x tp1 -> 1 x tp2 and back on two cores; 4 x tp1 -> 2 x
tp2 -> 1 x tp4 on a host of four devices), as :func:`~._layout.choose_layout` says.

The requests in flight finish first: the pool drains. The old pool then stops, freeing its
devices, and the new one starts. The new generators load the trainer's published version
over the data plane: each reads it from the publisher's memory, and each rank keeps its
slices. The figures say where the time went.

A pool that must keep serving through the change would start the new generators first, on
devices of their own, then move the requests in flight with their KV (a handoff between
pools of different degrees: ``Generator.prefill`` and ``kv_from``). Between the steps of a
sync RL job there is nothing in flight, so draining costs nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import orchestr as oc
from orchestr import clock
from orchestr.roles._common._weightref import AnyWeightsRef
from orchestr.roles.generator import Request

from ._faults import MemberWatch
from ._layout import LayoutView, choose_layout

if TYPE_CHECKING:
    from ._job import Job

__all__ = ["adapt_pool", "drain", "reshard_pool"]


async def drain(pool: oc.Mesh, *, poll_s: float = 0.02, timeout_s: float = 3600.0) -> float:
    """Wait until no generator of ``pool`` has a request waiting or running; the seconds it
    took. Raises ``TimeoutError`` after ``timeout_s``."""
    start = clock.perf_counter()
    async with asyncio.timeout(timeout_s):
        while True:
            stats = await pool.stats.call()
            if all(s["waiting"] == 0 and s["running"] == 0 for s in stats):
                return clock.perf_counter() - start
            await asyncio.sleep(poll_s)


async def reshard_pool(
    ctx: oc.JobContext,
    pool: oc.Mesh,
    degree: int,
    count: int,
    ref: AnyWeightsRef | None,
    **spawn: Any,
) -> tuple[oc.Mesh, dict[str, float]]:
    """Replace ``pool`` by ``count`` generators of ``tp=degree``, spawned with ``spawn``
    (``checkpoint=``, ``kv=``, ``name=``...): drain, stop the old pool, spawn the new one and
    load ``ref`` (the trainer's published version; ``None``: the checkpoint's weights
    stay). Returns the new pool and the seconds of each part (``drain_s``, ``stop_s``,
    ``spawn_s``, ``load_s``, ``total_s``). Raises what spawning and loading raise; the old
    pool is stopped by then."""
    from orchestr.roles.generator import Generator

    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1 or count < 1:
        raise oc.ConfigError(f"a pool of {count!r} generators of tp={degree!r}")
    start = clock.perf_counter()
    times = {"drain_s": await drain(pool)}
    t = clock.perf_counter()
    await ctx.stop(pool)
    times["stop_s"] = clock.perf_counter() - t
    t = clock.perf_counter()
    new = await ctx.spawn(Generator, n=count, tp=degree, **spawn)
    times["spawn_s"] = clock.perf_counter() - t
    t = clock.perf_counter()
    if ref is not None:
        await asyncio.gather(*(new[i].sync_weights.call_one(ref) for i in range(count)))
    times["load_s"] = clock.perf_counter() - t
    times["total_s"] = clock.perf_counter() - start
    return new, times


async def adapt_pool(job: Job, step: int, requests: Sequence[Request]) -> None:
    """Before batch ``step`` of a sync job: ask :func:`~._layout.choose_layout` which degree
    the generator pool should run ``requests`` at, from their prompts and the last batches'
    output lengths, and re-shard the pool when it says so. Nothing happens before the first
    batch (there are no lengths to go by yet). The change is recorded in ``job.layouts`` and
    its measured seconds become the costs' ``reshard_s``."""
    costs = job.layout_costs
    if costs is None or not job.lengths:
        return
    old, degree = len(job.gens), job.gen_tp
    accelerators = old * degree
    view = LayoutView(
        accelerators=accelerators,
        degree=degree,
        degrees=tuple(job.cfg.layout_degrees),
        requests=tuple((len(r.prompt), 0) for r in requests),
        history=tuple(job.lengths),
        max_tokens=max(r.max_new_tokens for r in requests),
        phase="between_steps",
    )
    choice = choose_layout(view, costs, margin=job.cfg.layout_margin)
    if not choice.changes:
        return
    job.phase = "reshard"
    count = accelerators // choice.degree
    # between batches nothing is in flight: the old pool's busy time is final
    job.busy_retired += job.busy_since_base(await job.generator_stats())
    name = f"generators-{len(job.layouts) + 1}"
    job.gens, times = await reshard_pool(
        job.ctx, job.gens, choice.degree, count, job.current_ref, name=name, **job.gen_spawn
    )
    job.gen_tp = choice.degree
    job.watch["generator"] = [MemberWatch() for _ in range(count)]
    if job.injector is not None:
        job.injector.meshes["generator"] = job.gens
    job.busy_base = [s["busy_s"] for s in await job.generator_stats()]
    job.layout_costs = dataclasses.replace(costs, reshard_s=times["total_s"])
    predicted = {str(d): round(t, 6) for d, t in choice.predicted_s.items()}
    change = {"step": step, "from": f"{old}xtp{degree}", "to": f"{count}xtp{choice.degree}"}
    job.layouts.append(change | times | {"predicted_s": predicted})
