"""Generated plans: a k-ary fat tree (:func:`fat_tree`), optionally with an optical express
layer of OCS on its ToR or aggregation uplinks (:class:`OcsLayer`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from ._elements import (
    Host,
    Link,
    Nic,
    OcsSwitch,
    OcsWire,
    PortRef,
    ReconfigLatency,
    Switch,
    TopologyError,
)
from ._topology import Topology
from ._topology_check import _check_int

__all__ = ["OcsLayer", "fat_tree"]


@dataclasses.dataclass(frozen=True)
class OcsLayer:
    """An optical express layer for :func:`fat_tree` (Jupiter / TPU v4 / RFabric style).

    Every switch of ``tier`` gets ``uplinks`` extra uplink ports, after its electrical ports;
    uplink ``j`` is wired to OCS ``j % count`` on that OCS's next free port, so with
    ``uplinks >= count`` each OCS reaches every switch of the tier. ``radix`` defaults to the
    ports needed. The electrical tree is unchanged: circuits add capacity, never replace it.
    """

    tier: Literal["tor", "agg"] = "tor"
    count: int = 1
    uplinks: int = 1
    gbps: float = 400.0
    radix: int | None = None
    latency: ReconfigLatency = dataclasses.field(default_factory=ReconfigLatency)


def fat_tree(
    k: int,
    *,
    hosts_per_tor: int | None = None,
    accelerators_per_host: int = 8,
    nics_per_host: int = 1,
    nic_gbps: float = 400.0,
    tor_agg_gbps: float = 400.0,
    agg_core_gbps: float = 400.0,
    ocs: OcsLayer | None = None,
) -> Topology:
    """A k-ary fat tree: ``k`` pods of ``k/2`` ToRs and ``k/2`` aggregation switches, and
    ``(k/2)^2`` cores; each ToR joins every agg of its pod, agg ``j`` of each pod joins cores
    ``j*k/2 .. j*k/2 + k/2 - 1``.

    ``hosts_per_tor`` defaults to ``k/2`` (no oversubscription); each host has
    ``nics_per_host`` NICs on its ToR. Names: ``p{pod}-tor{i}``, ``p{pod}-agg{j}``, ``core{c}``,
    ``p{pod}-t{i}-h{n}``, ``nic{m}``, ``ocs{o}``. ToR ports: host NICs, then ``k/2`` agg uplinks,
    then OCS uplinks; agg ports: ``k/2`` ToRs, ``k/2`` cores, then OCS uplinks; core port = pod.
    Raises :class:`TopologyError` for impossible parameters.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 2 or k % 2:
        raise TopologyError(f"fat_tree: k={k!r}; k must be an even integer >= 2")
    half = k // 2
    hpt = half if hosts_per_tor is None else hosts_per_tor
    _check_int(hpt, "fat_tree: hosts_per_tor", "fat_tree", 1)
    _check_int(nics_per_host, "fat_tree: nics_per_host", "fat_tree", 1)
    extra = {"tor": 0, "agg": 0}
    if ocs is not None:
        _check_int(ocs.count, "fat_tree: OcsLayer.count", "fat_tree", 1)
        if (
            isinstance(ocs.uplinks, bool)
            or not isinstance(ocs.uplinks, int)
            or ocs.uplinks < ocs.count
        ):
            raise TopologyError(
                f"fat_tree: OcsLayer.uplinks={ocs.uplinks!r} is below count={ocs.count}; each "
                "OCS needs at least one uplink per switch, so use uplinks >= count"
            )
        if ocs.tier not in extra:
            raise TopologyError(f"fat_tree: OcsLayer.tier {ocs.tier!r} is not 'tor' or 'agg'")
        extra[ocs.tier] = ocs.uplinks
    down = hpt * nics_per_host
    switches: list[Switch] = []
    hosts: list[Host] = []
    links: list[Link] = []
    for p in range(k):
        for i in range(half):
            tor = f"p{p}-tor{i}"
            switches.append(Switch(tor, "tor", down + half + extra["tor"]))
            for n in range(hpt):
                nics = tuple(
                    Nic(f"nic{m}", nic_gbps, PortRef(tor, n * nics_per_host + m))
                    for m in range(nics_per_host)
                )
                hosts.append(Host(f"p{p}-t{i}-h{n}", accelerators_per_host, nics))
            for j in range(half):
                links.append(Link(PortRef(tor, down + j), PortRef(f"p{p}-agg{j}", i), tor_agg_gbps))
        for j in range(half):
            agg = f"p{p}-agg{j}"
            switches.append(Switch(agg, "agg", k + extra["agg"]))
            for c in range(half):
                links.append(
                    Link(PortRef(agg, half + c), PortRef(f"core{j * half + c}", p), agg_core_gbps)
                )
    switches.extend(Switch(f"core{c}", "core", k) for c in range(half * half))
    ocs_switches: list[OcsSwitch] = []
    wires: list[OcsWire] = []
    if ocs is not None:
        layer = [s for s in switches if s.tier == ocs.tier]
        first = k if ocs.tier == "agg" else down + half
        used = [0] * ocs.count
        for sw in layer:
            for j in range(ocs.uplinks):
                o = j % ocs.count
                wires.append(
                    OcsWire(PortRef(f"ocs{o}", used[o]), PortRef(sw.name, first + j), ocs.gbps)
                )
                used[o] += 1
        need = max(used)
        radix = need if ocs.radix is None else ocs.radix
        if radix < need:
            raise TopologyError(
                f"fat_tree: OcsLayer.radix {radix} is too small; ocs0 needs {need} ports for "
                f"{len(layer)} {ocs.tier} switches with {ocs.uplinks} uplinks over {ocs.count} OCS",
                element="ocs0",
            )
        ocs_switches = [OcsSwitch(f"ocs{o}", radix, ocs.latency) for o in range(ocs.count)]
    return Topology(tuple(hosts), tuple(switches), tuple(links), tuple(ocs_switches), tuple(wires))
