"""A head whose database stops taking writes (a full disk) says why, keeps watching its nodes,
and writes what it could not save once the database takes writes again. The disk is a real
one: a small tmpfs (the tests run as root), filled up with a file and emptied again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

import orchestr as oc
from orchestr._cluster._head import HeadService
from orchestr._cluster._headstore import HeadStore, StoreWriteError
from orchestr._cluster._node import NodeService


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(disk: Path) -> None:
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 16, 512):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, bytes(chunk))
    finally:
        os.close(fd)


def _free(disk: Path) -> None:
    (disk / "filler").unlink()


def test_a_full_disk_is_named_not_a_failed_rollback(disk: Path) -> None:
    store = HeadStore(disk / "head.sqlite")
    _fill(disk)
    with pytest.raises(StoreWriteError, match="disk is full") as caught:
        store.save_job("j1", {"x": "y" * 100_000}, b"z" * 1_000_000)
    assert "rollback" not in str(caught.value).lower()
    assert isinstance(caught.value.__cause__, sqlite3.Error)
    _free(disk)
    store.save_job("j1", {"x": "y"})  # the connection is usable again
    assert store.load_jobs() == [{"x": "y"}]


async def test_the_head_keeps_watching_and_saves_once_it_can(disk: Path) -> None:
    config = oc.load_config(heartbeat_interval=0.1, heartbeat_timeout=0.5)
    store = HeadStore(disk / "head.sqlite")
    with structlog.testing.capture_logs() as logs:
        async with HeadService("token", config, store=store) as head:
            node = NodeService(head.address, "token", config, resources={"cpu": 1.0})
            async with node:
                node_id = node.node_id
                await asyncio.sleep(0.3)
                await asyncio.to_thread(_fill, disk)
            # the node is gone: the monitor marks it dead although nothing can be saved
            for _ in range(100):
                if not head.state.nodes[node_id].alive:
                    break
                await asyncio.sleep(0.1)
            assert not head.state.nodes[node_id].alive
            await asyncio.sleep(0.3)
            assert head.store_failing_since is not None
            failures = [e for e in logs if e["event"] == "the head cannot save its state; retrying"]
            assert failures and "disk is full" in failures[0]["error"]
            await asyncio.to_thread(_free, disk)
            for _ in range(100):
                if head.store_failing_since is None:
                    break
                await asyncio.sleep(0.1)
            assert head.store_failing_since is None
    nodes, _, _, _ = HeadStore(disk / "head.sqlite").load()
    assert [n.alive for n in nodes if n.node_id == node_id] == [False]
