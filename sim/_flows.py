"""The network at flow level: flows share links max-min fairly, on the engine's clock.

A flow is ``nbytes`` along a path of directed links (each direction of a cable has its full
capacity). While the set of flows is unchanged every flow moves at a constant rate, so the
model needs events only when a flow starts or finishes: then every rate is computed again by
progressive filling (raise all rates together; a link that fills freezes the flows crossing
it at their share; repeat with the rest), the max-min fair allocation, and one engine event
is scheduled for the next flow to finish. Packets, queues and congestion control are not
modelled: a flow is a fluid that gets its fair share at once. What congestion control costs a
link can be given as measured, and is then taken off the link's capacity: ``sharing``, the
fraction of its rate ``k`` flows crossing it carry together, and ``reverse_sharing``, the same
while flows also cross it the other way (TCP's acknowledgements of those wait behind its data
in the link's queue, and the flows they pace slow down).

The model is independent of the fabric planner's own prediction (``phase_time``, the
bottleneck-pair model): it moves bytes over the topology's links, so checking the planner
against it is not circular.

:class:`FlowNet` routes between hosts of a :class:`~orchestr.fabric.optical.Topology` on its
electrical up-down paths (one path per pair of hosts among the shortest, picked by a hash as
ECMP does; or the topology's own one), or over an optical circuit between the two hosts' ToRs when one is
set (:meth:`FlowNet.set_circuits`).
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

from orchestr.fabric.optical import Topology

from ._engine import NS, Engine, Event

__all__ = ["Flow", "FlowNet", "max_min_rates"]

Link = tuple[Hashable, ...]  # (from, to) nodes; a circuit is ("ocs", from, to)


def max_min_rates(paths: Sequence[Sequence[Link]], capacity: Mapping[Link, float]) -> list[float]:
    """The max-min fair rate of each flow (bytes/s) given its path and each link's capacity.
    A flow with an empty path (a host to itself) gets ``inf``. Raises ``KeyError`` for a link
    ``capacity`` does not have."""
    rates = [math.inf] * len(paths)
    left: dict[Link, float] = {}
    users: dict[Link, list[int]] = {}
    for i, path in enumerate(paths):
        for link in path:
            if link not in left:
                left[link] = capacity[link]
                users[link] = []
            users[link].append(i)
    count = {link: len(u) for link, u in users.items()}
    frozen = [not path for path in paths]
    while count:
        shares = {link: left[link] / n for link, n in count.items()}
        share = min(shares.values())
        # every link at the least share fills together (freezing one's flows leaves the
        # others' share as it was), so a ring or a fan-in is one round, not one per link
        tight = [link for link, s in shares.items() if s <= share * (1 + 1e-12)]
        for link in tight:
            for i in users[link]:
                if frozen[i]:
                    continue
                frozen[i] = True
                rates[i] = share
                for on in paths[i]:
                    left[on] -= share
                    count[on] -= 1
        for link in [link for link, n in count.items() if n == 0]:
            del count[link]
    return rates


class Flow:
    """Bytes moving along ``path``; ``done()`` is called when the last byte arrives."""

    __slots__ = ("done", "left", "nbytes", "path", "rate")

    def __init__(self, path: tuple[Link, ...], nbytes: float, done: Callable[[], None]) -> None:
        self.path, self.nbytes, self.left, self.done = path, nbytes, float(nbytes), done
        self.rate = 0.0


def check_sharing(sharing: Sequence[float] | None, name: str = "sharing") -> tuple[float, ...]:
    """``sharing`` as a tuple (``()`` for none), or ``ValueError``: a non-empty list of
    fractions in (0, 1]."""
    if sharing is None:
        return ()
    out = tuple(float(x) for x in sharing)
    if not out or not all(0 < x <= 1 for x in out):
        raise ValueError(
            f"{name} is a non-empty list of fractions in (0, 1] (what 1, 2, ... flows carry "
            f"of a link together), got {list(sharing)!r}"
        )
    return out


def _reverse(link: Link) -> Link:
    if len(link) == 3 and link[0] == "ocs":
        return ("ocs", link[2], link[1])
    return (link[1], link[0])


class FlowNet:
    """Flows over links of ``capacity`` (bytes/s per direction) on ``engine``'s clock. Use
    :meth:`of_topology` to build one from a cabling plan and route between hosts.

    ``sharing``, when given: ``sharing[k - 1]`` is the fraction of a link's capacity that ``k``
    flows crossing it carry together (past its end, its last entry); ``reverse_sharing``: the
    same while flows also cross it the other way. Without them every link carries its whole
    capacity however many flows share it, either way."""

    def __init__(
        self,
        engine: Engine,
        capacity: Mapping[Link, float],
        *,
        sharing: Sequence[float] | None = None,
        reverse_sharing: Sequence[float] | None = None,
    ) -> None:
        for link, cap in capacity.items():
            if not cap > 0:
                raise ValueError(f"link {link} has capacity {cap!r}; capacities are > 0 bytes/s")
        self.engine = engine
        self.capacity = dict(capacity)
        self.sharing = check_sharing(sharing)
        self.reverse_sharing = check_sharing(reverse_sharing, "reverse_sharing")
        self.flows: list[Flow] = []
        self.finished = 0
        self._topology: Topology | None = None
        self._paths: dict[tuple[str, str], tuple[Link, ...]] = {}
        self._circuits: dict[tuple[str, str], float] = {}
        self._last = engine.now
        self._next: Event | None = None
        self._settle: Event | None = None
        self.ecmp = False
        self._adjacent: dict[str, list[str]] = {}  # switch -> switches cabled to it
        self._dist: dict[str, dict[str, int]] = {}  # ToR -> hops from each switch

    @classmethod
    def of_topology(
        cls,
        engine: Engine,
        topology: Topology,
        *,
        ecmp: bool = True,
        sharing: Sequence[float] | None = None,
        reverse_sharing: Sequence[float] | None = None,
    ) -> FlowNet:
        """A network of ``topology``'s links, each direction its capacity (parallel cables
        summed), routing between its hosts: with ``ecmp`` (the default) each pair of hosts
        takes one of the shortest paths by a hash, as switches spread flows over equal-cost
        uplinks; without it, the topology's one path for every pair. ``sharing`` and
        ``reverse_sharing`` as for the constructor."""
        capacity: dict[Link, float] = {}
        for host in topology.hosts:
            for nic in host.nics:
                tor = nic.port.element
                cap = capacity.get((host.name, tor), 0.0) + nic.gbps * 1e9 / 8
                capacity[host.name, tor] = capacity[tor, host.name] = cap
        for link in topology.links:
            a, b = link.a.element, link.b.element
            cap = capacity.get((a, b), 0.0) + link.gbps * 1e9 / 8
            capacity[a, b] = capacity[b, a] = cap
        net = cls(engine, capacity, sharing=sharing, reverse_sharing=reverse_sharing)
        net._topology = topology
        net.ecmp = ecmp
        hosts = {h.name for h in topology.hosts}
        for pair in capacity:
            a, b = str(pair[0]), str(pair[1])
            if a not in hosts and b not in hosts:
                net._adjacent.setdefault(a, []).append(b)
        for options in net._adjacent.values():
            options.sort()
        return net

    # -- routing ------------------------------------------------------------------------------
    def set_circuits(self, circuits: Mapping[tuple[str, str], float]) -> None:
        """Optical circuits from now on: ``{(tor_a, tor_b): gbps}`` (both directions; several
        circuits between one pair as their summed capacity). Flows already moving keep their
        paths; new flows between hosts under two joined ToRs take the circuit."""
        for (a, b), gbps in circuits.items():
            if not gbps > 0:
                raise ValueError(f"circuit {a} <-> {b} has {gbps!r} Gbit/s; it must be > 0")
        for key in list(self._circuits):
            self.capacity.pop(("ocs", *key), None)
            self.capacity.pop(("ocs", key[1], key[0]), None)
        self._circuits = {}
        for (a, b), gbps in circuits.items():
            self._circuits[a, b] = self._circuits[b, a] = gbps
            self.capacity["ocs", a, b] = self.capacity["ocs", b, a] = gbps * 1e9 / 8
        self._paths.clear()

    def path(self, src: str, dst: str) -> tuple[Link, ...]:
        """The links a flow from host ``src`` to host ``dst`` crosses."""
        key = (src, dst)
        got = self._paths.get(key)
        if got is not None:
            return got
        if self._topology is None:
            raise ValueError("this network has no topology to route by; give flows their paths")
        topo = self._topology
        nodes = topo.path(src, dst).nodes
        if self.ecmp and len(nodes) > 4:
            nodes = (src, *self._spread(src, dst, nodes[1], nodes[-2], len(nodes) - 3), dst)
        if len(nodes) > 3 and (nodes[1], nodes[-2]) in self._circuits:
            links: tuple[Link, ...] = (
                (src, nodes[1]),
                ("ocs", nodes[1], nodes[-2]),
                (nodes[-2], dst),
            )
        else:
            links = tuple(itertools.pairwise(nodes))
        self._paths[key] = links
        return links

    def _spread(self, src: str, dst: str, first: str, last: str, hops: int) -> list[str]:
        """Switches from ToR ``first`` to ToR ``last`` on one of the shortest paths, picked
        per (src, dst) pair by a hash at each hop (ECMP: flows between other pairs take
        other uplinks)."""
        dist = self._dist.get(last)
        if dist is None:
            dist = self._dist[last] = self._bfs(last)
        if dist.get(first) != hops:
            return list(self._topology.path(src, dst).nodes[1:-1])  # type: ignore[union-attr]
        out, here = [first], first
        while here != last:
            step = dist[here] - 1
            options = [n for n in self._adjacent[here] if dist.get(n) == step]
            here = options[zlib.crc32(f"{src}>{dst}>{here}".encode()) % len(options)]
            out.append(here)
        return out

    def _bfs(self, root: str) -> dict[str, int]:
        dist, frontier = {root: 0}, [root]
        while frontier:
            nxt = []
            for node in frontier:
                for n in self._adjacent.get(node, ()):
                    if n not in dist:
                        dist[n] = dist[node] + 1
                        nxt.append(n)
            frontier = nxt
        return dist

    # -- flows --------------------------------------------------------------------------------
    def send(
        self, src: str, dst: str, nbytes: float, done: Callable[[], None], *, latency: float = 0.0
    ) -> None:
        """Move ``nbytes`` from host ``src`` to host ``dst``, starting ``latency`` seconds from
        now; ``done()`` when they have arrived."""
        self.start(self.path(src, dst), nbytes, done, latency=latency)

    def start(
        self,
        path: Iterable[Link],
        nbytes: float,
        done: Callable[[], None],
        *,
        latency: float = 0.0,
    ) -> Flow:
        """A flow of ``nbytes`` along ``path``, starting ``latency`` seconds from now. Raises
        ``ValueError`` for a negative size or latency and ``KeyError`` for an unknown link."""
        if not (nbytes >= 0 and latency >= 0) or math.isinf(nbytes):
            raise ValueError(f"a flow has bytes >= 0 and latency >= 0, got {nbytes}, {latency}")
        flow = Flow(tuple(path), nbytes, done)
        for link in flow.path:
            if link not in self.capacity:
                raise KeyError(f"no link {link} in this network")
        if latency:
            self.engine.after(latency, self._begin, flow, name="flow start")
        else:
            self._begin(flow)
        return flow

    def _begin(self, flow: Flow) -> None:
        self._advance()
        self.flows.append(flow)
        if self._settle is None:  # flows starting at one instant share one new allocation
            self._settle = self.engine.at(self.engine.now, self._settled, name="flows start")

    def _settled(self) -> None:
        self._settle = None
        self._advance()
        self._reschedule()

    def _advance(self) -> None:
        """Move every flow's bytes on to now at its current rate."""
        now = self.engine.now
        if now != self._last:
            dt = (now - self._last) / NS
            for f in self.flows:
                f.left -= f.rate * dt
            self._last = now

    def _reschedule(self) -> None:
        paths = [f.path for f in self.flows]
        shared = self.sharing or self.reverse_sharing
        rates = max_min_rates(paths, self._shared(paths) if shared else self.capacity)
        soonest = math.inf
        for f, rate in zip(self.flows, rates, strict=True):
            f.rate = rate
            soonest = min(soonest, 0.0 if f.left <= 0 else f.left / rate)
        if self._next is not None:
            self._next.cancel()
            self._next = None
        if self.flows:
            due = self.engine.now + math.ceil(soonest * NS - 1e-6)
            self._next = self.engine.at(due, self._finish, name="flows finish")

    def _shared(self, paths: Sequence[Sequence[Link]]) -> dict[Link, float]:
        """The capacity each link in use carries with the flows now crossing it (either way)."""
        crossing: dict[Link, int] = {}
        for path in paths:
            for link in path:
                crossing[link] = crossing.get(link, 0) + 1
        out = {}
        for link, k in crossing.items():
            table = self.sharing
            if self.reverse_sharing and _reverse(link) in crossing:
                table = self.reverse_sharing
            share = table[min(k, len(table)) - 1] if table else 1.0
            out[link] = self.capacity[link] * share
        return out

    def _finish(self) -> None:
        self._next = None
        self._advance()
        # a flow is through when less than a nanosecond of it is left (rounding to the grid)
        through: list[Flow] = []
        moving: list[Flow] = []
        for f in self.flows:
            (through if f.left <= f.rate * 1e-9 + 1e-9 * f.nbytes else moving).append(f)
        self.flows = moving
        self.finished += len(through)
        self._reschedule()
        for f in through:
            f.done()
