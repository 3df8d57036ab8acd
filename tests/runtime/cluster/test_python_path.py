"""A job's import path travels with its spawns: a node started on its own (without the job's
environment) still imports the job's actor classes; a bad path is refused at the head."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import secrets
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

import orchestr as oc
from orchestr._call import _serde
from orchestr._cluster._hostinfo import merge_pythonpath
from orchestr._cluster._records import validate_python_path
from orchestr._job._paths import import_path, worker_pythonpath
from orchestr.protos import orchestr_pb2 as pb
from orchestr.protos import orchestr_pb2_grpc as pb_grpc
from tests.cluster import open_cluster

JOB_MODULE = """
import os

import orchestr as oc


class Echo(oc.Actor):
    def __init__(self, tag: str) -> None:
        self.tag = tag

    @oc.endpoint
    def hello(self, x: int) -> dict:
        return {"tag": self.tag, "x": x, "pid": os.getpid(), "file": __file__}
"""


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


@contextlib.asynccontextmanager
async def _far_node(
    ctx: oc.JobContext, cwd: Path, log: Any
) -> AsyncIterator[asyncio.subprocess.Process]:
    """``python -m orchestr._cluster._node`` as a separate daemon would run it: its own working folder
    and no PYTHONPATH, so nothing of the job's environment."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["ORCHESTR_TOKEN"] = ctx.token
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orchestr._cluster._node",
        "--head",
        ctx.head_address,
        "--labels",
        "host=far",
        env=env,
        cwd=cwd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=log,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with asyncio.timeout(30):
            while len(await ctx.nodes()) < 2:
                assert proc.returncode is None, "the node process exited before it registered"
                await asyncio.sleep(0.05)
        yield proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(20):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _wait_restarted(ctx: oc.JobContext, name: str) -> None:
    async with asyncio.timeout(20):
        while True:
            actors = [a for a in await ctx.actors() if a.name == name]
            if actors and all(a.state == "alive" and a.restarts >= 1 for a in actors):
                return
            await asyncio.sleep(0.05)


async def test_a_node_of_its_own_imports_the_jobs_classes_by_the_path_they_bring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = f"jobmod_{secrets.token_hex(4)}"
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / f"{module}.py").write_text(textwrap.dedent(JOB_MODULE))
    node_cwd = tmp_path / "node"
    node_cwd.mkdir()
    missing = str(tmp_path / "not-on-the-node")
    async with open_cluster(labels={"host": "near"}) as ctx:
        head = ctx.head.stub(pb_grpc.HeadStub)
        with (tmp_path / "node.log").open("wb") as log:
            async with _far_node(ctx, node_cwd, log) as node:
                # The job's folder joins its import path only now: no node's environment has it.
                monkeypatch.syspath_prepend(str(job_dir))
                monkeypatch.delitem(sys.modules, module, raising=False)
                job = importlib.import_module(module)
                monkeypatch.setitem(sys.modules, module, job)  # removed again after the test

                # Without the path, the far node cannot import the class...
                with pytest.raises(oc.SpawnError, match=module):
                    await ctx.head.rpc(
                        head.SpawnMesh,
                        pb.SpawnMeshRequest(
                            class_path=f"{module}:Echo", size=1, labels={"host": "far"}
                        ),
                        timeout=30,
                    )
                # ...and a folder it does not have is skipped (with a warning), not an error.
                info = await ctx.head.rpc(
                    head.SpawnMesh,
                    pb.SpawnMeshRequest(
                        class_path=f"{module}:Echo",
                        init_args=_serde.encode([["direct"], {}])[0],
                        size=1,
                        labels={"host": "far"},
                        python_path=[missing, str(job_dir)],
                    ),
                    timeout=30,
                )
                await ctx.head.rpc(head.StopMesh, pb.StopMeshRequest(mesh_id=info.mesh_id))

                # JobContext.spawn sends the driver's import path: the far node's worker finds
                # the class, and finds it again after a restart.
                mesh = await ctx.spawn(
                    job.Echo,
                    "t",
                    name="echo",
                    labels={"host": "far"},
                    restart=oc.RestartPolicy(max_restarts=1, backoff_s=0.01),
                )
                first = await mesh.hello.call_one(3)
                assert (first["tag"], first["x"]) == ("t", 3)
                assert Path(first["file"]) == job_dir / f"{module}.py"
                assert _ppid(first["pid"]) == node.pid  # it runs under the far node
                os.kill(first["pid"], signal.SIGKILL)
                await _wait_restarted(ctx, "echo")
                again = await mesh.hello.call_one(4)
                assert again["pid"] != first["pid"] and again["x"] == 4
                assert _ppid(again["pid"]) == node.pid
                await ctx.stop(mesh)
        text = (tmp_path / "node.log").read_text(errors="replace")
        assert "not on this node" in text and missing in text
        assert text.count("not on this node") == 1  # once per folder


async def test_the_head_refuses_a_bad_python_path(ctx: oc.JobContext) -> None:
    head = ctx.head.stub(pb_grpc.HeadStub)
    cases = [
        (["/ok", "/bad\x00path"], r"entry 1 '/bad\\x00path' contains a NUL byte"),
        ([""], r"entry 0 '' is empty"),
        (["/" + "x" * 5000], r"entry 0 '/x+'\.\.\. is longer than 4096 characters \(5001\)"),
        (["/ok"] * 65, r"65 entries; at most 64"),
    ]
    for python_path, message in cases:
        request = pb.SpawnMeshRequest(
            class_path="tests.runtime.actors:Counter", size=1, python_path=python_path
        )
        with pytest.raises(oc.ConfigError, match=message) as info:
            await ctx.head.rpc(head.SpawnMesh, request)
        cause = info.value.__cause__
        assert isinstance(cause, grpc.aio.AioRpcError)
        assert cause.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await ctx.actors() == []  # nothing was placed or started
    nodes = await ctx.nodes()
    assert nodes[0].free == nodes[0].total


def test_validate_python_path_accepts_a_good_one() -> None:
    entries = ["/a", "relative", "/" + "x" * 4095]
    assert validate_python_path(entries) == entries
    assert validate_python_path([]) == []
    assert validate_python_path(["/p"] * 64) == ["/p"] * 64


def test_merge_pythonpath_puts_the_jobs_folders_first_once(tmp_path: Path) -> None:
    a, b, c = (tmp_path / n for n in "abc")
    for folder in (a, b, c):
        folder.mkdir()
    gone = str(tmp_path / "gone")
    own = os.pathsep.join([str(c), str(a), "/node/own"])
    value, missing = merge_pythonpath([str(a), gone, str(b), str(a)], own)
    assert value.split(os.pathsep) == [str(a), str(b), str(c), "/node/own"]
    assert missing == [gone]
    assert merge_pythonpath([], "") == ("", [])
    assert merge_pythonpath([], own) == (own, [])


def test_the_driver_sends_its_import_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path / "absent"))
    path = import_path()
    assert path[0] == str(tmp_path)  # the absent folder is left out
    assert all(os.path.isabs(p) and os.path.isdir(p) for p in path)
    assert len(path) == len(set(path))
    assert worker_pythonpath() == os.pathsep.join(path)
    # the interpreter's own folders stay behind: the workers' interpreter has its own
    assert not [p for p in path if p.startswith((sys.prefix, sys.base_prefix))]
