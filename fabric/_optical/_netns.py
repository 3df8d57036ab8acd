"""An emulated optical fabric on this machine: hosts are Linux network namespaces.

Layout (every name starts with ``ocf-<tag>``, a random tag per fabric):

- a **switch** namespace ``…-sw`` holding bridge ``br0``: the electrical path. Per host, a
  namespace ``…-<i>`` whose ``eth0`` is a veth pair with its other end on the bridge. Host ``i``
  has address ``.(i+1)`` in a private ``10.X.Y.0/24`` drawn at random and checked against the
  addresses and routes this machine (root and every named namespace) already uses. Each
  ``eth0`` sends through a ``tbf`` qdisc at ``electrical_mbit``: a slow shared network.
- a **circuit** between hosts ``i`` and ``j`` is a veth pair straight between their namespaces,
  ``ckt<j>`` in host ``i`` and ``ckt<i>`` in host ``j``, with a /30 from a second free /24, both
  ends shaped to ``circuit_mbit``.

Routes. A host always reaches a peer at the peer's bridge address. :meth:`NetnsFabric.route_circuit`
replaces the ``/32`` route to the peer by one via the peer's circuit end (source: the host's
own bridge address), in both hosts; :meth:`NetnsFabric.route_bridge` replaces it by a ``/32`` on
``eth0``. Neither address of a connection changes, so an established TCP connection only sees
its segments take another path (perhaps reordered), never a reset; ``rp_filter`` is off in every
namespace so that a packet arriving on the "other" interface while the two directions move one
after the other is accepted. Deleting a circuit takes its routes along (the /24 on ``eth0``
applies again).

The switch's generation (for :class:`~orchestr.fabric._optical._ocs_netns.NetnsOcs`) is kept in the
kernel too, as the bridge's alias, so it is read back from the "switch" like the circuits. So are
the fabric's own settings (the switch namespace's ``lo`` alias), each host's name (its bridge
port's alias) and a circuit's label (its veth ends' alias): another process, a head daemon say,
takes the fabric up by its tag with :meth:`NetnsFabric.attach`.

Every method blocks on ``ip``/``tc`` (a few milliseconds each) and is thread-safe; from async
code run them in a thread. Needs root and iproute2 (:func:`netns_missing` says why not). The
commands themselves, and the aliases' formats, live in :mod:`orchestr.fabric._optical._netns_kernel`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from ._netns_kernel import (
    BRIDGE,
    CIRCUIT,
    HOST_DEV,
    PREFIX,
    SLOTS,
    TAG,
    WORD,
    NetnsError,
    add_bridge_port,
    batch,
    call_in,
    free_subnets,
    ip_json,
    namespaces,
    netns_missing,
    no_rp_filter,
    read_circuit_ends,
    read_circuit_slots,
    read_generation,
    read_switch,
    run,
    shape,
    write_generation,
    write_settings,
)

__all__ = ["PREFIX", "NetnsError", "NetnsFabric", "netns_missing"]

T = TypeVar("T")

_KILL_WAIT_S = 10.0


class NetnsFabric:
    """Hosts as namespaces on a shaped bridge, with circuits between them; see the module.

    A context manager, sync or async; or call :meth:`open` and, in a ``finally``, :meth:`close`.
    """

    def __init__(
        self,
        hosts: Sequence[str],
        *,
        electrical_mbit: float = 50.0,
        circuit_mbit: float = 400.0,
    ) -> None:
        if len(hosts) < 2 or len(set(hosts)) != len(hosts) or len(hosts) > 250:
            raise ValueError(f"a fabric needs 2 to 250 distinct host names, got {list(hosts)!r}")
        if not all(isinstance(h, str) and WORD.fullmatch(h) for h in hosts):
            raise ValueError(f"host names are words of letters, digits and _.:=,+-; got {hosts!r}")
        if not (electrical_mbit > 0 and circuit_mbit > 0):
            raise ValueError("bandwidths must be positive Mbit/s")
        self.hosts = list(hosts)
        self.electrical_mbit = electrical_mbit
        self.circuit_mbit = circuit_mbit
        self.tag = secrets.token_hex(3)
        self.switch = f"{PREFIX}{self.tag}-sw"
        self.lock = threading.RLock()
        """Serializes changes; hold it across a read-check-change sequence."""
        self._index = {h: i for i, h in enumerate(self.hosts)}
        self._ns = [f"{PREFIX}{self.tag}-{i}" for i in range(len(self.hosts))]
        self._made: list[str] = []
        self._slots: dict[tuple[int, int], int] = {}
        self.subnet = ipaddress.IPv4Network("0.0.0.0/32")
        self.circuit_subnet = ipaddress.IPv4Network("0.0.0.0/32")

    # -- lifetime ------------------------------------------------------------------------------

    def __enter__(self) -> NetnsFabric:
        try:
            return self.open()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> NetnsFabric:
        """Create the namespaces, bridge and links (blocks on ``ip``/``tc`` in a thread); raises
        :class:`NetnsError` with nothing left behind. Not cancel-safe: the thread finishes
        the set-up, which ``__aexit__`` then undoes."""
        return await asyncio.to_thread(self.__enter__)

    async def __aexit__(self, *exc_info: object) -> None:
        """Remove everything this fabric made; blocks on ``ip``; raises nothing. Cancel-safe: the
        thread finishes the removal."""
        await asyncio.to_thread(self.close)

    def open(self) -> NetnsFabric:
        """Create the namespaces, the bridge and the shaped host links. Raises
        :class:`NetnsError`; what was made so far is left for :meth:`close`."""
        with self.lock:
            self.subnet, self.circuit_subnet = free_subnets(2)
            self._add_namespace(self.switch)
            run("ip", "-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
            run("ip", "-n", self.switch, "link", "set", BRIDGE, "up")
            self.set_switch_generation(0)
            write_settings(
                self.switch,
                self.subnet,
                self.circuit_subnet,
                self.electrical_mbit,
                self.circuit_mbit,
            )
            for i, ns in enumerate(self._ns):
                self._add_namespace(ns)
                other_end = ("peer", "name", f"p{i}", "netns", self.switch)
                run("ip", "link", "add", "name", HOST_DEV, "netns", ns, "type", "veth", *other_end)
                add_bridge_port(self.switch, i, self.hosts[i])
                batch(
                    ns,
                    f"addr add {self.address(self.hosts[i])}/24 dev {HOST_DEV}",
                    f"link set {HOST_DEV} up",
                    "link set lo up",
                )
                shape(ns, HOST_DEV, self.electrical_mbit)
        return self

    @classmethod
    def attach(cls, tag: str) -> NetnsFabric:
        """The fabric another process opened with namespaces ``ocf-<tag>-…``, read back from
        the kernel: hosts, addresses, rates and live circuits. It changes circuits and routes
        as its maker would (one process at a time: they share the kernel's state, not the
        lock), and :meth:`close` leaves the namespaces to their maker. Raises ``ValueError``
        for a malformed tag and :class:`NetnsError` when no such fabric runs."""
        if not isinstance(tag, str) or not TAG.fullmatch(tag):
            raise ValueError(f"a fabric's tag is 6 hex digits (ocf-TAG-sw), got {tag!r}")
        switch = f"{PREFIX}{tag}-sw"
        if switch not in namespaces():
            raise NetnsError(f"no emulated fabric {tag}: there is no namespace {switch}")
        settings, names = read_switch(switch)
        try:
            fabric = cls(
                [names[i] for i in range(len(names))],
                electrical_mbit=float(settings["electrical_mbit"]),
                circuit_mbit=float(settings["circuit_mbit"]),
            )
            fabric.subnet = ipaddress.IPv4Network(settings["subnet"])
            fabric.circuit_subnet = ipaddress.IPv4Network(settings["circuit_subnet"])
        except (KeyError, ValueError) as exc:
            raise NetnsError(
                f"{switch} does not describe its fabric (settings {settings}, hosts {names}): "
                f"was it made by NetnsFabric.open? ({exc!r})"
            ) from None
        fabric.tag, fabric.switch = tag, switch
        fabric._ns = [f"{PREFIX}{tag}-{i}" for i in range(len(fabric.hosts))]
        fabric._slots = read_circuit_slots(fabric._ns, fabric.circuit_subnet)
        return fabric

    def close(self) -> None:
        """Kill (SIGKILL) every process left in the namespaces and delete them; links, routes
        and the bridge go with them (nothing for an attached fabric: its maker does it).
        Idempotent; raises :class:`NetnsError` when a namespace could not be deleted."""
        with self.lock:
            for pid in self.pids():
                if pid != os.getpid():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + _KILL_WAIT_S
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.05)  # nothing else says when the kernel has reaped them
            failed = []
            while self._made:
                ns = self._made.pop()
                try:
                    run("ip", "netns", "del", ns)
                except NetnsError as exc:
                    failed.append(str(exc))
            self._slots.clear()
            if failed:
                raise NetnsError("could not delete namespaces: " + "; ".join(failed))

    # -- hosts ---------------------------------------------------------------------------------

    def namespace(self, host: str) -> str:
        return self._ns[self._host(host)]

    def address(self, host: str) -> str:
        """``host``'s bridge address, the one peers always reach it at."""
        return str(self.subnet.network_address + self._host(host) + 1)

    def exec_args(self, host: str) -> list[str]:
        """The prefix that runs a command inside ``host``: ``["ip", "netns", "exec", NS]``."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def call_in(self, host: str, fn: Callable[[], T]) -> T:
        """Run ``fn()`` in a new thread inside ``host``'s network namespace and return what it
        returns (or raise what it raised). Blocks until ``fn`` returns. Sockets ``fn`` opens
        belong to ``host``, also when later used from another thread. Only that new thread
        moves, so a pooled thread (``asyncio.to_thread``) may call this safely."""
        return call_in(self.namespace(host), fn)

    def pids(self) -> list[int]:
        """Processes now running in this fabric's namespaces."""
        found: list[int] = []
        for ns in list(self._made):
            with contextlib.suppress(NetnsError):
                found += [int(p) for p in run("ip", "netns", "pids", ns).split()]
        return found

    def leftovers(self) -> list[str]:
        """This fabric's namespaces that exist now (none once closed)."""
        return [ns for ns in namespaces() if ns.startswith(f"{PREFIX}{self.tag}-")]

    # -- circuits ------------------------------------------------------------------------------

    def connect(self, a: str, b: str, *, label: str = "") -> None:
        """Create the circuit between hosts ``a`` and ``b`` (a no-op when it is live), its ends
        carrying ``label`` (a word; :meth:`circuit_labels`). Routes stay where they are. Raises
        :class:`NetnsError`, after undoing what it made."""
        i, j = self._pair(a, b)
        if label and not WORD.fullmatch(label):
            raise ValueError(
                f"a circuit's label is one word of letters, digits and _.:=,+-; got {label!r}"
            )
        with self.lock:
            if (self.hosts[min(i, j)], self.hosts[max(i, j)]) in self.circuits():
                return
            self._delete_circuit(i, j)  # a half-dead one (an end set down)
            key = (min(i, j), max(i, j))
            free = sorted(set(range(SLOTS)) - set(self._slots.values()))
            if not free:
                raise NetnsError(f"all {SLOTS} circuit subnets are in use; disconnect some")
            self._slots[key] = free[0]
            try:
                one_end = ("name", f"{CIRCUIT}{j}", "netns", self._ns[i])
                other_end = ("peer", "name", f"{CIRCUIT}{i}", "netns", self._ns[j])
                run("ip", "link", "add", *one_end, "type", "veth", *other_end)
                for me, peer in ((i, j), (j, i)):
                    dev = f"{CIRCUIT}{peer}"
                    batch(
                        self._ns[me],
                        f"addr add {self._circuit_end(me, peer)}/30 dev {dev}",
                        *([f"link set {dev} alias {label}"] if label else []),
                        f"link set {dev} up",
                    )
                    shape(self._ns[me], dev, self.circuit_mbit)
            except NetnsError:
                self._delete_circuit(i, j)
                raise

    def disconnect(self, a: str, b: str) -> None:
        """Delete the circuit between ``a`` and ``b``; routes over it fall back to the bridge.
        Idempotent."""
        i, j = self._pair(a, b)
        with self.lock:
            self._delete_circuit(i, j)

    def disconnect_all(self) -> None:
        """Delete every circuit. Idempotent."""
        with self.lock:
            for a, b in self.circuits():
                self.disconnect(a, b)

    def circuits(self) -> frozenset[tuple[str, str]]:
        """The live circuits, read from the kernel: host pairs (in host order) whose two ends
        both exist, are up and have a carrier."""
        return frozenset(self.circuit_labels())

    def circuit_labels(self) -> dict[tuple[str, str], str]:
        """The live circuits (as :meth:`circuits`) with the label each was connected with
        (``""`` for none), read from the kernel."""
        with self.lock:
            ends = read_circuit_ends(self._ns)
        return {
            (self.hosts[i], self.hosts[j]): label
            for (i, j), label in ends.items()
            if i < j and (j, i) in ends
        }

    # -- routes --------------------------------------------------------------------------------

    def route_circuit(self, a: str, b: str) -> None:
        """Route ``a``<->``b`` traffic (both directions) over their circuit. Idempotent; raises
        :class:`NetnsError` when there is no circuit (the routes may be half moved)."""
        self._route(a, b, onto_circuit=True)

    def route_bridge(self, a: str, b: str) -> None:
        """Route ``a``<->``b`` traffic (both directions) over the bridge. Idempotent."""
        self._route(a, b, onto_circuit=False)

    def route_device(self, a: str, b: str) -> str:
        """The interface ``a`` sends to ``b``'s address through, read from the kernel."""
        [route] = ip_json("-n", self.namespace(a), "route", "get", self.address(b))
        return str(route["dev"])

    def circuit_device(self, a: str, b: str) -> str:
        """The name of ``a``'s end of a circuit to ``b``."""
        return f"{CIRCUIT}{self._host(b)}"

    # -- the switch's generation ---------------------------------------------------------------

    def switch_generation(self) -> int:
        """The generation last written by :meth:`set_switch_generation` (0 at first)."""
        return read_generation(self.switch)

    def set_switch_generation(self, generation: int) -> None:
        write_generation(self.switch, generation)

    # -- helpers -------------------------------------------------------------------------------

    def _host(self, host: str) -> int:
        try:
            return self._index[host]
        except KeyError:
            raise ValueError(f"no host {host!r} in this fabric; hosts: {self.hosts}") from None

    def _pair(self, a: str, b: str) -> tuple[int, int]:
        i, j = self._host(a), self._host(b)
        if i == j:
            raise ValueError(f"a circuit joins two different hosts, not {a!r} to itself")
        return i, j

    def _addr(self, i: int) -> str:
        return str(self.subnet.network_address + i + 1)

    def _circuit_end(self, me: int, peer: int) -> str:
        """The address of ``me``'s end of the circuit to ``peer``: the lower host gets .1."""
        slot = self._slots[(min(me, peer), max(me, peer))]
        return str(self.circuit_subnet.network_address + 4 * slot + (1 if me < peer else 2))

    def _route(self, a: str, b: str, *, onto_circuit: bool) -> None:
        i, j = self._pair(a, b)
        with self.lock:
            for me, peer in ((i, j), (j, i)):
                to = f"{self._addr(peer)}/32"
                path = ["dev", HOST_DEV]
                if onto_circuit:
                    if (min(i, j), max(i, j)) not in self._slots:
                        raise NetnsError(f"no circuit between {a} and {b}: connect them first")
                    path = ["via", self._circuit_end(peer, me), "dev", f"{CIRCUIT}{peer}"]
                run("ip", "-n", self._ns[me], "route", "replace", to, *path, "src", self._addr(me))

    def _delete_circuit(self, i: int, j: int) -> None:
        for me, peer in ((i, j), (j, i)):  # either end alone may be left
            with contextlib.suppress(NetnsError):  # already gone
                run("ip", "-n", self._ns[me], "link", "del", f"{CIRCUIT}{peer}")
        self._slots.pop((min(i, j), max(i, j)), None)

    def _add_namespace(self, ns: str) -> None:
        run("ip", "netns", "add", ns)
        self._made.append(ns)
        # IPv4 conf of a new namespace is inherited from the root one, which may filter.
        call_in(ns, no_rp_filter)
