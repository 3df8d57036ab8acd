"""Hosts made of network namespaces on one kernel, for tests that need real links between hosts.

A :class:`Topology` is a "switch" namespace holding a Linux bridge and, per host, a namespace
with one veth pair: ``eth0`` inside the host, the other end a port of the bridge. Every host has
an address of its own in a private /24 drawn at random per topology (``10.X.Y.0/24``, checked
against the addresses this machine already uses), and its loopback up. Nothing is routed to the
root namespace: traffic stays between the hosts, and on each host's loopback.

``link_down(host)`` / ``link_up(host)`` set the host's end of its veth pair down and up: a network
partition of that host, silent to the others (their packets vanish; no reset comes back).
``close()`` kills whatever still runs in the namespaces and deletes them (their veth pairs and
the bridge go with them); it is idempotent, and the context manager calls it on the way out.

Namespaces need root and iproute2; :func:`require_netns` skips the test otherwise.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

import pytest

from orchestr.fabric.optical import free_subnets

__all__ = ["PREFIX", "Topology", "require_netns"]

#: What every topology's namespace names start with.
PREFIX = "oc-"
_DEVICE = "eth0"
_KILL_WAIT_S = 10.0


def require_netns() -> None:
    """Skip the calling test unless this process is root and ``ip`` (iproute2) is installed."""
    if os.geteuid() != 0:
        pytest.skip("hosts made of network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("hosts made of network namespaces need iproute2 (the ip command)")


def _ip(*args: str) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


class Topology:
    """``hosts`` as network namespaces joined by a bridge; see the module's docstring.

    Use it as a context manager, or call :meth:`open` and, in a ``finally``, :meth:`close`.
    """

    def __init__(self, hosts: Sequence[str]) -> None:
        if not hosts or len(set(hosts)) != len(hosts):
            raise ValueError(f"a topology needs distinct host names, got {list(hosts)!r}")
        self.hosts = list(hosts)
        self.tag = secrets.token_hex(3)
        self.switch = f"{PREFIX}{self.tag}-sw"
        self._ns = {h: f"{PREFIX}{self.tag}-{i}-{h}"[:48] for i, h in enumerate(self.hosts)}
        self._addresses: dict[str, str] = {}
        self._made: list[str] = []  # namespaces created so far, in order
        self.subnet: ipaddress.IPv4Network | None = None

    def __enter__(self) -> Topology:
        try:
            return self.open()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open(self) -> Topology:
        """Create the namespaces, the bridge and the links. Raises :class:`RuntimeError` with
        ip's message when a step fails; what was made so far is left for :meth:`close`."""
        self.subnet = free_subnets(1)[0]
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            ns, port = self._ns[host], f"p{i}"
            address = str(self.subnet.network_address + i + 1)
            _ip("netns", "add", ns)
            self._made.append(ns)
            other_end = ("peer", "name", port, "netns", self.switch)
            _ip("link", "add", "name", _DEVICE, "netns", ns, "type", "veth", *other_end)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", _DEVICE)
            _ip("-n", ns, "link", "set", _DEVICE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self._addresses[host] = address
        return self

    # -- what tests use ------------------------------------------------------------------------
    def namespace(self, host: str) -> str:
        return self._ns[host]

    def exec_args(self, host: str) -> list[str]:
        """The prefix that runs a command inside ``host``: ``["ip", "netns", "exec", NS]``."""
        return ["ip", "netns", "exec", self._ns[host]]

    def address(self, host: str) -> str:
        """``host``'s IPv4 address (no prefix length)."""
        return self._addresses[host]

    def link_down(self, host: str) -> None:
        """Set ``host``'s end of its link down: it can reach no other host, nor they it."""
        _ip("-n", self._ns[host], "link", "set", _DEVICE, "down")

    def link_up(self, host: str) -> None:
        """Set ``host``'s end of its link up again (its address and route come back with it)."""
        _ip("-n", self._ns[host], "link", "set", _DEVICE, "up")

    def pids(self, host: str | None = None) -> list[int]:
        """Processes now running in ``host``'s namespace, or in any of this topology's."""
        names = [self._ns[host]] if host is not None else list(self._made)
        found: list[int] = []
        for ns in names:
            with contextlib.suppress(RuntimeError):
                found += [int(p) for p in _ip("netns", "pids", ns).split()]
        return found

    def leftovers(self) -> list[str]:
        """This topology's namespaces that exist now (none once closed)."""
        return [line.split()[0] for line in _ip("netns", "list").splitlines() if self.tag in line]

    # -- teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill (SIGKILL) every process left in the namespaces, then delete them; the veth
        pairs and the bridge go with them. Idempotent; raises :class:`RuntimeError` when a
        namespace could not be deleted."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + _KILL_WAIT_S
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the kernel: nothing else says when they are gone
        failed = []
        while self._made:
            ns = self._made.pop()
            proc = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
            if proc.returncode != 0:
                failed.append(f"{ns}: {proc.stderr.strip()}")
        self._addresses.clear()
        if failed:
            raise RuntimeError(f"could not delete network namespaces: {'; '.join(failed)}")
