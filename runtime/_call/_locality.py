"""Where a call-path peer is: process keys in addresses, probes each side maps to prove it
shares this host's memory, and what the connection itself says about the peer's host.

A call address names its serving process (``tcp://host:port?proc=HOST:PID:NONCE``) and may
offer a same-host listener (``&local=shm://...``). A claimed process key is never trusted alone:
see :func:`peer_is_local`, :func:`check_probe` and :func:`self_secret`.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import urllib.parse
from typing import Any

from orchestr.errors import OrchestrError
from orchestr.fabric import process_key
from orchestr.fabric.lowlevel import Segment, open_peer

__all__ = [
    "address_with_process",
    "check_probe",
    "is_u64",
    "local_url_of_address",
    "peer_is_local",
    "peer_of_address",
    "probe",
    "self_secret",
]

_probe: Segment | None = None


def probe() -> list[int]:
    """This process's probe segment as ``[pid, fd, key]``."""
    global _probe
    if _probe is None or _probe.name.split(".")[1] != str(os.getpid()):
        _probe = Segment(64)
    return [os.getpid(), _probe.fd, _probe.key]


_secret: list[str] = []


def self_secret() -> str:
    """A secret of this process: a connection that claims to come from this very process
    proves it with this (a peer could otherwise claim our own process key)."""
    if not _secret or _secret[0] != str(os.getpid()):
        _secret[:] = [str(os.getpid()), secrets.token_hex(16)]
    return _secret[1]


def check_probe(wire: Any, pid: int) -> str | None:
    """``None`` if this process can map the peer's probe (a segment the peer made), else why
    not."""
    if wire is None:
        return "the peer offered no shared memory to check"
    if not (isinstance(wire, list) and len(wire) == 3 and all(is_u64(v) for v in wire)):
        return f"the peer's probe is malformed: {wire!r}"
    p_pid, fd, key = wire
    if p_pid != pid:
        return f"the peer's probe names process {p_pid}, not the peer ({pid})"
    try:
        open_peer(p_pid, fd, key).close()
    except OrchestrError as exc:
        return f"cannot map the peer's shared memory: {exc}"
    return None


def is_u64(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 64


def peer_is_local(transport: Any) -> bool:
    """Whether the other end of ``transport`` runs on this host, judged by the connection
    itself (a peer's claimed process key is not enough): a Unix socket, or TCP from loopback
    or from the very address it reached us at."""
    if transport is None:
        return False
    peer = transport.get_extra_info("peername")
    sock = transport.get_extra_info("sockname")
    if not isinstance(peer, tuple):
        return True  # a Unix socket (shm://) or an in-process pipe
    try:
        peer_ip = ipaddress.ip_address(peer[0])
    except ValueError:
        return False
    return peer_ip.is_loopback or (isinstance(sock, tuple) and peer[0] == sock[0])


def address_with_process(url: str, local: str | None = None) -> str:
    """A call address that also names the serving process (so callers know where it is) and,
    when given, the URL of a listener for callers on the same host."""
    address = f"{url}?proc={process_key()}"
    return f"{address}&local={local}" if local else address


def _query(url: str) -> dict[str, str]:
    _, _, query = url.partition("?")
    return {k: v[0] for k, v in urllib.parse.parse_qs(query).items()}


def peer_of_address(url: str) -> str | None:
    return _query(url).get("proc")


def local_url_of_address(url: str) -> str | None:
    """The same-host listener an address offers (``shm://...``), if any."""
    return _query(url).get("local")
