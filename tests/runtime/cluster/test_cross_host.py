"""Two hosts on one kernel: a second node in a network namespace of its own, joined to this
one by a veth pair. Large values travel in call frames there, and buffers over tcp."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest
import torch

import orchestr as oc
from orchestr import fabric
from tests.cluster import check_leaks, resources
from tests.runtime.call.bulk_actors import Owner, Sink

MiB = 1 << 20


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _make_host(ns: str, here: str, there: str, ip_a: str, ip_b: str) -> None:
    """Namespace ``ns`` with address ``ip_b``, joined to this one (``ip_a``) by a veth pair."""
    _ip("netns", "add", ns)
    _ip("link", "add", here, "type", "veth", "peer", "name", there, "netns", ns)
    _ip("addr", "add", f"{ip_a}/30", "dev", here)
    _ip("link", "set", here, "up")
    _ip("-n", ns, "addr", "add", f"{ip_b}/30", "dev", there)
    _ip("-n", ns, "link", "set", there, "up")
    _ip("-n", ns, "link", "set", "lo", "up")


def _drop_host(ns: str) -> None:
    subprocess.run(["ip", "netns", "del", ns], check=False)  # takes the veth pair along


def import_path() -> str:
    return os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))


@pytest.fixture
async def two_hosts() -> AsyncIterator[oc.JobContext]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a second host needs root and iproute2 (ip netns) on this machine")
    tag = secrets.token_hex(3)
    ns, here, there = f"orch-b-{tag}", f"oca{tag}", f"ocb{tag}"
    octet = int(tag[:2], 16) % 200 + 20
    ip_a, ip_b = f"10.{octet}.77.1", f"10.{octet}.77.2"
    node: asyncio.subprocess.Process | None = None
    before = resources()
    try:
        _make_host(ns, here, there, ip_a, ip_b)
        config = oc.load_config(bind_host=ip_a)
        # the second node stops after the cluster (its workers with the job), so the leak
        # check comes after both
        async with oc.open_local_cluster(config, labels={"host": "a"}) as ctx:
            env = dict(
                os.environ,
                ORCHESTR_TOKEN=ctx.token,
                ORCHESTR_BIND_HOST=ip_b,
                PYTHONPATH=import_path(),
            )
            node = await asyncio.create_subprocess_exec(
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-m",
                "orchestr._cluster._node",
                "--head",
                ctx.head_address,
                "--labels",
                "host=b",
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
            )
            async with asyncio.timeout(30):
                while len(await ctx.nodes()) < 2:
                    assert node.returncode is None, "the second node exited"
                    await asyncio.sleep(0.1)
            yield ctx
    finally:
        if node is not None and node.returncode is None:
            node.send_signal(signal.SIGTERM)
            async with asyncio.timeout(20):
                await node.wait()
        _drop_host(ns)
    await check_leaks(before)


async def test_large_values_cross_hosts_in_the_frame(two_hosts: oc.JobContext) -> None:
    sink = await two_hosts.spawn(Sink, labels={"host": "b"})
    worker = await sink.pid.call_one()
    x = torch.arange(2 * MiB, dtype=torch.float32)
    mapping, total, _ = await sink.where.call_one(x)
    assert total == float(x.double().sum())
    assert mapping.startswith(f"/memfd:orchestr.{worker}.")  # its own receive memory
    [row] = [r for r in fabric.connections() if r["direction"] == "out"]
    assert row["same_host"] is False and row["bulk"] == "inline" and row["fallback"] is None
    back = await sink.echo.call_one(x)
    assert torch.equal(back, x)


async def test_buffers_cross_hosts_over_tcp_without_a_fallback(two_hosts: oc.JobContext) -> None:
    owner = await two_hosts.spawn(Owner, labels={"host": "b"})
    buf = await owner.share.call_one(MiB, 3.0)
    natural = "rdma" if "rdma" in buf.descriptors else "tcp"  # tcp where no RDMA device
    dst = torch.empty(MiB)
    assert await buf.read_into(dst, fallback="error") == natural  # not a fallback
    assert float(dst.sum()) == 3.0 * MiB
    with pytest.raises(oc.FallbackError, match="shm was wanted.*cannot reach"):
        await buf.read_into(dst, transport="shm", fallback="error")
