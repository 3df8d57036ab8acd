"""Who and where this process is, as the data plane sees it.

Two processes can share memory when they run on one kernel, in one PID namespace (``/proc``
names the same processes) and in one network namespace (the test clusters model separate hosts
as network namespaces). ``host_id`` captures exactly that; ``ORCHESTR_HOST_ID`` overrides it.
"""

from __future__ import annotations

import hashlib
import os
import secrets

__all__ = ["host_id", "process_key"]

_cache: dict[str, str] = {}


def _ns(kind: str) -> str:
    try:
        return str(os.stat(f"/proc/self/ns/{kind}").st_ino)
    except OSError:
        return "?"


def host_id() -> str:
    """A short id shared by every process that can map this process's shared memory."""
    value = _cache.get("host")
    if value is None:
        value = os.environ.get("ORCHESTR_HOST_ID", "")
        if not value:
            try:
                with open("/proc/sys/kernel/random/boot_id") as f:
                    boot = f.read().strip()
            except OSError:
                boot = os.uname().nodename
            raw = f"{boot}/{_ns('pid')}/{_ns('net')}".encode()
            value = hashlib.blake2s(raw, digest_size=6).hexdigest()
        _cache["host"] = value
    return value


def process_key() -> str:
    """``host:pid:nonce``: names this process; the nonce tells a reused pid apart."""
    value = _cache.get("process")
    if value is None:
        value = f"{host_id()}:{os.getpid()}:{secrets.token_hex(4)}"
        _cache["process"] = value
    return value


def pid_of(key: str) -> int:
    return int(key.split(":")[1])


def host_of(key: str) -> str:
    return key.split(":")[0]


os.register_at_fork(after_in_child=_cache.clear)
