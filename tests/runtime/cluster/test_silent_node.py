"""A node that goes silent with its workers (SIGSTOP: their sockets stay open and the kernel still
acknowledges what is sent, but nothing answers and no reset comes, as behind a dead link). A call
in flight to one of its actors is settled when the head gives the node up: sent again to the
restarted actor under at-least-once, failed with ActorDiedError naming the lost node under
at-most-once; it is not left waiting for its deadline. (The namespaces version, with a link
set down: tests/cli/test_multihost.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

import orchestr as oc
from tests.cluster import open_cluster


class Where(oc.Actor):
    @oc.endpoint
    def pid(self) -> int:
        return os.getpid()


#: Well under the calls' own deadline (CALL_TIMEOUT_S): a call still waiting then was left behind.
SETTLE_LIMIT_S = 25
CALL_TIMEOUT_S = 600


async def test_calls_to_a_silent_nodes_actors_end_when_the_head_gives_it_up(
    tmp_path: Path,
) -> None:
    config = oc.load_config(
        heartbeat_interval=0.2, heartbeat_timeout=1.5, call_timeout=CALL_TIMEOUT_S
    )
    # this node has one CPU; the far one, below, all of the machine's: placement prefers it
    async with open_cluster(config, resources={"cpu": 1}) as ctx:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTR_")}
        env.update(
            ORCHESTR_TOKEN=ctx.token,
            ORCHESTR_HEARTBEAT_INTERVAL="0.2",
            PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
        )
        with (tmp_path / "far.log").open("wb") as log:
            far = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "orchestr._cluster._node",
                "--head",
                ctx.head_address,
                env=env,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # its workers share its process group
            )
            try:
                async with asyncio.timeout(30):
                    while True:
                        if len(await ctx.nodes()) == 2:
                            break
                        await asyncio.sleep(0.05)
                near = next(n.node_id for n in await ctx.nodes() if n.total["cpu"] == 1)
                again = await ctx.spawn(
                    Where,
                    resources={"cpu": 0.5},
                    restart=oc.RestartPolicy(max_restarts=1, backoff_s=0.1, retry="at_least_once"),
                )
                once = await ctx.spawn(Where, resources={"cpu": 0.5}, supervise="handle")
                far_id = {a.node_id for a in await ctx.actors()} - {near}
                assert len(far_id) == 1  # both run on the far node
                old = await again.pid.call_one()
                await once.pid.call_one()  # connected, so the next call goes out at once

                os.killpg(far.pid, signal.SIGSTOP)  # the node and its workers fall silent
                moved = asyncio.ensure_future(again.pid.call_one())
                lost = asyncio.ensure_future(once.pid.call_one())
                async with asyncio.timeout(SETTLE_LIMIT_S):
                    new = await moved
                    with pytest.raises(oc.ActorDiedError) as died:
                        await lost
                assert new != old  # answered by the restarted actor, on the near node
                assert [a.node_id for a in await ctx.actors() if a.mesh_id == again.mesh_id] == [
                    near
                ]
                assert f"node {far_id.pop()} was lost" in str(died.value)
            finally:
                if far.returncode is None:
                    os.killpg(far.pid, signal.SIGKILL)
                    await far.wait()


async def test_an_address_reported_gone_is_used_again_when_the_head_vouches_for_it() -> None:
    # (a new worker may be given the port of one that died)
    async with open_cluster() as ctx:
        mesh = await ctx.spawn(Where)
        pid = await mesh.pid.call_one()
        ctx.client.worker_gone(mesh.members[0].address, "a test says so")
        # refused here without leaving; the head says it is alive there: sent after all
        assert await mesh.pid.call_one() == pid
        assert await mesh.pid.call_one() == pid
