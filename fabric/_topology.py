"""The fabric's topology model: an explicit cabling plan, validated once, queried often.

A plan lists hosts (accelerators and NICs, each NIC cabled to a ToR port), electrical switches
by tier (``tor``, ``agg``, ``core``), electrical links between switch ports, OCS (optical
circuit switches) with a radix and a reconfiguration latency model, and wires from OCS ports to
ToR or aggregation uplink ports. The electrical tree must join every pair of hosts by an up-down
path on its own: the manager drains traffic onto it while circuits are reprogrammed, so OCS
circuits are an express layer on top, never the only way between two hosts.

Ports are 0-based: ``tor0:3`` is port 3 of ``tor0``. Names are unique across hosts, switches
and OCS, printable, without whitespace or ``:``. Bandwidths are in Gbit/s. Plan file schema
(TOML; YAML with the same keys when PyYAML is installed)::

    version = 1                                 # optional; 1 is the only version

    [[switches]]
    name = "tor0"
    tier = "tor"                                # "tor" | "agg" | "core"
    ports = 8

    [[hosts]]
    name = "h0"
    accelerators = 8
    nics = [{ name = "nic0", gbps = 400, port = "tor0:0" }]   # at least one, on ToR ports

    [[links]]                                   # switch port <-> switch port
    a = "tor0:4"
    b = "agg0:0"
    gbps = 400

    [[ocs]]
    name = "ocs0"
    radix = 16                                  # ports 0..15
    latency = { switch_ms = 25, settle_ms = 100, control_ms = 500, concurrency = 0 }

    [[wires]]                                   # OCS port <-> ToR/agg uplink port
    ocs = "ocs0:0"
    port = "tor0:6"
    gbps = 400                                  # line rate of the uplink's transceiver

``latency`` and each of its keys are optional (defaults of :class:`ReconfigLatency`).
:meth:`Topology.to_toml` writes the same schema with one inline table per line.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from orchestr.errors import ConfigError

__all__ = [
    "CircuitCandidate",
    "ElectricalPath",
    "Host",
    "Link",
    "Nic",
    "OcsLayer",
    "OcsSwitch",
    "OcsWire",
    "PortRef",
    "ReconfigLatency",
    "Switch",
    "Topology",
    "TopologyError",
    "dump_topology",
    "fat_tree",
    "load_topology",
    "topology_from_dict",
]

Tier = Literal["tor", "agg", "core"]
TIERS: tuple[Tier, ...] = ("tor", "agg", "core")
_RANK = {"tor": 0, "agg": 1, "core": 2}


class TopologyError(ConfigError):
    """A cabling plan is invalid, or a query names something the plan lacks.

    The message names the element (and port); ``element`` and ``port`` carry them for programs.
    """

    def __init__(self, message: str, *, element: str | None = None, port: int | None = None):
        super().__init__(message)
        self.element = element
        self.port = port


@dataclasses.dataclass(frozen=True, order=True)
class PortRef:
    """Port ``port`` (0-based) of the element named ``element``; written ``element:port``."""

    element: str
    port: int

    def __str__(self) -> str:
        return f"{self.element}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> PortRef:
        """``"tor0:3"`` -> ``PortRef("tor0", 3)``; raises :class:`TopologyError` otherwise."""
        name, sep, index = text.rpartition(":")
        if not sep or not name or not (index.isascii() and index.isdigit()):
            raise TopologyError(f"port reference {text!r} is not of the form 'element:index'")
        return cls(name, int(index))


@dataclasses.dataclass(frozen=True)
class Nic:
    """A host NIC: its name on the host, line rate, and the ToR port it is cabled to."""

    name: str
    gbps: float
    port: PortRef


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    accelerators: int
    nics: tuple[Nic, ...]

    def __post_init__(self) -> None:
        if isinstance(self.nics, list):
            object.__setattr__(self, "nics", tuple(self.nics))


@dataclasses.dataclass(frozen=True)
class Switch:
    """An electrical switch with ``ports`` ports (0..ports-1)."""

    name: str
    tier: Tier
    ports: int


@dataclasses.dataclass(frozen=True)
class Link:
    """An electrical cable between two switch ports."""

    a: PortRef
    b: PortRef
    gbps: float


@dataclasses.dataclass(frozen=True)
class ReconfigLatency:
    """How long reprogramming an OCS takes.

    A change of ``k`` OCS ports costs ``control_ms`` (control plane: compute, RPCs, driver
    commit), then ``ceil(k / concurrency)`` rounds of ``switch_ms`` (mirror moves; concurrency 0
    moves all ports at once, as MEMS switches do), then ``settle_ms`` (optics settle, links
    train and are verified). The defaults are orders of magnitude for a MEMS OCS (ms to switch,
    about a second end to end), not a measurement.
    """

    switch_ms: float = 25.0
    settle_ms: float = 100.0
    control_ms: float = 500.0
    concurrency: int = 0

    def expected_ms(self, ports: int) -> float:
        """Expected milliseconds to change the cross-connects of ``ports`` OCS ports."""
        if ports <= 0:
            return 0.0
        rounds = 1 if self.concurrency == 0 else -(-ports // self.concurrency)
        return self.control_ms + rounds * self.switch_ms + self.settle_ms


@dataclasses.dataclass(frozen=True)
class OcsSwitch:
    """An optical circuit switch: ``radix`` ports (0..radix-1), any two of which it can join."""

    name: str
    radix: int
    latency: ReconfigLatency = dataclasses.field(default_factory=ReconfigLatency)


@dataclasses.dataclass(frozen=True)
class OcsWire:
    """A fibre from an OCS port to a ToR or aggregation uplink port, at ``gbps``."""

    ocs_port: PortRef
    switch_port: PortRef
    gbps: float


@dataclasses.dataclass(frozen=True)
class ElectricalPath:
    """Nodes from source to destination (hosts at the ends) and each hop's capacity.

    Parallel cables between the same two nodes count as one hop of their summed capacity.
    """

    nodes: tuple[str, ...]
    hop_gbps: tuple[float, ...]

    @property
    def hops(self) -> int:
        return len(self.hop_gbps)

    @property
    def bottleneck_gbps(self) -> float:
        """The smallest hop capacity; ``inf`` for a path of no hops (a host to itself)."""
        return min(self.hop_gbps, default=math.inf)


@dataclasses.dataclass(frozen=True)
class CircuitCandidate:
    """Two switches one OCS can join, and the free OCS ports wired to each (their budget)."""

    ocs: str
    a: str
    b: str
    a_ports: tuple[int, ...]
    b_ports: tuple[int, ...]

    @property
    def max_circuits(self) -> int:
        return min(len(self.a_ports), len(self.b_ports))


Element = Host | Switch | OcsSwitch


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


_KINDS: dict[type, str] = {Host: "host", Switch: "switch", OcsSwitch: "OCS"}


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


@dataclasses.dataclass(frozen=True, repr=False)
class Topology:
    """A validated cabling plan; construction raises :class:`TopologyError` naming the element.

    Immutable; queries are plain computations (no I/O), O(1) on precomputed indices except path
    queries, which search once per source switch and then answer from a cache.
    """

    hosts: tuple[Host, ...] = ()
    switches: tuple[Switch, ...] = ()
    links: tuple[Link, ...] = ()
    ocs: tuple[OcsSwitch, ...] = ()
    wires: tuple[OcsWire, ...] = ()
    _ix: _Index = dataclasses.field(init=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("hosts", "switches", "links", "ocs", "wires"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, Iterable):
                raise TopologyError(
                    f"Topology {name} must be a sequence, not {type(value).__name__}"
                )
            object.__setattr__(self, name, tuple(value))
        ix = _Index()
        _check_elements(self, ix)
        _check_hosts(self, ix)
        _check_links(self, ix)
        _check_wires(self, ix)
        _check_connected(self, ix)
        object.__setattr__(self, "_ix", ix)

    def __repr__(self) -> str:
        return (
            f"Topology(hosts={len(self.hosts)}, accelerators={len(self._ix.accelerators)}, "
            f"switches={len(self.switches)}, links={len(self.links)}, ocs={len(self.ocs)}, "
            f"wires={len(self.wires)})"
        )

    # -- elements --------------------------------------------------------------------------

    def _get(self, name: str, cls: type[Element]) -> Any:
        element = self._ix.elements.get(name)
        if not isinstance(element, cls):
            raise TopologyError(f"the plan has no {_KINDS[cls]} {name!r}", element=name)
        return element

    def host(self, name: str) -> Host:
        return self._get(name, Host)  # type: ignore[no-any-return]

    def switch(self, name: str) -> Switch:
        return self._get(name, Switch)  # type: ignore[no-any-return]

    def ocs_switch(self, name: str) -> OcsSwitch:
        return self._get(name, OcsSwitch)  # type: ignore[no-any-return]

    def switches_in(self, tier: Tier) -> tuple[Switch, ...]:
        return tuple(s for s in self.switches if s.tier == tier)

    def free_ports(self, switch: str) -> tuple[int, ...]:
        """Ports of ``switch`` with no NIC, link or OCS wire on them."""
        sw = self.switch(switch)
        users = self._ix.port_users
        return tuple(p for p in range(sw.ports) if PortRef(switch, p) not in users)

    # -- hosts and accelerators ------------------------------------------------------------

    @property
    def accelerators(self) -> tuple[str, ...]:
        """Every accelerator id, ``host:index``, in plan order."""
        return self._ix.accelerators

    def accelerators_of(self, host: str) -> tuple[str, ...]:
        return tuple(f"{host}:{i}" for i in range(self.host(host).accelerators))

    def host_of(self, accelerator: str) -> str:
        """The host of accelerator id ``host:index``; raises :class:`TopologyError` if unknown."""
        host, _, index = accelerator.rpartition(":")
        h = self._ix.elements.get(host)
        digits = index.isascii() and index.isdigit()
        if not isinstance(h, Host) or not digits or int(index) >= h.accelerators:
            raise TopologyError(f"no accelerator {accelerator!r} in the plan", element=host)
        return host

    def tors_of(self, host: str) -> tuple[str, ...]:
        """The ToRs the host's NICs are cabled to, in NIC order."""
        self.host(host)
        return self._ix.host_tors[host]

    def tor_of(self, host: str) -> str:
        """The host's ToR; a host cabled to several ToRs raises (use :meth:`tors_of`)."""
        tors = self.tors_of(host)
        if len(tors) != 1:
            raise TopologyError(
                f"host {host} is cabled to {len(tors)} ToRs ({', '.join(tors)}); use tors_of()",
                element=host,
            )
        return tors[0]

    def hosts_under(self, tor: str) -> tuple[str, ...]:
        """Hosts with a NIC on ``tor``, in plan order."""
        self.switch(tor)
        return tuple(self._ix.tor_hosts.get(tor, ()))

    # -- electrical paths ------------------------------------------------------------------

    def link_gbps(self, a: str, b: str) -> float:
        """Summed capacity of the links between switches ``a`` and ``b`` (0 when none)."""
        self.switch(a)
        self.switch(b)
        return self._ix.adj[a].get(b, 0.0)

    def _search(self, src: str) -> dict[tuple[str, bool], tuple[int, float, Any]]:
        """Breadth-first over (switch, going-down) states: fewest hops, then widest."""
        got = self._ix.routes.get(src)
        if got is not None:
            return got
        adj, rank = self._ix.adj, self._ix.rank
        start = (src, False)
        best: dict[tuple[str, bool], tuple[int, float, Any]] = {start: (0, math.inf, None)}
        frontier = [start]
        while frontier:
            following: list[tuple[str, bool]] = []
            for state in frontier:
                u, down = state
                hops, width, _ = best[state]
                here = rank[u]
                for v, cap in adj[u].items():
                    step = rank[v] - here
                    if down and step >= 0:
                        continue
                    nxt = (v, step <= 0)
                    w = min(width, cap)
                    seen = best.get(nxt)
                    if seen is None:
                        best[nxt] = (hops + 1, w, state)
                        following.append(nxt)
                    elif seen[0] == hops + 1 and w > seen[1]:
                        best[nxt] = (hops + 1, w, state)
            frontier = following
        self._ix.routes[src] = best
        return best

    def _route(self, src: str, dst: str) -> ElectricalPath | None:
        best = self._search(src)
        ends = [best[s] + (s,) for s in ((dst, False), (dst, True)) if s in best]
        if not ends:
            return None
        _, _, prev, state = min(ends, key=lambda e: (e[0], -e[1]))
        nodes, caps = [state[0]], []
        while prev is not None:
            caps.append(self._ix.adj[prev[0]][state[0]])
            nodes.append(prev[0])
            state, prev = prev, best[prev][2]
        return ElectricalPath(tuple(reversed(nodes)), tuple(reversed(caps)))

    def switch_path(self, src: str, dst: str) -> ElectricalPath:
        """The up-down path between two switches with the fewest hops, widest among those.

        Raises :class:`TopologyError` if there is none.
        """
        self.switch(src)
        self.switch(dst)
        route = self._route(src, dst)
        if route is None:
            raise TopologyError(f"no electrical up-down path from {src} to {dst}", element=dst)
        return route

    def path(self, src: str, dst: str) -> ElectricalPath:
        """The electrical path between two hosts: NIC, up-down through the tree, NIC.

        Fewest hops, widest among those; a host cabled to several ToRs leaves through the best.
        A host to itself is a path of no hops. Validation guarantees a path between any two
        hosts; unknown names raise :class:`TopologyError`.
        """
        src_tors, dst_tors = self.tors_of(src), self.tors_of(dst)
        if src == dst:
            return ElectricalPath((src,), ())
        nic = self._ix.nic_gbps
        found: list[ElectricalPath] = []
        for s in src_tors:
            for d in dst_tors:
                mid = self._route(s, d)
                if mid is not None:
                    gbps = (nic[(src, s)], *mid.hop_gbps, nic[(dst, d)])
                    found.append(ElectricalPath((src, *mid.nodes, dst), gbps))
        return min(found, key=lambda p: (p.hops, -p.bottleneck_gbps))

    # -- optical circuits ------------------------------------------------------------------

    def ocs_wires(self, ocs: str) -> Mapping[int, OcsWire]:
        """OCS port -> the wire on it, for the wired ports of ``ocs``."""
        self.ocs_switch(ocs)
        return MappingProxyType(self._ix.ocs_wires[ocs])

    def ocs_reach(self, ocs: str) -> Mapping[str, tuple[int, ...]]:
        """Switch -> the OCS ports of ``ocs`` wired to its uplinks."""
        self.ocs_switch(ocs)
        return MappingProxyType({s: tuple(p) for s, p in self._ix.reach[ocs].items()})

    def wire_at(self, port: PortRef) -> OcsWire | None:
        """The OCS wire on ``port`` (an OCS port or a switch uplink), if any."""
        return self._ix.wire_at.get(port)

    def _busy(self, in_use: Iterable[PortRef]) -> set[PortRef]:
        busy = set(in_use)
        for ref in busy:
            if not isinstance(ref, PortRef) or not isinstance(
                self._ix.elements.get(ref.element), OcsSwitch
            ):
                raise TopologyError(f"in_use port {ref} is not an OCS port of this plan")
        return busy

    def circuit_candidates(
        self, in_use: Iterable[PortRef] = (), *, ocs: str | None = None
    ) -> tuple[CircuitCandidate, ...]:
        """Each pair of distinct switches an OCS reaches with free ports on both sides.

        ``in_use`` names OCS ports already taken by circuits; ``ocs`` limits the answer to one
        OCS. One candidate per (OCS, pair): OCS in plan order, then switches in wiring order.
        """
        busy = self._busy(in_use)
        out: list[CircuitCandidate] = []
        for o in self.ocs if ocs is None else (self.ocs_switch(ocs),):
            free = [
                (sw, ports)
                for sw, all_ports in self._ix.reach[o.name].items()
                if (ports := tuple(p for p in all_ports if PortRef(o.name, p) not in busy))
            ]
            for i, (a, a_ports) in enumerate(free):
                out.extend(CircuitCandidate(o.name, a, b, a_ports, bp) for b, bp in free[i + 1 :])
        return tuple(out)

    def circuit_budgets(self, in_use: Iterable[PortRef] = ()) -> dict[str, int]:
        """Switch -> how many of its uplinks reach a free OCS port (over every OCS)."""
        busy = self._busy(in_use)
        budgets: dict[str, int] = {}
        for ocs, reach in self._ix.reach.items():
            for sw, ports in reach.items():
                free = sum(PortRef(ocs, p) not in busy for p in ports)
                budgets[sw] = budgets.get(sw, 0) + free
        return budgets

    # -- serialization ---------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data in the file schema; :func:`topology_from_dict` inverts it."""
        return {
            "version": 1,
            "switches": [{"name": s.name, "tier": s.tier, "ports": s.ports} for s in self.switches],
            "hosts": [
                {
                    "name": h.name,
                    "accelerators": h.accelerators,
                    "nics": [{"name": n.name, "gbps": n.gbps, "port": str(n.port)} for n in h.nics],
                }
                for h in self.hosts
            ],
            "links": [{"a": str(k.a), "b": str(k.b), "gbps": k.gbps} for k in self.links],
            "ocs": [
                {"name": o.name, "radix": o.radix, "latency": dataclasses.asdict(o.latency)}
                for o in self.ocs
            ],
            "wires": [
                {"ocs": str(w.ocs_port), "port": str(w.switch_port), "gbps": w.gbps}
                for w in self.wires
            ],
        }

    def to_toml(self) -> str:
        """The plan as TOML text, one inline table per element and line."""
        lines = ["# orchestr fabric cabling plan"]
        for key, value in self.to_dict().items():
            if isinstance(value, list) and value:
                lines.append(f"{key} = [")
                lines.extend(f"  {_toml(item)}," for item in value)
                lines.append("]")
            else:
                lines.append(f"{key} = {_toml(value)}")
        return "\n".join(lines) + "\n"


# -- reading and writing plans -------------------------------------------------------------

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # finite (validated); repr round-trips and is valid TOML
    if isinstance(value, str):
        body = "".join(
            "\\" + c if c in '"\\' else f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c
            for c in value
        )
        return f'"{body}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (
            f"{k if _BARE_KEY.fullmatch(k) else _toml(k)} = {_toml(v)}" for k, v in value.items()
        )
        return "{ " + ", ".join(items) + " }"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _table(obj: object, where: str, required: set[str], optional: set[str]) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise TopologyError(f"{where} must be a table, not {type(obj).__name__}")
    for key in obj:
        if key not in required | optional:
            expected = ", ".join(sorted(required | optional))
            raise TopologyError(f"{where}: unknown key {key!r}; expected {expected}")
    missing = sorted(required - obj.keys())
    if missing:
        raise TopologyError(f"{where}: missing key {missing[0]!r}")
    return obj


def _array(table: Mapping[str, Any], key: str, where: str) -> list[Any]:
    value = table.get(key, [])
    if not isinstance(value, list | tuple):
        raise TopologyError(
            f"{where}: {key!r} must be an array of tables, not {type(value).__name__}"
        )
    return list(value)


def _port(value: object, where: str) -> PortRef:
    if not isinstance(value, str):
        raise TopologyError(f"{where}: port {value!r} must be a string 'element:index'")
    try:
        return PortRef.parse(value)
    except TopologyError as exc:
        raise TopologyError(f"{where}: {exc}") from None


def _label(table: Mapping[str, Any], kind: str, key: str, i: int) -> str:
    name = table.get("name")
    return f"{kind} {name} ({key}[{i}])" if isinstance(name, str) else f"{key}[{i}]"


def topology_from_dict(data: Mapping[str, Any]) -> Topology:
    """Build and validate a :class:`Topology` from plain data in the file schema.

    Raises :class:`TopologyError` naming the element at fault.
    """
    plan = _table(data, "plan", set(), {"version", "hosts", "switches", "links", "ocs", "wires"})
    version = plan.get("version", 1)
    if isinstance(version, bool) or version != 1:
        raise TopologyError(f"plan: version {version!r} is not supported; this reader knows 1")
    switches = []
    for i, t in enumerate(_array(plan, "switches", "plan")):
        t = _table(t, f"switches[{i}]", {"name", "tier", "ports"}, set())
        switches.append(Switch(t["name"], t["tier"], t["ports"]))
    hosts = []
    for i, t in enumerate(_array(plan, "hosts", "plan")):
        t = _table(t, f"hosts[{i}]", {"name", "accelerators"}, {"nics"})
        where = _label(t, "host", "hosts", i)
        nics = []
        for j, n in enumerate(_array(t, "nics", where)):
            n = _table(n, f"{where} nics[{j}]", {"name", "gbps", "port"}, set())
            nics.append(Nic(n["name"], n["gbps"], _port(n["port"], f"{where} nics[{j}]")))
        hosts.append(Host(t["name"], t["accelerators"], tuple(nics)))
    links = []
    for i, t in enumerate(_array(plan, "links", "plan")):
        t = _table(t, f"links[{i}]", {"a", "b", "gbps"}, set())
        where = f"links[{i}]"
        links.append(Link(_port(t["a"], where), _port(t["b"], where), t["gbps"]))
    ocs = []
    for i, t in enumerate(_array(plan, "ocs", "plan")):
        t = _table(t, f"ocs[{i}]", {"name", "radix"}, {"latency"})
        lat = _table(
            t.get("latency", {}),
            f"{_label(t, 'OCS', 'ocs', i)} latency",
            set(),
            {f.name for f in dataclasses.fields(ReconfigLatency)},
        )
        ocs.append(OcsSwitch(t["name"], t["radix"], ReconfigLatency(**lat)))
    wires = []
    for i, t in enumerate(_array(plan, "wires", "plan")):
        t = _table(t, f"wires[{i}]", {"ocs", "port", "gbps"}, set())
        where = f"wires[{i}]"
        wires.append(OcsWire(_port(t["ocs"], where), _port(t["port"], where), t["gbps"]))
    return Topology(tuple(hosts), tuple(switches), tuple(links), tuple(ocs), tuple(wires))


def _yaml(path: Path) -> Any:
    try:
        return importlib.import_module("yaml")
    except ImportError:
        raise TopologyError(
            f"{path}: YAML plans need PyYAML (pip install pyyaml); or write the plan as TOML"
        ) from None


def load_topology(path: str | Path) -> Topology:
    """Read and validate a plan file: ``.toml``, or ``.yaml``/``.yml`` with PyYAML installed.

    Blocks on file I/O. Raises :class:`TopologyError` for a bad plan or unreadable syntax and
    ``OSError`` when the file cannot be read.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise TopologyError(f"{path}: not valid TOML: {exc}") from exc
    elif suffix in (".yaml", ".yml"):
        yaml = _yaml(path)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise TopologyError(f"{path}: not valid YAML: {exc}") from exc
        data = {} if data is None else data
    else:
        raise TopologyError(f"{path}: plan files end in .toml, .yaml or .yml")
    try:
        return topology_from_dict(data)
    except TopologyError as exc:
        raise TopologyError(f"{path}: {exc}", element=exc.element, port=exc.port) from None


def dump_topology(topology: Topology, path: str | Path) -> None:
    """Write ``topology`` to ``path`` as TOML (or YAML for ``.yaml``/``.yml`` with PyYAML).

    Blocks on file I/O; overwrites the file.
    """
    path = Path(path)
    if path.suffix.lower() in (".yaml", ".yml"):
        text = _yaml(path).safe_dump(topology.to_dict(), sort_keys=False)
    else:
        text = topology.to_toml()
    path.write_text(text, encoding="utf-8")


# -- generated plans -----------------------------------------------------------------------


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
