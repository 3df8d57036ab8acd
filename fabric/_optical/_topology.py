"""The fabric's topology model: an explicit cabling plan, validated once, queried often.

A plan lists hosts (accelerators and NICs, each NIC cabled to a ToR port), electrical switches
by tier (``tor``, ``agg``, ``core``), electrical links between switch ports, OCS (optical
circuit switches) with a radix and a reconfiguration latency model, and wires from OCS ports to
ToR or aggregation uplink ports. The electrical tree must join every pair of hosts by an up-down
path on its own: the manager drains traffic onto it while circuits are reprogrammed, so OCS
circuits are an express layer on top, never the only way between two hosts.

Ports are 0-based: ``tor0:3`` is port 3 of ``tor0``. Names are unique across hosts, switches
and OCS, printable, without whitespace or ``:``. Bandwidths are in Gbit/s.

Here: the frozen plan elements and :class:`Topology` with its queries. :mod:`._topology_check`
validates a plan, :mod:`._topology_file` reads and writes plan files (and holds their schema),
:mod:`._fattree` generates plans; they import this module, which imports them only lazily.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ._elements import (
    _KINDS,
    CircuitCandidate,
    ElectricalPath,
    Element,
    Host,
    Link,
    OcsSwitch,
    OcsWire,
    PortRef,
    Switch,
    Tier,
    TopologyError,
)

if TYPE_CHECKING:
    from ._topology_check import _Index

__all__ = ["Topology"]


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
        from ._topology_check import check_plan  # lazily: _plancheck imports this module

        object.__setattr__(self, "_ix", check_plan(self))

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
        """The plan as plain data in the file schema; :func:`~._topology_file.topology_from_dict`
        inverts it."""
        from ._topology_file import to_dict  # lazily: _planfile imports this module

        return to_dict(self)

    def to_toml(self) -> str:
        """The plan as TOML text, one inline table per element and line."""
        from ._topology_file import to_toml  # lazily: _planfile imports this module

        return to_toml(self)
