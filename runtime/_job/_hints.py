"""Telling the cluster's fabric manager of a phase's traffic, in terms of the job's meshes, and
waiting for the circuits it plans: what ``ctx.phase`` and ``ctx.announce`` do first."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from orchestr.errors import ConfigError

from ._phases import Collective, Phase

if TYPE_CHECKING:
    from ._context import JobContext

__all__ = ["tell_fabric"]

log = structlog.get_logger("orchestr.driver")


async def tell_fabric(job: JobContext, phase: Phase, lead_s: float = 0.0) -> None:
    """Send ``phase``'s traffic to the cluster's fabric manager (``Config.fabric`` is
    ``managed`` and the head runs one) and wait for the circuits it plans; the plan, its
    decision and the reconfiguration's steps go to the event log on the ``fabric`` track.
    A head without a fabric manager is asked once."""
    if job.config.fabric != "managed" or phase.traffic is None:
        return
    if job._fabric_on is None:  # ask the head once whether it runs a fabric manager
        try:
            await job._client.fabric_show()
            job._fabric_on = True
        except ConfigError as exc:
            if "runs no fabric manager" not in str(exc):
                raise
            job._fabric_on = False
    if not job._fabric_on:
        return
    ids = {m.name: m.mesh_id for m in job._meshes}  # the newest mesh of each name
    named = (
        {phase.traffic.mesh}
        if isinstance(phase.traffic, Collective)
        else {m for pair in phase.traffic for m in pair}
    )
    unknown = sorted(named - set(ids))
    if unknown:  # a hint is advice: the phase runs, the log says what was left out
        log.warning(
            "a phase names meshes this job has not spawned", phase=phase.name, meshes=unknown
        )
        job.events.record("fabric_hint_skipped", phase=phase.name, unknown_meshes=unknown)
    collective: tuple[str, str, float] | None = None
    traffic: list[tuple[str, str, float]] = []
    if isinstance(phase.traffic, Collective):
        if unknown:
            return
        collective = (phase.traffic.kind, ids[phase.traffic.mesh], phase.traffic.nbytes)
    else:
        traffic = [
            (ids[src], ids[dst], nbytes)
            for (src, dst), nbytes in phase.traffic.items()
            if src in ids and dst in ids
        ]
        if not traffic:
            return
    start = time.time()
    began = time.perf_counter()
    record = await job._client.fabric_hint(
        phase.name,
        job_id=job.job_id,
        traffic=traffic,
        collective=collective,
        expected_s=phase.expected_s or 0.0,
        lead_s=lead_s,
    )
    job.events.record_span(
        f"circuits for {phase.name}",
        start,
        time.perf_counter() - began,
        track="fabric",
        kind="fabric_plan",
        phase=phase.name,
        lead_s=lead_s,
        status=record["status"],
        commit=record["commit"],
        reason=record["reason"],
        generation=record["generation"],
        add=record["add"],
        remove=record["remove"],
        timings=record["timings"],
    )
