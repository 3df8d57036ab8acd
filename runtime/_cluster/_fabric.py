"""The head's side of the fabric manager: phase hints from jobs, in terms of their meshes,
turned into switch-to-switch traffic from where the meshes' members run, and the manager
built for a head daemon from a cabling plan.

A node is placed on the fabric by its ``fabric_host`` label (``orchestr start --address HEAD
--labels fabric_host=h0``): the name of a host of the plan. Members on other nodes are off the
managed fabric and their traffic is left out of the hints.

The OCS driver is chosen by name (``orchestr start --head --fabric PLAN --ocs-driver NAME``):
``sim`` simulates the plan's switches in the head; ``netns:TAG`` drives the emulated fabric of
network namespaces that another process opened with that tag
(:class:`~orchestr.fabric.optical.NetnsFabric`; its hosts are named after the switches the
plan's one OCS reaches, and the manager's switch pairs are routed as those hosts' pairs).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestr.errors import ConfigError, OrchestrError

if TYPE_CHECKING:
    from orchestr.fabric.optical import FabricManager, OcsDriver, Router, Topology

    from ._headstate import HeadState

__all__ = ["FABRIC_HOST_LABEL", "fabric_hint", "open_fabric"]

#: The node label that names the node's host in the fabric's cabling plan.
FABRIC_HOST_LABEL = "fabric_host"


def open_fabric(plan: Path, driver: str = "sim") -> FabricManager:
    """A fabric manager for the cabling plan in ``plan``, its OCS driven by ``driver``: ``sim``
    (in-process simulated switches, MEMS-like latency) or ``netns:TAG`` (the running emulated
    fabric with that tag; see the module). Blocks on reading the plan (and, for ``netns``, the
    kernel). Raises ConfigError (a TopologyError for a bad plan)."""
    from orchestr.fabric.optical import FabricManager, RecordingRouter, SimOcs, load_topology

    topology = load_topology(plan)
    kind, _, tag = driver.partition(":")
    if kind == "sim" and not tag:
        drivers: dict[str, OcsDriver] = {o.name: SimOcs(o.radix) for o in topology.ocs}
        return FabricManager(topology, drivers, RecordingRouter())
    if kind == "netns" and tag:
        drivers, router = _netns_drivers(topology, tag)
        return FabricManager(topology, drivers, router)
    raise ConfigError(
        f"unknown OCS driver {driver!r}; say 'sim', or 'netns:TAG' for the emulated fabric "
        "whose namespaces are ocf-TAG-*"
    )


def _netns_drivers(topology: Topology, tag: str) -> tuple[dict[str, OcsDriver], Router]:
    from orchestr.fabric.optical import (
        NetnsError,
        NetnsFabric,
        NetnsOcs,
        NetnsRouter,
        netns_missing,
    )

    if len(topology.ocs) != 1:
        raise ConfigError(
            f"the netns OCS driver emulates one OCS; the plan has {len(topology.ocs)}"
        )
    [ocs] = topology.ocs
    wires = topology.ocs_wires(ocs.name)
    if sorted(wires) != list(range(ocs.radix)):
        raise ConfigError(
            f"the netns OCS driver needs every port of {ocs.name} wired; ports "
            f"{sorted(set(range(ocs.radix)) - set(wires))} are not"
        )
    port_map = [wires[p].switch_port.element for p in range(ocs.radix)]
    why = netns_missing()
    if why is not None:
        raise ConfigError(f"the netns OCS driver cannot run here: {why}")
    try:
        fabric = NetnsFabric.attach(tag)
    except (NetnsError, ValueError) as exc:
        raise ConfigError(f"the netns OCS driver cannot attach to fabric {tag!r}: {exc}") from exc
    missing = sorted(set(port_map) - set(fabric.hosts))
    if missing:
        raise ConfigError(
            f"the emulated fabric {tag} has hosts {', '.join(fabric.hosts)}, but {ocs.name} "
            f"reaches {', '.join(missing)}: name the fabric's hosts after the switches the "
            "OCS reaches"
        )
    return {ocs.name: NetnsOcs(fabric, port_map)}, NetnsRouter(fabric)


def _members_by_switch(
    fabric: FabricManager, state: HeadState, mesh_ids: set[str]
) -> dict[str, list[str | None]]:
    out: dict[str, list[str | None]] = {}
    for mesh_id in mesh_ids:
        members = state.mesh_members(mesh_id)
        if not members:
            raise ConfigError(f"no mesh {mesh_id!r} on this cluster")
        switches: list[str | None] = []
        for member in members:
            node = state.nodes.get(member.node_id)
            host = node.labels.get(FABRIC_HOST_LABEL) if node is not None else None
            try:
                switches.append(fabric.host_endpoint(host) if host else None)
            except OrchestrError:
                switches.append(None)  # a label naming no host of the plan: off the fabric
        out[mesh_id] = switches
    return out


async def fabric_hint(fabric: FabricManager, state: HeadState, request: Any) -> dict[str, Any]:
    """Serve a ``FabricHintRequest``: the plan record (or, for a dry run, the plan)."""
    from orchestr.fabric.optical import Hint, hint_demand

    traffic: Any = None
    if request.collective:
        mesh_ids = {request.collective_mesh_id}
        traffic = (request.collective, request.collective_mesh_id, request.collective_bytes)
    else:
        mesh_ids = {t.src_mesh_id for t in request.traffic} | {
            t.dst_mesh_id for t in request.traffic
        }
        traffic = {(t.src_mesh_id, t.dst_mesh_id): t.nbytes for t in request.traffic} or None
    if not (math.isfinite(request.lead_s) and math.isfinite(request.expected_s)):
        raise ConfigError("a hint's lead_s and expected_s are finite numbers of seconds")
    demand = hint_demand(traffic, _members_by_switch(fabric, state, mesh_ids))
    for t in request.demand:
        if t.src != t.dst:
            demand[(t.src, t.dst)] = demand.get((t.src, t.dst), 0.0) + t.nbytes
    hint = Hint(
        request.job_id or "-",
        request.phase or "phase",
        demand,
        request.expected_s or None,
        request.repeats or 1.0,
        max(0.0, request.lead_s),
    )
    if request.dry_run:
        plan = fabric.plan(hint)
        return {
            "phase": hint.phase,
            "demand": [[a, b, n] for (a, b), n in sorted(demand.items())],
            "add": [[c.a, c.b, n] for c, n in sorted(plan.add.counts().items(), key=str)],
            "remove": [[c.a, c.b, n] for c, n in sorted(plan.remove.counts().items(), key=str)],
            "keep": [[c.a, c.b, n] for c, n in sorted(plan.keep.counts().items(), key=str)],
            "predicted_s_static": plan.predicted_s_static,
            "predicted_s_with": plan.predicted_s_with,
            "saving_s": plan.saving_s,
            "reconfig_cost_s": plan.reconfig_cost_s,
            "commit": plan.commit,
            "reason": plan.reason,
        }
    record = await fabric.hint(hint)
    return record.to_json()
