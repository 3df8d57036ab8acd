"""The tests' clusters, with leak checks: :func:`open_cluster` is ``oc.open_local_cluster``
that fails when the cluster leaves anything behind in this process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orchestr as oc
from orchestr.fabric.lowlevel import pool

#: Threads a process keeps for its life: the main one, gRPC's poller, the event loop's default
#: executor (``asyncio.to_thread``), the one-sided buffer backends' servers, and the shared
#: memory transport's piece and copy pools (made at a process's first large read).
_LIFELONG = re.compile(
    r"MainThread$|.*_poll_wrapper|asyncio_\d+|orchestr-(buffers|rdma|nixl)$"
    r"|orchestr-(shm|copy)_\d+$"
)
_CLOSE_WAIT = "08"


def _socket_inodes() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


def resources() -> dict[str, int]:
    """What a cluster could leave behind in this process: live child processes (workers), TCP
    connections whose peer has closed and we have not, shared-memory segments still lent to a
    peer, files in /dev/shm, and threads other than the lifelong ones."""
    children = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        children += int(fields[1]) == os.getpid() and fields[0] != "Z"
    mine = _socket_inodes()
    half_closed = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            half_closed += cols[3] == _CLOSE_WAIT and cols[9] in mine
    return {
        "child processes": children,
        "connections its peer closed": half_closed,
        "shared-memory segments lent": pool.stats()["held"],
        "/dev/shm files": sum(1 for _ in Path("/dev/shm").glob("orchestr*")),
        "threads": sum(not _LIFELONG.match(t.name) for t in threading.enumerate()),
    }


async def check_leaks(before: dict[str, int], wait_s: float = 5.0) -> None:
    """Fail when a cluster closed since ``before`` left anything behind (no child process may
    live on at all); allows ``wait_s`` for workers to be reaped and connections to end."""
    for _ in range(max(1, int(wait_s / 0.1))):
        after = resources()
        grown = {
            k: (before[k], v)
            for k, v in after.items()
            if v > before[k] or (k == "child processes" and v)
        }
        if not grown:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the cluster left behind (before, after): {grown}")


@contextlib.asynccontextmanager
async def open_cluster(*args: Any, **kwargs: Any) -> AsyncIterator[oc.JobContext]:
    """``oc.open_local_cluster(*args, **kwargs)``, then :func:`check_leaks` once it closed
    (not when the body raised: that error is the test's)."""
    before = resources()
    async with oc.open_local_cluster(*args, **kwargs) as job:
        yield job
    await check_leaks(before)
