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

The switch's generation (for :class:`~orchestr.fabric._ocs_netns.NetnsOcs`) is kept in the
kernel too, as the bridge's alias, so it is read back from the "switch" like the circuits. So are
the fabric's own settings (the switch namespace's ``lo`` alias), each host's name (its bridge
port's alias) and a circuit's label (its veth ends' alias): another process, a head daemon say,
takes the fabric up by its tag with :meth:`NetnsFabric.attach`.

Every method blocks on ``ip``/``tc`` (a few milliseconds each) and is thread-safe; from async
code run them in a thread. Needs root and iproute2 (:func:`netns_missing` says why not).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ._ocs import OcsError

__all__ = ["PREFIX", "NetnsError", "NetnsFabric", "netns_missing"]

T = TypeVar("T")

PREFIX = "ocf-"
"""What every fabric's namespace names start with."""

_HOST_DEV, _BRIDGE, _CIRCUIT = "eth0", "br0", "ckt"
_CIRCUIT_NAME = re.compile(rf"{_CIRCUIT}(\d+)")
_GENERATION = re.compile(r"orchestr-ocs generation=(\d+)")
_SETTINGS = "orchestr-fabric"
_HOST_ALIAS = "orchestr-host="
_WORD = re.compile(r"[A-Za-z0-9_.:=,+-]{1,64}")  # a host name or label: one word of an alias
_TAG = re.compile(r"[0-9a-f]{6}")
_SLOTS = 64  # /30 circuit subnets in the circuit /24
_CMD_TIMEOUT_S = 30.0
_KILL_WAIT_S = 10.0
_CLONE_NEWNET = 0x40000000


class NetnsError(OcsError):
    """An ``ip`` or ``tc`` command of the emulated fabric failed; the message has the command
    and what it printed."""


def netns_missing() -> str | None:
    """Why this machine cannot run an emulated fabric (not root, no ``ip`` or ``tc``), or None."""
    if os.geteuid() != 0:
        return "an emulated fabric of network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"an emulated fabric needs iproute2's `{tool}` command"
    return None


def _run(*argv: str, stdin: str | None = None) -> str:
    try:
        proc = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"`{' '.join(argv)}` could not run: {exc}") from exc
    if proc.returncode != 0:
        out = (proc.stderr or proc.stdout).strip()
        raise NetnsError(f"`{' '.join(argv)}` failed: {out}")
    return proc.stdout


def _ip_json(*argv: str) -> list[dict[str, Any]]:
    text = _run("ip", "-j", *argv).strip()
    return list(json.loads(text)) if text else []


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    """IPv4 networks of the addresses and routes in the root and every named namespace."""
    names = [None, *(line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line)]
    found: list[ipaddress.IPv4Network] = []
    for ns in names:
        where = ("-n", ns) if ns else ()
        try:
            addrs = _ip_json(*where, "-4", "addr")
            routes = _ip_json(*where, "-4", "route", "show", "table", "all")
        except NetnsError:
            continue  # a namespace deleted meanwhile
        words = [f"{a['local']}/{a['prefixlen']}" for i in addrs for a in i.get("addr_info", [])]
        words += [str(r.get("dst", "")) for r in routes]
        for word in words:
            with contextlib.suppress(ValueError):
                net = ipaddress.IPv4Network(word, strict=False)
                if net.prefixlen > 0:
                    found.append(net)
    return found


def _free_subnets(count: int) -> list[ipaddress.IPv4Network]:
    used = _networks_in_use()
    picked: list[ipaddress.IPv4Network] = []
    for _ in range(400):
        net = ipaddress.IPv4Network(
            f"10.{secrets.randbelow(254) + 1}.{secrets.randbelow(254)}.0/24"
        )
        if not any(net.overlaps(u) for u in [*used, *picked]):
            picked.append(net)
            if len(picked) == count:
                return picked
    raise NetnsError("found no free private 10.X.Y.0/24 in 400 draws; is 10/8 all in use?")


def _call_in(ns: str, fn: Callable[[], T]) -> T:
    """Run ``fn()`` in a new thread that has moved (alone) into namespace ``ns``."""
    out: list[T] = []
    err: list[BaseException] = []

    def target() -> None:
        try:
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                rc: int = ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET)
            finally:
                os.close(fd)
            if rc != 0:
                raise NetnsError(f"setns into {ns} failed: {os.strerror(ctypes.get_errno())}")
            out.append(fn())
        except BaseException as exc:  # handed over to the caller's thread
            err.append(exc)

    thread = threading.Thread(target=target, name=f"netns-{ns}", daemon=True)
    thread.start()
    thread.join()
    if err:
        raise err[0]
    return out[0]


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
        if not all(isinstance(h, str) and _WORD.fullmatch(h) for h in hosts):
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
        return await asyncio.to_thread(self.__enter__)

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.close)

    def open(self) -> NetnsFabric:
        """Create the namespaces, the bridge and the shaped host links. Raises
        :class:`NetnsError`; what was made so far is left for :meth:`close`."""
        with self.lock:
            self.subnet, self.circuit_subnet = _free_subnets(2)
            self._add_namespace(self.switch)
            _run("ip", "-n", self.switch, "link", "add", _BRIDGE, "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", _BRIDGE, "up")
            self.set_switch_generation(0)
            settings = (
                f"{_SETTINGS} subnet={self.subnet} circuit_subnet={self.circuit_subnet} "
                f"electrical_mbit={self.electrical_mbit!r} circuit_mbit={self.circuit_mbit!r}"
            )
            _run("ip", "-n", self.switch, "link", "set", "lo", "alias", settings)
            for i, ns in enumerate(self._ns):
                self._add_namespace(ns)
                _run("ip", "link", "add", "name", _HOST_DEV, "netns", ns, "type", "veth",
                     "peer", "name", f"p{i}", "netns", self.switch)  # fmt: skip
                self._batch(
                    self.switch,
                    f"link set p{i} master {_BRIDGE}",
                    f"link set p{i} alias {_HOST_ALIAS}{self.hosts[i]}",
                    f"link set p{i} up",
                )
                self._batch(
                    ns,
                    f"addr add {self.address(self.hosts[i])}/24 dev {_HOST_DEV}",
                    f"link set {_HOST_DEV} up",
                    "link set lo up",
                )
                self._shape(ns, _HOST_DEV, self.electrical_mbit)
        return self

    @classmethod
    def attach(cls, tag: str) -> NetnsFabric:
        """The fabric another process opened with namespaces ``ocf-<tag>-…``, read back from
        the kernel: hosts, addresses, rates and live circuits. It changes circuits and routes
        as its maker would (one process at a time: they share the kernel's state, not the
        lock), and :meth:`close` leaves the namespaces to their maker. Raises ``ValueError``
        for a malformed tag and :class:`NetnsError` when no such fabric runs."""
        if not isinstance(tag, str) or not _TAG.fullmatch(tag):
            raise ValueError(f"a fabric's tag is 6 hex digits (ocf-TAG-sw), got {tag!r}")
        switch = f"{PREFIX}{tag}-sw"
        listed = _run("ip", "netns", "list").split("\n")
        if switch not in {line.split()[0] for line in listed if line.strip()}:
            raise NetnsError(f"no emulated fabric {tag}: there is no namespace {switch}")
        settings: dict[str, str] = {}
        names: dict[int, str] = {}
        for link in _ip_json("-n", switch, "link", "show"):
            alias, name = str(link.get("ifalias", "")), str(link.get("ifname", ""))
            if name == "lo" and alias.startswith(f"{_SETTINGS} "):
                settings = dict(word.split("=", 1) for word in alias.split()[1:])
            elif re.fullmatch(r"p\d+", name) and alias.startswith(_HOST_ALIAS):
                names[int(name[1:])] = alias[len(_HOST_ALIAS) :]
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
        base = int(fabric.circuit_subnet.network_address)
        for i, ns in enumerate(fabric._ns):  # the circuit subnets in use, from their addresses
            for link in _ip_json("-n", ns, "-4", "addr", "show"):
                m = _CIRCUIT_NAME.fullmatch(str(link.get("ifname", "")))
                j = int(m.group(1)) if m is not None else i
                for a in link.get("addr_info", []) if j != i else []:
                    key = (min(i, j), max(i, j))
                    fabric._slots[key] = (int(ipaddress.IPv4Address(a["local"])) - base) // 4
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
                    _run("ip", "netns", "del", ns)
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
        return _call_in(self.namespace(host), fn)

    def pids(self) -> list[int]:
        """Processes now running in this fabric's namespaces."""
        found: list[int] = []
        for ns in list(self._made):
            with contextlib.suppress(NetnsError):
                found += [int(p) for p in _run("ip", "netns", "pids", ns).split()]
        return found

    def leftovers(self) -> list[str]:
        """This fabric's namespaces that exist now (none once closed)."""
        lines = _run("ip", "netns", "list").splitlines()
        return [line.split()[0] for line in lines if line.startswith(f"{PREFIX}{self.tag}-")]

    # -- circuits ------------------------------------------------------------------------------

    def connect(self, a: str, b: str, *, label: str = "") -> None:
        """Create the circuit between hosts ``a`` and ``b`` (a no-op when it is live), its ends
        carrying ``label`` (a word; :meth:`circuit_labels`). Routes stay where they are. Raises
        :class:`NetnsError`, after undoing what it made."""
        i, j = self._pair(a, b)
        if label and not _WORD.fullmatch(label):
            raise ValueError(
                f"a circuit's label is one word of letters, digits and _.:=,+-; got {label!r}"
            )
        with self.lock:
            if (self.hosts[min(i, j)], self.hosts[max(i, j)]) in self.circuits():
                return
            self._delete_circuit(i, j)  # a half-dead one (an end set down)
            key = (min(i, j), max(i, j))
            free = sorted(set(range(_SLOTS)) - set(self._slots.values()))
            if not free:
                raise NetnsError(f"all {_SLOTS} circuit subnets are in use; disconnect some")
            self._slots[key] = free[0]
            try:
                _run("ip", "link", "add", "name", f"{_CIRCUIT}{j}", "netns", self._ns[i],
                     "type", "veth", "peer", "name", f"{_CIRCUIT}{i}", "netns", self._ns[j])  # fmt: skip
                for me, peer in ((i, j), (j, i)):
                    dev = f"{_CIRCUIT}{peer}"
                    self._batch(
                        self._ns[me],
                        f"addr add {self._circuit_end(me, peer)}/30 dev {dev}",
                        *([f"link set {dev} alias {label}"] if label else []),
                        f"link set {dev} up",
                    )
                    self._shape(self._ns[me], dev, self.circuit_mbit)
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
        ends: dict[tuple[int, int], str] = {}
        with self.lock:
            for i, ns in enumerate(self._ns):
                for link in _ip_json("-n", ns, "link", "show", "type", "veth"):
                    m = _CIRCUIT_NAME.fullmatch(str(link.get("ifname", "")))
                    flags = link.get("flags", [])
                    if m and "UP" in flags and "LOWER_UP" in flags:
                        ends[(i, int(m.group(1)))] = str(link.get("ifalias", ""))
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
        [route] = _ip_json("-n", self.namespace(a), "route", "get", self.address(b))
        return str(route["dev"])

    def circuit_device(self, a: str, b: str) -> str:
        """The name of ``a``'s end of a circuit to ``b``."""
        return f"{_CIRCUIT}{self._host(b)}"

    # -- the switch's generation ---------------------------------------------------------------

    def switch_generation(self) -> int:
        """The generation last written by :meth:`set_switch_generation` (0 at first)."""
        [link] = _ip_json("-n", self.switch, "link", "show", _BRIDGE)
        m = _GENERATION.fullmatch(str(link.get("ifalias", "")))
        if m is None:
            raise NetnsError(f"the bridge of {self.switch} carries no generation; was it opened?")
        return int(m.group(1))

    def set_switch_generation(self, generation: int) -> None:
        _run("ip", "-n", self.switch, "link", "set", _BRIDGE,
             "alias", f"orchestr-ocs generation={generation}")  # fmt: skip

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
                path = ["dev", _HOST_DEV]
                if onto_circuit:
                    if (min(i, j), max(i, j)) not in self._slots:
                        raise NetnsError(f"no circuit between {a} and {b}: connect them first")
                    path = ["via", self._circuit_end(peer, me), "dev", f"{_CIRCUIT}{peer}"]
                _run("ip", "-n", self._ns[me], "route", "replace", to, *path, "src", self._addr(me))

    def _delete_circuit(self, i: int, j: int) -> None:
        for me, peer in ((i, j), (j, i)):  # either end alone may be left
            with contextlib.suppress(NetnsError):  # already gone
                _run("ip", "-n", self._ns[me], "link", "del", f"{_CIRCUIT}{peer}")
        self._slots.pop((min(i, j), max(i, j)), None)

    def _add_namespace(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self._made.append(ns)
        # IPv4 conf of a new namespace is inherited from the root one, which may filter.
        _call_in(ns, _no_rp_filter)

    @staticmethod
    def _batch(ns: str, *lines: str) -> None:
        _run("ip", "-n", ns, "-batch", "-", stdin="\n".join(lines) + "\n")

    @staticmethod
    def _shape(ns: str, dev: str, mbit: float) -> None:
        kbit = int(mbit * 1000)
        burst = max(64 * 1024, kbit * 1000 // 8 // 250)  # at least 4 ms at the rate
        _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
             "rate", f"{kbit}kbit", "burst", str(burst), "latency", "50ms")  # fmt: skip


def _no_rp_filter() -> None:
    # /proc/sys/net belongs to the network namespace of the thread that opens it.
    for conf in ("all", "default"):
        with open(f"/proc/sys/net/ipv4/conf/{conf}/rp_filter", "w") as f:
            f.write("0\n")
