"""A node that dies with its workers: the head marks it dead once its heartbeats stop, tells
the owners of its actors, and their restart policies place replacements on a surviving node.
A node cut off for a while (its daemon stopped with SIGSTOP, its workers running on) comes
back: it registers again and the head has it stop the workers whose actors moved on."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orchestr as oc
from tests.cluster import open_cluster


class Where(oc.Actor):
    @oc.endpoint
    def pid(self) -> int:
        return os.getpid()


@asynccontextmanager
async def far_node(ctx: oc.JobContext, log_path: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """A second node daemon (all of the machine's CPUs, so placement prefers it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTR_")}
    env.update(
        ORCHESTR_TOKEN=ctx.token,
        ORCHESTR_HEARTBEAT_INTERVAL="0.2",
        PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
    )
    with log_path.open("wb") as log:
        far = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "orchestr._cluster._node",
            "--head",
            ctx.head_address,
            env=env,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        async with asyncio.timeout(30):
            while True:
                if len(await ctx.nodes()) == 2:
                    break
                await asyncio.sleep(0.05)
        yield far
    finally:
        if far.returncode is None:
            os.killpg(far.pid, signal.SIGCONT)
            os.killpg(far.pid, signal.SIGKILL)
            await far.wait()


async def _until_restarted(ctx: oc.JobContext, mesh: oc.Mesh) -> Any:
    async with asyncio.timeout(30):
        while True:
            (now,) = [a for a in await ctx.actors() if a.mesh_id == mesh.mesh_id]
            if now.state == "alive" and now.restarts == 1:
                return now
            await asyncio.sleep(0.05)


async def test_a_lost_nodes_actors_restart_on_a_surviving_node(tmp_path: Path) -> None:
    config = oc.load_config(heartbeat_interval=0.2, heartbeat_timeout=1.5)
    failures: list[oc.Failure] = []

    def hook(failure: oc.Failure) -> str:
        failures.append(failure)
        return "restart"

    # this node has one CPU; the far one all of the machine's: placement prefers it
    async with open_cluster(config, resources={"cpu": 1}) as ctx:
        async with far_node(ctx, tmp_path / "far.log") as far:
            near_id = next(n.node_id for n in await ctx.nodes() if n.total["cpu"] == 1)
            mesh = await ctx.spawn(
                Where,
                resources={"cpu": 0.5},
                restart=oc.RestartPolicy(max_restarts=1, backoff_s=0.1),
                supervise=hook,
            )
            (before,) = [a for a in await ctx.actors() if a.mesh_id == mesh.mesh_id]
            assert before.node_id != near_id  # it runs on the far node
            worker = await mesh.pid.call_one()
            # the far node and its worker die at once, without a word to the head
            os.killpg(far.pid, signal.SIGKILL)
            os.kill(worker, signal.SIGKILL)
            await far.wait()
            now = await _until_restarted(ctx, mesh)
            assert now.node_id == near_id  # replaced on the surviving node
            assert await mesh.pid.call_one() != worker
            lost = [n for n in await ctx.nodes() if n.node_id == before.node_id]
            assert [n.alive for n in lost] == [False]
            (failure,) = failures  # the owner was told, with the reason
            assert "was lost: no heartbeat" in str(failure.error)


async def test_a_node_cut_off_and_back_stops_the_workers_it_lost(tmp_path: Path) -> None:
    config = oc.load_config(heartbeat_interval=0.2, heartbeat_timeout=1.5)
    async with open_cluster(config, resources={"cpu": 1}) as ctx:
        async with far_node(ctx, tmp_path / "far.log") as far:
            mesh = await ctx.spawn(
                Where,
                resources={"cpu": 0.5},
                restart=oc.RestartPolicy(max_restarts=1, backoff_s=0.1),
            )
            (before,) = [a for a in await ctx.actors() if a.mesh_id == mesh.mesh_id]
            old_worker = await mesh.pid.call_one()
            os.kill(far.pid, signal.SIGSTOP)  # the node falls silent; its worker runs on
            now = await _until_restarted(ctx, mesh)
            assert now.node_id != before.node_id
            os.kill(far.pid, signal.SIGCONT)  # back: it registers again, listing old_worker
            async with asyncio.timeout(30):
                while True:
                    (node,) = [n for n in await ctx.nodes() if n.node_id == before.node_id]
                    if node.alive and not _running(old_worker):
                        break
                    await asyncio.sleep(0.05)
            assert node.free["cpu"] == node.total["cpu"]  # it holds nothing
            assert await mesh.pid.call_one() not in (old_worker, 0)  # the new one serves
            again = await ctx.spawn(Where, resources={"cpu": 2})  # only the far node fits
            (placed,) = [a for a in await ctx.actors() if a.mesh_id == again.mesh_id]
            assert placed.node_id == before.node_id


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False
