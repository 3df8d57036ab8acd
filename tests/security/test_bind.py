"""Rule: loopback binding unless told otherwise. Every socket a worker listens on (its call
server, its gRPC service, the torch.distributed rendezvous store of its group, gloo's) is
bound where the cluster binds: torch's own store would listen on every interface."""

from __future__ import annotations

import asyncio
import re

import orchestr as oc

from .actors import Member

LOOPBACK = {"127.0.0.1", "[::ffff:127.0.0.1]", "[::1]"}


async def _listening(pid: int) -> list[str]:
    proc = await asyncio.create_subprocess_exec("ss", "-ltnpH", stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    local = []
    for line in out.decode().splitlines():
        if re.search(rf"\bpid={pid},", line):
            local.append(line.split()[3])
    return local


async def test_every_socket_a_worker_listens_on_is_bound_where_the_cluster_binds(
    ctx: oc.JobContext,
) -> None:
    mesh = await ctx.spawn(Member, n=2, resources={"cpu": 0.5})
    await ctx.init_distributed(mesh)
    assert await mesh.all_reduce.call(1.5) == [3.0, 3.0]
    for pid in await mesh.pid.call():
        sockets = await _listening(pid)
        assert len(sockets) >= 2, sockets  # the call server and the gRPC service at least
        hosts = {s.rpartition(":")[0] for s in sockets}
        assert hosts <= LOOPBACK, sockets
