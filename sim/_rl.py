"""The GRPO job on a simulated cluster: :func:`simulate_grpo` runs the job's own code
(``orchestr.roles.rl.run_grpo``: its sync, stream and stream+skew schedules, its graph, its
length ranker, its weight syncs and phases) against the role models of :mod:`._rlroles` on
virtual time."""

from __future__ import annotations

import dataclasses
import resource
import time
from typing import Any

from orchestr._call import _client
from orchestr.fabric.optical import FabricManager, Topology
from orchestr.roles.rl import GRPOConfig, GRPOResult, run_grpo

from ._cluster import SimClient, SimCluster, SimContext
from ._rlroles import LENGTHS, OutputLengths, RLCosts, rl_roles
from ._run import Simulation

__all__ = ["RLRun", "simulate_grpo"]


@dataclasses.dataclass
class RLRun:
    """A simulated GRPO run: the job's own result, where its members were placed, the phases
    it ran (``(name, start, end)``, virtual seconds), and what the simulation cost."""

    result: GRPOResult
    placement: dict[str, list[str]]
    phases: list[tuple[str, float, float]]
    virtual_s: float
    events: int
    wall_s: float
    peak_rss_bytes: int
    trace_dir: str
    trace: list[tuple[int, int, str]] | None

    def summary(self) -> dict[str, Any]:
        r = self.result
        phase_s: dict[str, float] = {}
        for name, start, end in self.phases:
            phase_s[name] = phase_s.get(name, 0.0) + end - start
        return {
            "mode": r.config.mode,
            "steps": len(r.steps),
            "samples_per_s": r.steps[-1].samples_per_s if r.steps else 0.0,
            "virtual_s": self.virtual_s,
            "generator_idle_frac": r.generator_idle_frac,
            "trainer_idle_frac": r.trainer_idle_frac,
            "version_lag": sum(s.version_lag for s in r.steps) / max(1, len(r.steps)),
            "dropped_groups": r.dropped_groups,
            "routed_long": r.routed_long,
            "weight_sync_s": r.weight_sync["seconds"],
            "phase_s": phase_s,
            "events": self.events,
            "events_per_s": self.events / self.wall_s if self.wall_s else 0.0,
            "wall_s": self.wall_s,
            "peak_rss_bytes": self.peak_rss_bytes,
        }


def simulate_grpo(
    config: GRPOConfig,
    topology: Topology,
    costs: RLCosts,
    lengths: OutputLengths | None = None,
    *,
    seed: int = 0,
    resources: dict[str, dict[str, float]] | None = None,
    fabric: FabricManager | None = None,
    trace: bool = False,
    trace_dir: str | None = None,
    host_cpus: float | None = None,
) -> RLRun:
    """Run ``config`` (its mode, counts and steps) on ``topology``'s hosts on virtual time,
    with ``costs`` and ``lengths``; ``resources`` per role (``generator``, ``trainer``,
    ``reward``) is what each member takes on a host. ``fabric``, when given, hears the job's
    phase hints and lays circuits the flow network then uses. ``host_cpus``, when given, is
    each host's cores, which its members' compute shares (a job on a machine of a few CPUs,
    as the live job on this one). Deaths are not simulated: the
    config's kills must be empty, and its checkpoints are left out.

    Raises :class:`ConfigError` for a config or placement the job or the head refuses, and
    :class:`SimulationError` when the job waits on something that never happens."""
    if config.kill:
        raise ValueError("simulate_grpo does not simulate deaths; give a config without kills")
    config = dataclasses.replace(config, checkpoint_every=0)
    lengths = lengths or OutputLengths()
    roles = rl_roles(costs, lengths, **(resources or {}))
    known = LENGTHS.set(lengths)  # for a ranker that knows them (OracleRanker)
    started, wall = time.perf_counter(), 0.0
    with Simulation(seed, trace=trace) as sim:
        cluster = SimCluster(sim.engine, topology, roles, fabric=fabric, cpus=host_cpus)
        ctx = SimContext(cluster, trace_dir=trace_dir)
        previous = _client._current
        _client.set_current_client(SimClient(cluster))  # type: ignore[arg-type]
        try:
            result = sim.run(run_grpo(ctx, config))  # type: ignore[arg-type]
        finally:
            _client.set_current_client(previous)
            LENGTHS.reset(known)
            ctx.close()
        wall = time.perf_counter() - started
        placement: dict[str, list[str]] = {}
        for actor_id, host in cluster.host_of.items():
            placement.setdefault(actor_id.split("-mesh-")[0], []).append(host)
        return RLRun(
            result=result,
            placement=placement,
            phases=ctx.phases,
            virtual_s=sim.engine.seconds,
            events=sim.engine.events_run,
            wall_s=wall,
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            trace_dir=ctx.trace_dir,
            trace=sim.engine.trace,
        )
