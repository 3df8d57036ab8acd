"""The kernel side of :class:`~orchestr.fabric._optical._netns.NetnsFabric`: ``ip``/``tc`` commands.

Plain functions, no state of their own: running ``ip`` and ``tc`` (:func:`run`,
:func:`ip_json`, :func:`batch`, :func:`shape`), picking free private subnets
(:func:`free_subnets`), running a function in a thread moved into a namespace (:func:`call_in`),
and reading and writing what a fabric keeps in the kernel as interface aliases so that another
process can attach to it:

- the switch namespace's ``lo`` alias: ``orchestr-fabric subnet=… circuit_subnet=…
  electrical_mbit=… circuit_mbit=…`` (:func:`write_settings`, :func:`read_switch`);
- bridge port ``p<i>``'s alias: ``orchestr-host=<name>`` (:func:`add_bridge_port`);
- the bridge's alias: ``orchestr-ocs generation=<n>`` (:func:`read_generation`,
  :func:`write_generation`);
- a circuit's veth ends: its label as their alias, its /30 as their addresses
  (:func:`read_circuit_ends`, :func:`read_circuit_slots`).

Every function blocks on its commands (a few milliseconds each) and raises :class:`NetnsError`
when one fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import re
import secrets
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ._ocs import OcsError

__all__ = [
    "BRIDGE",
    "CIRCUIT",
    "CIRCUIT_NAME",
    "HOST_DEV",
    "PREFIX",
    "SLOTS",
    "TAG",
    "WORD",
    "NetnsError",
    "add_bridge_port",
    "batch",
    "call_in",
    "free_subnets",
    "ip_json",
    "namespaces",
    "netns_missing",
    "no_rp_filter",
    "read_circuit_ends",
    "read_circuit_slots",
    "read_generation",
    "read_switch",
    "run",
    "shape",
    "write_generation",
    "write_settings",
]

T = TypeVar("T")

PREFIX = "ocf-"
"""What every fabric's namespace names start with."""

HOST_DEV, BRIDGE, CIRCUIT = "eth0", "br0", "ckt"
CIRCUIT_NAME = re.compile(rf"{CIRCUIT}(\d+)")
WORD = re.compile(r"[A-Za-z0-9_.:=,+-]{1,64}")  # a host name or label: one word of an alias
TAG = re.compile(r"[0-9a-f]{6}")
SLOTS = 64  # /30 circuit subnets in the circuit /24
_GENERATION = re.compile(r"orchestr-ocs generation=(\d+)")
_SETTINGS = "orchestr-fabric"
_HOST_ALIAS = "orchestr-host="
_CMD_TIMEOUT_S = 30.0
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


# -- commands ----------------------------------------------------------------------------------


def run(*argv: str, stdin: str | None = None) -> str:
    """Run ``argv`` and return its stdout; :class:`NetnsError` when it fails or cannot run."""
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


def ip_json(*argv: str) -> list[dict[str, Any]]:
    """``ip -j ARGV``, parsed."""
    text = run("ip", "-j", *argv).strip()
    return list(json.loads(text)) if text else []


def batch(ns: str, *lines: str) -> None:
    """Run ``ip`` commands (one per line, without the ``ip``) in namespace ``ns`` at once."""
    run("ip", "-n", ns, "-batch", "-", stdin="\n".join(lines) + "\n")


def shape(ns: str, dev: str, mbit: float) -> None:
    """Make ``dev`` in ``ns`` send through a ``tbf`` qdisc at ``mbit``."""
    kbit = int(mbit * 1000)
    burst = max(64 * 1024, kbit * 1000 // 8 // 250)  # at least 4 ms at the rate
    tbf = ("rate", f"{kbit}kbit", "burst", str(burst), "latency", "50ms")
    run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", *tbf)


def namespaces() -> list[str]:
    """The named network namespaces that exist now."""
    return [line.split()[0] for line in run("ip", "netns", "list").splitlines() if line.strip()]


# -- addresses ---------------------------------------------------------------------------------


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    """IPv4 networks of the addresses and routes in the root and every named namespace."""
    found: list[ipaddress.IPv4Network] = []
    for ns in [None, *namespaces()]:
        where = ("-n", ns) if ns else ()
        try:
            addrs = ip_json(*where, "-4", "addr")
            routes = ip_json(*where, "-4", "route", "show", "table", "all")
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


def free_subnets(count: int) -> list[ipaddress.IPv4Network]:
    """``count`` random ``10.X.Y.0/24`` that overlap nothing this machine uses nor each other."""
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


# -- inside a namespace ------------------------------------------------------------------------


def call_in(ns: str, fn: Callable[[], T]) -> T:
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


def no_rp_filter() -> None:
    """Turn ``rp_filter`` off in the calling thread's namespace (run it with :func:`call_in`)."""
    # /proc/sys/net belongs to the network namespace of the thread that opens it.
    for conf in ("all", "default"):
        with open(f"/proc/sys/net/ipv4/conf/{conf}/rp_filter", "w") as f:
            f.write("0\n")


# -- settings kept in the kernel ---------------------------------------------------------------


def write_settings(
    switch: str,
    subnet: ipaddress.IPv4Network,
    circuit_subnet: ipaddress.IPv4Network,
    electrical_mbit: float,
    circuit_mbit: float,
) -> None:
    """Store a fabric's settings as the alias of ``lo`` in its switch namespace."""
    settings = (
        f"{_SETTINGS} subnet={subnet} circuit_subnet={circuit_subnet} "
        f"electrical_mbit={electrical_mbit!r} circuit_mbit={circuit_mbit!r}"
    )
    run("ip", "-n", switch, "link", "set", "lo", "alias", settings)


def add_bridge_port(switch: str, i: int, host: str) -> None:
    """Put port ``p<i>`` (host ``i``'s link) on the bridge, named after ``host``, and up."""
    batch(
        switch,
        f"link set p{i} master {BRIDGE}",
        f"link set p{i} alias {_HOST_ALIAS}{host}",
        f"link set p{i} up",
    )


def read_switch(switch: str) -> tuple[dict[str, str], dict[int, str]]:
    """The settings :func:`write_settings` stored (``{}`` when none) and the host names
    :func:`add_bridge_port` stored, by host index."""
    settings: dict[str, str] = {}
    names: dict[int, str] = {}
    for link in ip_json("-n", switch, "link", "show"):
        alias, name = str(link.get("ifalias", "")), str(link.get("ifname", ""))
        if name == "lo" and alias.startswith(f"{_SETTINGS} "):
            settings = dict(word.split("=", 1) for word in alias.split()[1:])
        elif re.fullmatch(r"p\d+", name) and alias.startswith(_HOST_ALIAS):
            names[int(name[1:])] = alias[len(_HOST_ALIAS) :]
    return settings, names


def write_generation(switch: str, generation: int) -> None:
    """Store the switch's generation as the bridge's alias."""
    run("ip", "-n", switch, "link", "set", BRIDGE, "alias", f"orchestr-ocs generation={generation}")


def read_generation(switch: str) -> int:
    """The generation :func:`write_generation` stored last."""
    [link] = ip_json("-n", switch, "link", "show", BRIDGE)
    m = _GENERATION.fullmatch(str(link.get("ifalias", "")))
    if m is None:
        raise NetnsError(f"the bridge of {switch} carries no generation; was it opened?")
    return int(m.group(1))


def read_circuit_slots(
    hosts_ns: Sequence[str], circuit_subnet: ipaddress.IPv4Network
) -> dict[tuple[int, int], int]:
    """The /30 slot of ``circuit_subnet`` each circuit's ends have addresses in, by host index
    pair (lower first); ``hosts_ns`` are the hosts' namespaces, in host order."""
    slots: dict[tuple[int, int], int] = {}
    base = int(circuit_subnet.network_address)
    for i, ns in enumerate(hosts_ns):
        for link in ip_json("-n", ns, "-4", "addr", "show"):
            m = CIRCUIT_NAME.fullmatch(str(link.get("ifname", "")))
            j = int(m.group(1)) if m is not None else i
            for a in link.get("addr_info", []) if j != i else []:
                slots[(min(i, j), max(i, j))] = (int(ipaddress.IPv4Address(a["local"])) - base) // 4
    return slots


def read_circuit_ends(hosts_ns: Sequence[str]) -> dict[tuple[int, int], str]:
    """The circuit ends that are up with a carrier, as ``(me, peer)`` host indices, with their
    alias (the circuit's label, ``""`` for none); ``hosts_ns`` as in :func:`read_circuit_slots`."""
    ends: dict[tuple[int, int], str] = {}
    for i, ns in enumerate(hosts_ns):
        for link in ip_json("-n", ns, "link", "show", "type", "veth"):
            m = CIRCUIT_NAME.fullmatch(str(link.get("ifname", "")))
            flags = link.get("flags", [])
            if m and "UP" in flags and "LOWER_UP" in flags:
                ends[(i, int(m.group(1)))] = str(link.get("ifalias", ""))
    return ends
