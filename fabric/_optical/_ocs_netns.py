"""``netns``: an OCS driver over an emulated fabric of network namespaces, and its router.

:class:`NetnsOcs` is the switch: OCS port ``p`` is cabled to host ``port_map[p]`` of a
:class:`~orchestr.fabric._optical._netns.NetnsFabric` (port ``i`` to host ``i`` by default), and a
circuit between two ports is a veth link between their hosts. ``program`` creates and deletes
those links; it does not touch routes (that is the router's job, between drain and undrain).
The generation and the live circuits are read back from the kernel, so a new driver on the same
fabric (a restarted manager) finds the switch as it was left.

A host may be cabled to several ports (a ToR with several OCS uplinks). Its circuits then carry
their two ports as the veth's label, which is how they are read back; and as two hosts share at
most one veth link, a program that would join two hosts twice (or a host to itself) is refused
with :class:`~orchestr.fabric._optical._ocs.InvalidProgramError`.

:class:`NetnsRouter` is the :class:`~orchestr.fabric._optical._reconfig.Router` of such a fabric: a pair
is two host names; ``undrain`` moves their routes onto the circuit between them, ``drain`` back
onto the bridge.

The kernel work runs in a worker thread under the fabric's lock, so a program the caller gave up
on (cancelled) still finishes in the kernel, and the generation fence decides what a later
program finds, as on a real switch.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Collection, Mapping, Sequence

from orchestr.errors import ClosedResourceError

from ._netns import NetnsError, NetnsFabric
from ._ocs import (
    Circuit,
    InvalidProgramError,
    VerifyError,
    check_generation,
    check_program,
    circuit,
)
from ._reconfig_model import Pair

__all__ = ["NetnsOcs", "NetnsRouter"]

_PORTS = re.compile(r"ocs-ports=(\d+)-(\d+)")


class NetnsOcs:
    """An :class:`~orchestr.fabric._optical._ocs.OcsDriver` whose circuits are veth links between the
    namespace hosts of ``fabric``. ``port_map``: the host of each port (a sequence indexed by
    port, or a mapping of ports ``0..n-1``); a host may be on several ports (see the module)."""

    def __init__(
        self, fabric: NetnsFabric, port_map: Sequence[str] | Mapping[int, str] | None = None
    ) -> None:
        if port_map is None:
            hosts = list(fabric.hosts)
        elif isinstance(port_map, Mapping):
            if sorted(port_map) != list(range(len(port_map))):
                raise ValueError(f"ports must be 0..n-1, got {sorted(port_map)}")
            hosts = [port_map[p] for p in range(len(port_map))]
        else:
            hosts = list(port_map)
        unknown = sorted(set(hosts) - set(fabric.hosts))
        if unknown or len(set(hosts)) < 2:
            raise ValueError(
                f"port map {hosts!r}: need hosts of the fabric, 2 or more distinct"
                + (f"; {unknown} are not among {fabric.hosts}" if unknown else "")
            )
        self._fabric = fabric
        self._hosts = hosts
        self._ports: dict[str, list[int]] = {}
        for p, h in enumerate(hosts):
            self._ports.setdefault(h, []).append(p)
        self._closed = False

    @property
    def radix(self) -> int:
        return len(self._hosts)

    def host(self, port: int) -> str:
        """The host cabled to ``port``."""
        return self._hosts[port]

    async def program(
        self, generation: int, connect: Sequence[Circuit], disconnect: Sequence[Circuit]
    ) -> None:
        """See :meth:`~orchestr.fabric._optical._ocs.OcsDriver.program`. Blocks on ``ip``/``tc`` in a
        worker thread (milliseconds per circuit); a kernel failure part-way undoes what was
        done and raises :class:`~orchestr.fabric._optical._netns.NetnsError`.

        Not cancel-safe while programming: a cancelled program may be applied in part; the next
        program's generation fences it."""
        self._check_open()
        await asyncio.to_thread(self._program, generation, connect, disconnect)

    async def circuits(self) -> tuple[int, frozenset[Circuit]]:
        """See :meth:`OcsDriver.circuits`: blocks on reading the links back; cancel-safe;
        raises :class:`ClosedResourceError` once closed."""
        self._check_open()
        return await asyncio.to_thread(self._read)

    async def verify(self, generation: int, expected: Collection[Circuit]) -> None:
        """Reads the switch back: raises :class:`~orchestr.fabric._optical._ocs.VerifyError` unless it
        is at ``generation`` with exactly ``expected`` live, each link up with a carrier at
        both ends.

        Blocks on reading the links; cancel-safe."""
        found, live = await self.circuits()
        want = frozenset(circuit(a, b) for a, b in expected)
        if found != generation or live != want:
            raise VerifyError(
                generation=generation,
                found_generation=found,
                missing=want - live,
                extra=live - want,
            )

    async def aclose(self) -> None:
        """Later calls raise ``ClosedResourceError``; the circuits stay. Idempotent.

        Blocks on nothing; cancel-safe."""
        self._closed = True

    # -- in a worker thread --------------------------------------------------------------------

    def _read(self) -> tuple[int, frozenset[Circuit]]:
        with self._fabric.lock:  # the generation and the circuits of one moment
            return self._fabric.switch_generation(), self._live()

    def _live(self, labels: dict[tuple[str, str], str] | None = None) -> frozenset[Circuit]:
        """The circuits between this switch's ports: by their label, or, for a circuit made
        without one (or by a driver of another port map), by the one port each host has."""
        live: set[Circuit] = set()
        if labels is None:
            labels = self._fabric.circuit_labels()
        for (a, b), label in labels.items():
            m = _PORTS.fullmatch(label)
            p, q = (int(m.group(1)), int(m.group(2))) if m else (-1, -1)
            if p != q and max(p, q) < self.radix and {self._hosts[p], self._hosts[q]} == {a, b}:
                live.add(circuit(p, q))
            elif len(self._ports.get(a, ())) == 1 and len(self._ports.get(b, ())) == 1:
                live.add(circuit(self._ports[a][0], self._ports[b][0]))
        return frozenset(live)

    def _check_hosts(
        self, joined: set[frozenset[str]], cut: frozenset[Circuit], made: frozenset[Circuit]
    ) -> None:
        """Refuse a program leaving two hosts with two links (``joined``: the host pairs with
        a live link, this switch's or not) or a host with a link to itself."""
        joined = joined - {frozenset((self._hosts[a], self._hosts[b])) for a, b in cut}
        for a, b in sorted(made):
            hosts = frozenset((self._hosts[a], self._hosts[b]))
            if len(hosts) == 1:
                raise InvalidProgramError(
                    f"connect {(a, b)}: both ports are cabled to host {self._hosts[a]}, which "
                    "the emulation cannot join to itself"
                )
            if hosts in joined:
                raise InvalidProgramError(
                    f"connect {(a, b)}: hosts {' and '.join(sorted(hosts))} would have two "
                    "circuits; the emulation joins two hosts by one at most"
                )
            joined.add(hosts)

    def _connect(self, a: int, b: int) -> None:
        self._fabric.connect(self._hosts[a], self._hosts[b], label=f"ocs-ports={a}-{b}")

    def _program(
        self, generation: int, connect: Sequence[Circuit], disconnect: Sequence[Circuit]
    ) -> None:
        fabric = self._fabric
        with fabric.lock:
            labels = fabric.circuit_labels()
            made, cut = check_program(self.radix, self._live(labels), connect, disconnect)
            check_generation(generation, fabric.switch_generation())
            self._check_hosts({frozenset(pair) for pair in labels}, cut, made)
            done_cut: list[Circuit] = []
            done_made: list[Circuit] = []
            try:
                for a, b in sorted(cut):
                    fabric.disconnect(self._hosts[a], self._hosts[b])
                    done_cut.append((a, b))
                for a, b in sorted(made):
                    self._connect(a, b)
                    done_made.append((a, b))
                fabric.set_switch_generation(generation)
            except NetnsError as exc:
                for a, b in done_made:  # all or nothing: put the links back as they were
                    with contextlib.suppress(NetnsError):
                        fabric.disconnect(self._hosts[a], self._hosts[b])
                for a, b in done_cut:
                    with contextlib.suppress(NetnsError):
                        self._connect(a, b)
                raise NetnsError(
                    f"generation {generation} failed and was undone; read circuits() before "
                    f"planning again: {exc}"
                ) from exc

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError("the netns OCS driver was closed; open a new one")


class NetnsRouter:
    """The :class:`~orchestr.fabric._optical._reconfig.Router` of a :class:`NetnsFabric`: a pair is two
    of its host names. Both calls block (in a worker thread) until the routes of every pair are
    in place, both directions, and raise :class:`NetnsError` otherwise (``undrain`` of a pair
    without a circuit, say). Idempotent."""

    def __init__(self, fabric: NetnsFabric) -> None:
        self._fabric = fabric

    async def drain(self, pairs: frozenset[Pair]) -> None:
        """Route each pair over the bridge.

        Blocks on ``ip route`` in each pair's namespaces; raises :class:`NetnsError`. Cancel-safe
        in that a repeated drain converges."""
        await asyncio.to_thread(self._move, pairs, onto_circuit=False)

    async def undrain(self, pairs: frozenset[Pair]) -> None:
        """Route each pair over the circuit between its hosts.

        Blocks and raises as :meth:`drain`; cancel-safe as it is (a repeated undrain
        converges)."""
        await asyncio.to_thread(self._move, pairs, onto_circuit=True)

    def _move(self, pairs: frozenset[Pair], *, onto_circuit: bool) -> None:
        move = self._fabric.route_circuit if onto_circuit else self._fabric.route_bridge
        with self._fabric.lock:
            for a, b in sorted(pairs):
                move(a, b)
