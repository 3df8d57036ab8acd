"""Rule: a buffer owner's tcp side channel gives nothing to a peer that has not shown a region
key, holds a bounded number of connections, and drops those that sit silent; another user
cannot map the shared memory an ``shm`` reader maps (a buffer's segment, the region table);
and a transfer from an owner that stopped answering fails instead of hanging."""

from __future__ import annotations

import asyncio
import os
import signal
import struct
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import orchestr as oc
from orchestr import fabric
from orchestr.fabric._buffers._sidechannel import SideChannel
from orchestr.fabric._registry import settings
from tests.cluster import open_cluster
from tests.procinfo import stop
from tests.runtime.call.bulk_actors import Owner

from .conftest import Attacker

REQUEST = struct.Struct("<4sBQQQQ")


@pytest.fixture
def quick_stall() -> Iterator[None]:
    before = settings.stall_timeout
    fabric.configure(stall_timeout=1.0)
    yield
    fabric.configure(stall_timeout=before)


def _tcp_endpoint(buf: fabric.Buffer) -> tuple[int, int, int]:
    for scheme, _, region, key, _, where in buf.to_wire()[3]:
        if scheme == "tcp":
            return int(where[1]), int(region), int(key)
    raise AssertionError("no tcp descriptor")


async def test_the_side_channel_is_capped_and_drops_silent_peers(
    attacker: Attacker, quick_stall: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(SideChannel, "max_connections", 16)
    data = np.arange(4096, dtype=np.uint8)
    with fabric.Buffer(data) as buf:
        port, _, _ = _tcp_endpoint(buf)
        handle = fabric.Buffer.from_wire(buf.to_wire())
        held = asyncio.ensure_future(attacker.run("hold", port=port, count=40, first=0.3, then=5.0))
        await asyncio.sleep(0.6)
        out = np.zeros_like(data)
        # 16 silent connections are served (until their stall timeout): a reader may wait
        # its turn, then gets through
        for _ in range(40):
            try:
                assert await handle.read_into(out, transport="tcp") == "tcp"
                break
            except oc.OrchestrError:
                await asyncio.sleep(0.2)
        assert np.array_equal(out, data)
        report = await held
        assert report["closed_first"] >= 24  # past the cap, closed on arrival
        assert report["closed_then"] == 40  # and the rest once silent for the stall timeout


async def test_a_wrong_key_gets_no_bytes(attacker: Attacker) -> None:
    data = np.full(4096, 7, dtype=np.uint8)
    with fabric.Buffer(data) as buf:
        port, region, key = _tcp_endpoint(buf)
        for op, (r, k) in [(1, (region, key ^ 1)), (1, (region + 1000, key)), (2, (region, 0))]:
            request = REQUEST.pack(b"OBUF", op, r, k, 0, 4096)
            report = await attacker.run("send", port=port, data=request.hex(), wait=2.0)
            received = bytes.fromhex(report["received"])
            assert report["closed"] and received[0] != 0 and bytes([7]) * 64 not in received
        request = REQUEST.pack(b"OBUF", 1, region, key, 0, 4096)
        report = await attacker.run("send", port=port, data=request.hex(), wait=2.0)
        assert bytes.fromhex(report["received"])[5:] == data.tobytes()  # the key opens it


def _own_segments() -> list[int]:
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:
            continue  # the listing's own descriptor, gone already
        if target.startswith("/memfd:orchestr."):
            fds.append(int(fd))
    return fds


def _read_own_fd(fd: int, nbytes: int) -> bytes:
    with open(f"/proc/self/fd/{fd}", "rb") as f:
        return f.read(nbytes)


async def test_another_user_cannot_map_a_buffers_shared_memory(attacker: Attacker) -> None:
    """A region in shared memory (as weights are published) is read by mapping the owner's
    segment through ``/proc/PID/fd``: that path is this process's user's alone. So another
    user can neither borrow it nor hold the lock a borrow takes (which would keep the owner
    from claiming it): the lock needs that open of the segment file."""
    data = fabric.empty(1 << 20, dtype=torch.uint8)
    data.fill_(7)
    with fabric.Buffer(data) as buf:
        fds = _own_segments()
        assert len(fds) >= 2  # the buffer's segment and the region table at least
        # the owner's own user reads them (the segment's bytes among them): the fds are right
        mine = [_read_own_fd(fd, 8192) for fd in fds]
        assert any(bytes([7]) * 4096 in b for b in mine)
        report = await attacker.run("peek", pid=os.getpid(), fds=fds, nbytes=8192)
        assert set(report["fds"].values()) == {"PermissionError"}, report
        claim = buf.claim()  # nobody else could borrow it: the owner's claim is granted
        assert claim is not None
        claim.release()
    config = oc.load_config(transfer_stall_timeout=1.0)
    async with open_cluster(config) as ctx:
        owner = await ctx.spawn(Owner)
        handle = await owner.share.call_one(1 << 18, 1.0)
        pid = await owner.pid.call_one()
        out = torch.empty(1 << 18)
        assert await handle.read_into(out, transport="tcp") == "tcp"
        stop(pid)
        try:
            with pytest.raises(oc.TransportError, match="made no progress"):
                await handle.read_into(out, transport="tcp")
        finally:
            os.kill(pid, signal.SIGCONT)
        assert await handle.read_into(out, transport="tcp") == "tcp"
