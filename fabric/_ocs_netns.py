"""``netns``: an OCS driver over an emulated fabric of network namespaces, and its router.

:class:`NetnsOcs` is the switch: OCS port ``p`` is cabled to host ``port_map[p]`` of a
:class:`~orchestr.fabric._netns_fabric.NetnsFabric` (port ``i`` to host ``i`` by default), and a
circuit between two ports is a veth link between their hosts. ``program`` creates and deletes
those links; it does not touch routes (that is the router's job, between drain and undrain).
The generation and the live circuits are read back from the kernel, so a new driver on the same
fabric (a restarted manager) finds the switch as it was left.

:class:`NetnsRouter` is the :class:`~orchestr.fabric._reconfig.Router` of such a fabric: a pair
is two host names; ``undrain`` moves their routes onto the circuit between them, ``drain`` back
onto the bridge.

The kernel work runs in a worker thread under the fabric's lock, so a program the caller gave up
on (cancelled) still finishes in the kernel, and the generation fence decides what a later
program finds, as on a real switch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection, Mapping, Sequence

from orchestr.errors import ClosedResourceError

from ._netns_fabric import NetnsError, NetnsFabric
from ._ocs import Circuit, VerifyError, check_generation, check_program, circuit
from ._reconfig_model import Pair

__all__ = ["NetnsOcs", "NetnsRouter"]


class NetnsOcs:
    """An :class:`~orchestr.fabric._ocs.OcsDriver` whose circuits are veth links between the
    namespace hosts of ``fabric``. ``port_map``: the host of each port (a sequence indexed by
    port, or a mapping of ports ``0..n-1``); each host on at most one port."""

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
        if unknown or len(set(hosts)) != len(hosts) or len(hosts) < 2:
            raise ValueError(
                f"port map {hosts!r}: need 2 or more distinct hosts of the fabric"
                + (f"; {unknown} are not among {fabric.hosts}" if unknown else "")
            )
        self._fabric = fabric
        self._hosts = hosts
        self._ports = {h: p for p, h in enumerate(hosts)}
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
        """See :meth:`~orchestr.fabric._ocs.OcsDriver.program`. Blocks on ``ip``/``tc`` in a
        worker thread (milliseconds per circuit); a kernel failure part-way undoes what was
        done and raises :class:`~orchestr.fabric._netns_fabric.NetnsError`."""
        self._check_open()
        await asyncio.to_thread(self._program, generation, connect, disconnect)

    async def circuits(self) -> tuple[int, frozenset[Circuit]]:
        self._check_open()
        return await asyncio.to_thread(self._read)

    async def verify(self, generation: int, expected: Collection[Circuit]) -> None:
        """Reads the switch back: raises :class:`~orchestr.fabric._ocs.VerifyError` unless it
        is at ``generation`` with exactly ``expected`` live, each link up with a carrier at
        both ends."""
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
        """Later calls raise ``ClosedResourceError``; the circuits stay. Idempotent."""
        self._closed = True

    # -- in a worker thread --------------------------------------------------------------------

    def _read(self) -> tuple[int, frozenset[Circuit]]:
        with self._fabric.lock:  # the generation and the circuits of one moment
            return self._fabric.switch_generation(), self._live()

    def _live(self) -> frozenset[Circuit]:
        ports = self._ports
        return frozenset(
            circuit(ports[a], ports[b])
            for a, b in self._fabric.circuits()
            if a in ports and b in ports
        )

    def _program(
        self, generation: int, connect: Sequence[Circuit], disconnect: Sequence[Circuit]
    ) -> None:
        fabric = self._fabric
        with fabric.lock:
            made, cut = check_program(self.radix, self._live(), connect, disconnect)
            check_generation(generation, fabric.switch_generation())
            done_cut: list[Circuit] = []
            done_made: list[Circuit] = []
            try:
                for a, b in sorted(cut):
                    fabric.disconnect(self._hosts[a], self._hosts[b])
                    done_cut.append((a, b))
                for a, b in sorted(made):
                    fabric.connect(self._hosts[a], self._hosts[b])
                    done_made.append((a, b))
                fabric.set_switch_generation(generation)
            except NetnsError as exc:
                for a, b in done_made:  # all or nothing: put the links back as they were
                    with contextlib.suppress(NetnsError):
                        fabric.disconnect(self._hosts[a], self._hosts[b])
                for a, b in done_cut:
                    with contextlib.suppress(NetnsError):
                        fabric.connect(self._hosts[a], self._hosts[b])
                raise NetnsError(
                    f"generation {generation} failed and was undone; read circuits() before "
                    f"planning again: {exc}"
                ) from exc

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError("the netns OCS driver was closed; open a new one")


class NetnsRouter:
    """The :class:`~orchestr.fabric._reconfig.Router` of a :class:`NetnsFabric`: a pair is two
    of its host names. Both calls block (in a worker thread) until the routes of every pair are
    in place, both directions, and raise :class:`NetnsError` otherwise (``undrain`` of a pair
    without a circuit, say). Idempotent."""

    def __init__(self, fabric: NetnsFabric) -> None:
        self._fabric = fabric

    async def drain(self, pairs: frozenset[Pair]) -> None:
        """Route each pair over the bridge."""
        await asyncio.to_thread(self._move, pairs, onto_circuit=False)

    async def undrain(self, pairs: frozenset[Pair]) -> None:
        """Route each pair over the circuit between its hosts."""
        await asyncio.to_thread(self._move, pairs, onto_circuit=True)

    def _move(self, pairs: frozenset[Pair], *, onto_circuit: bool) -> None:
        move = self._fabric.route_circuit if onto_circuit else self._fabric.route_bridge
        with self._fabric.lock:
            for a, b in sorted(pairs):
                move(a, b)
