"""``python -m orchestr._cluster._node``: a node process of its own joins a running cluster."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

import orchestr as oc
from orchestr._cluster._hostinfo import parse_labels
from tests.cluster import open_cluster
from tests.runtime.actors import Counter


def import_path() -> str:
    return os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


async def _wait_for_nodes(
    ctx: oc.JobContext, count: int, proc: asyncio.subprocess.Process
) -> list[Any]:
    async with asyncio.timeout(30):
        while True:
            nodes = await ctx.nodes()
            if len(nodes) >= count:
                return nodes
            assert proc.returncode is None, "the node process exited before it registered"
            await asyncio.sleep(0.1)


async def test_node_main_joins_takes_a_mesh_and_stops_on_sigterm(tmp_path: Path) -> None:
    async with open_cluster(labels={"host": "a"}) as ctx:
        env = dict(os.environ)
        env["ORCHESTR_TOKEN"] = ctx.token
        env["PYTHONPATH"] = import_path()
        log = (tmp_path / "node.log").open("wb")
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "orchestr._cluster._node",
            "--head",
            ctx.head_address,
            "--labels",
            "host=b,role=extra",
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            nodes = await _wait_for_nodes(ctx, 2, proc)
            assert len(nodes) == 2
            assert sorted(n.labels["host"] for n in nodes) == ["a", "b"]
            joined = next(n for n in nodes if n.labels["host"] == "b")
            assert joined.labels["role"] == "extra" and joined.alive

            # the node is stopped below, and its actor with it: an expected death
            mesh = await ctx.spawn(Counter, 5, labels={"host": "b"}, supervise="handle")
            assert await mesh.add.call_one(2) == 7
            worker_pid = (await mesh.whoami.call_one())["pid"]
            assert _ppid(worker_pid) == proc.pid  # the worker runs under the joined node

            here = await ctx.spawn(Counter, labels={"host": "a"})
            assert _ppid((await here.whoami.call_one())["pid"]) == os.getpid()

            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(20):
                assert await proc.wait() == 0
            assert not _alive(worker_pid)  # it stopped its worker
            assert b"serving at" in (tmp_path / "node.log").read_bytes()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            log.close()


async def test_node_main_without_a_reachable_head_fails_cleanly() -> None:
    env = dict(os.environ, ORCHESTR_TOKEN="t", ORCHESTR_BIND_HOST="127.0.0.1")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orchestr._cluster._node",
        "--head",
        "127.0.0.1:1",
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(45):
        out, _ = await proc.communicate()
    assert proc.returncode == 1
    assert b"orchestr node:" in out


def test_parse_labels() -> None:
    assert parse_labels("") == {}
    assert parse_labels("host=b, zone = x ,") == {"host": "b", "zone": "x"}
    with pytest.raises(oc.ConfigError, match="key=value"):
        parse_labels("host")
