"""Validation of a cabling plan's elements, run once as a :class:`~._topology.Topology` is built.

:func:`check_plan` checks names (unique, usable), port counts, radixes, bandwidths and latency
models; that every NIC, link and OCS wire lands on an existing, free port of the right kind of
element; and that the electrical tree joins every two hosts by an up-down path. It raises
:class:`~._topology.TopologyError` naming the element (and port) at fault, or returns the
indices the topology's queries answer from.
"""

from __future__ import annotations

import math
from typing import Any

from ._elements import (
    _KINDS,
    TIERS,
    Element,
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

__all__ = ["check_plan"]

_RANK = {"tor": 0, "agg": 1, "core": 2}


class _Index:
    """What :class:`Topology` precomputes at construction."""

    def __init__(self) -> None:
        self.elements: dict[str, Element] = {}
        self.port_users: dict[PortRef, str] = {}
        self.host_tors: dict[str, tuple[str, ...]] = {}
        self.tor_hosts: dict[str, list[str]] = {}
        self.nic_gbps: dict[tuple[str, str], float] = {}  # (host, tor) -> summed NIC rate
        self.rank: dict[str, int] = {}  # switch -> 0 tor, 1 agg, 2 core
        self.adj: dict[str, dict[str, float]] = {}  # switch -> neighbour -> summed link rate
        self.reach: dict[str, dict[str, list[int]]] = {}  # ocs -> switch -> ocs ports
        self.ocs_wires: dict[str, dict[int, OcsWire]] = {}
        self.wire_at: dict[PortRef, OcsWire] = {}
        self.accelerators: tuple[str, ...] = ()
        self.routes: dict[str, dict[tuple[str, bool], tuple[int, float, Any]]] = {}


def check_plan(topo: Topology) -> _Index:
    """Validate ``topo``'s elements and index them; raises :class:`TopologyError` naming the
    element at fault. Pure computation, no I/O."""
    ix = _Index()
    _check_elements(topo, ix)
    _check_hosts(topo, ix)
    _check_links(topo, ix)
    _check_wires(topo, ix)
    _check_connected(topo, ix)
    return ix


def _kind(element: object) -> str:
    return _KINDS.get(type(element), "element")


def _check_name(name: object, where: str) -> str:
    if (
        not isinstance(name, str)
        or not name
        or not name.isprintable()
        or any(c.isspace() or c == ":" for c in name)
    ):
        raise TopologyError(
            f"{where}: name {name!r} is not usable; names are non-empty printable strings "
            "without whitespace or ':'",
            element=str(name),
        )
    return name


def _check_int(value: object, where: str, element: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TopologyError(f"{where} is {value!r}; give an integer >= {minimum}", element=element)


def _check_number(value: object, where: str, element: str, *, positive: bool) -> None:
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TopologyError(
            f"{where} is {value!r}, not a number; give a number {bound}", element=element
        )
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise TopologyError(f"{where} is {value!r}; give a finite number {bound}", element=element)


def _resolve(ref: object, user: str, ix: _Index) -> tuple[PortRef, Element]:
    if not isinstance(ref, PortRef) or not isinstance(ref.element, str):
        raise TopologyError(f"{user}: {ref!r} is not a port reference ('element:index')")
    element = ix.elements.get(ref.element)
    if element is None:
        raise TopologyError(
            f"{user} refers to unknown element {ref.element!r} (port {ref}); declare it in the "
            "plan or correct the name",
            element=ref.element,
        )
    return ref, element


def _check_port(ref: PortRef, element: Switch | OcsSwitch, user: str) -> None:
    count = element.ports if isinstance(element, Switch) else element.radix
    port = ref.port
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < count:
        if isinstance(element, OcsSwitch):
            text = (
                f"radix exceeded: {user} uses port {ref}, but OCS {element.name} has radix {count}"
            )
        else:
            text = f"dangling port: {user} uses port {ref}, but switch {element.name} has {count} ports"
        raise TopologyError(
            f"{text} (ports 0..{count - 1}); raise the port count or use an existing port",
            element=element.name,
            port=port if isinstance(port, int) else None,
        )


def _claim(ix: _Index, ref: PortRef, user: str) -> None:
    first = ix.port_users.get(ref)
    if first is None:
        ix.port_users[ref] = user
    else:
        raise TopologyError(
            f"port {ref} is wired twice: by {first} and by {user}; a port takes one cable",
            element=ref.element,
            port=ref.port,
        )


def _check_elements(topo: Topology, ix: _Index) -> None:
    groups: tuple[tuple[str, tuple[Any, ...], type[Element]], ...] = (
        ("hosts", topo.hosts, Host),
        ("switches", topo.switches, Switch),
        ("ocs", topo.ocs, OcsSwitch),
    )
    for key, items, cls in groups:
        for i, item in enumerate(items):
            if not isinstance(item, cls):
                raise TopologyError(f"{key}[{i}] is a {type(item).__name__}, not a {cls.__name__}")
            name = _check_name(item.name, f"{key}[{i}]")
            other = ix.elements.setdefault(name, item)
            if other is not item:
                raise TopologyError(
                    f"duplicate name {name!r}: a {_kind(other)} and a {_kind(item)} share it; "
                    "names are unique across hosts, switches and OCS",
                    element=name,
                )
    for s in topo.switches:
        if s.tier not in TIERS:
            raise TopologyError(
                f"switch {s.name}: tier {s.tier!r} is not one of {', '.join(TIERS)}", element=s.name
            )
        _check_int(s.ports, f"switch {s.name}: port count", s.name, 1)
        ix.adj[s.name] = {}
        ix.rank[s.name] = _RANK[s.tier]
    for o in topo.ocs:
        _check_int(o.radix, f"OCS {o.name}: radix", o.name, 1)
        lat = o.latency
        if not isinstance(lat, ReconfigLatency):
            raise TopologyError(f"OCS {o.name}: latency must be a ReconfigLatency", element=o.name)
        for attr in ("switch_ms", "settle_ms", "control_ms"):
            _check_number(
                getattr(lat, attr), f"OCS {o.name}: latency {attr}", o.name, positive=False
            )
        _check_int(lat.concurrency, f"OCS {o.name}: latency concurrency", o.name, 0)
        ix.reach[o.name] = {}
        ix.ocs_wires[o.name] = {}


def _check_hosts(topo: Topology, ix: _Index) -> None:
    accelerators: list[str] = []
    for h in topo.hosts:
        _check_int(h.accelerators, f"host {h.name}: accelerator count", h.name, 0)
        if not isinstance(h.nics, tuple) or not h.nics:
            raise TopologyError(
                f"host {h.name} has no NIC; give it at least one NIC cabled to a ToR port",
                element=h.name,
            )
        seen: set[str] = set()
        tors: list[str] = []
        for j, nic in enumerate(h.nics):
            if not isinstance(nic, Nic):
                raise TopologyError(f"host {h.name}: nics[{j}] is not a Nic", element=h.name)
            nic_name = _check_name(nic.name, f"host {h.name}: nics[{j}]")
            user = f"NIC {h.name}/{nic_name}"
            if nic_name in seen:
                raise TopologyError(
                    f"host {h.name} has two NICs named {nic_name!r}", element=h.name
                )
            seen.add(nic_name)
            _check_number(nic.gbps, f"{user}: bandwidth (Gbit/s)", h.name, positive=True)
            ref, sw = _resolve(nic.port, user, ix)
            if not isinstance(sw, Switch) or sw.tier != "tor":
                what = f"a {sw.tier} switch" if isinstance(sw, Switch) else f"a {_kind(sw)}"
                raise TopologyError(
                    f"{user} is cabled to {ref}, {what}; host NICs cable to ToR switch ports",
                    element=sw.name,
                )
            _check_port(ref, sw, user)
            _claim(ix, ref, user)
            if sw.name not in tors:
                tors.append(sw.name)
                ix.tor_hosts.setdefault(sw.name, []).append(h.name)
            key = (h.name, sw.name)
            ix.nic_gbps[key] = ix.nic_gbps.get(key, 0.0) + nic.gbps
        ix.host_tors[h.name] = tuple(tors)
        accelerators.extend(f"{h.name}:{a}" for a in range(h.accelerators))
    ix.accelerators = tuple(accelerators)


def _check_links(topo: Topology, ix: _Index) -> None:
    for i, link in enumerate(topo.links):
        if not isinstance(link, Link):
            raise TopologyError(f"links[{i}] is a {type(link).__name__}, not a Link")
        user = f"link links[{i}] ({link.a} <-> {link.b})"
        ends: list[tuple[PortRef, Switch]] = []
        for end in (link.a, link.b):
            ref, sw = _resolve(end, user, ix)
            if not isinstance(sw, Switch):
                hint = (
                    "OCS ports are wired with [[wires]]"
                    if isinstance(sw, OcsSwitch)
                    else "a host's NICs name their ToR port themselves"
                )
                raise TopologyError(
                    f"{user} ends at {sw.name}, a {_kind(sw)}; links join switch ports ({hint})",
                    element=sw.name,
                )
            _check_port(ref, sw, user)
            ends.append((ref, sw))
        (a_ref, a), (b_ref, b) = ends
        if a.name == b.name:
            raise TopologyError(f"{user} joins switch {a.name} to itself", element=a.name)
        _claim(ix, a_ref, user)
        _claim(ix, b_ref, user)
        _check_number(link.gbps, f"{user}: bandwidth (Gbit/s)", a.name, positive=True)
        ix.adj[a.name][b.name] = ix.adj[a.name].get(b.name, 0.0) + link.gbps
        ix.adj[b.name][a.name] = ix.adj[b.name].get(a.name, 0.0) + link.gbps


def _check_wires(topo: Topology, ix: _Index) -> None:
    per_ocs: dict[object, int] = {}
    for wire in topo.wires:
        if isinstance(wire, OcsWire) and isinstance(wire.ocs_port, PortRef):
            name = wire.ocs_port.element
            if isinstance(name, str):
                per_ocs[name] = per_ocs.get(name, 0) + 1
    for o in topo.ocs:
        if per_ocs.get(o.name, 0) > o.radix:
            raise TopologyError(
                f"radix exceeded: OCS {o.name} has radix {o.radix} but {per_ocs[o.name]} wires; "
                "raise its radix or move wires to another OCS",
                element=o.name,
            )
    for i, wire in enumerate(topo.wires):
        if not isinstance(wire, OcsWire):
            raise TopologyError(f"wires[{i}] is a {type(wire).__name__}, not an OcsWire")
        user = f"wire wires[{i}] ({wire.ocs_port} <-> {wire.switch_port})"
        oref, ocs = _resolve(wire.ocs_port, user, ix)
        if not isinstance(ocs, OcsSwitch):
            raise TopologyError(
                f"{user}: its OCS end {oref} is on {ocs.name}, a {_kind(ocs)}, not an OCS",
                element=ocs.name,
            )
        _check_port(oref, ocs, user)
        sref, sw = _resolve(wire.switch_port, user, ix)
        if not isinstance(sw, Switch) or sw.tier == "core":
            what = f"a {sw.tier} switch" if isinstance(sw, Switch) else f"a {_kind(sw)}"
            raise TopologyError(
                f"{user}: OCS {ocs.name} is wired to {sw.name}, {what}; OCS ports wire to ToR or "
                "aggregation switch uplinks, not to host NICs, core switches or other OCS",
                element=sw.name,
            )
        _check_port(sref, sw, user)
        _check_number(wire.gbps, f"{user}: bandwidth (Gbit/s)", ocs.name, positive=True)
        _claim(ix, oref, user)
        _claim(ix, sref, user)
        ix.ocs_wires[ocs.name][oref.port] = wire
        ix.reach[ocs.name].setdefault(sw.name, []).append(oref.port)
        ix.wire_at[oref] = ix.wire_at[sref] = wire
    for reach in ix.reach.values():
        for ports in reach.values():
            ports.sort()


def _check_connected(topo: Topology, ix: _Index) -> None:
    """Every two hosts need an up-down electrical path: up through strictly higher tiers, at
    most one link across a tier at the top, then down (the path :meth:`Topology.path` takes)."""
    up: dict[str, frozenset[str]] = {}

    def climb(s: str) -> frozenset[str]:
        got = up.get(s)
        if got is None:
            acc = {s}
            for v in ix.adj[s]:
                if ix.rank[v] > ix.rank[s]:
                    acc |= climb(v)
            got = up[s] = frozenset(acc)
        return got

    groups: dict[tuple[str, ...], str] = {}  # ToRs of a host -> first such host
    for h in topo.hosts:
        groups.setdefault(ix.host_tors[h.name], h.name)
    ups = {tors: frozenset().union(*(climb(t) for t in tors)) for tors in groups}
    if len(ups) < 2 or frozenset.intersection(*ups.values()):
        return  # a common root (a core everyone climbs to) joins everything
    # one step from the climb reaches a switch across the top (or below: also a valid turn)
    across = {tors: u.union(*(ix.adj[s].keys() for s in u)) for tors, u in ups.items()}
    keys = list(groups)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            if ups[a].isdisjoint(across[b]):
                ha, hb = groups[a], groups[b]
                raise TopologyError(
                    f"fabric is disconnected: no electrical up-down path from host {ha} "
                    f"(ToR {', '.join(a)}) to host {hb} (ToR {', '.join(b)}); cable their ToRs "
                    "up to a common aggregation or core switch",
                    element=hb,
                )
