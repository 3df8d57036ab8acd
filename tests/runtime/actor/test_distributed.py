"""A mesh made a torch.distributed process group by the runtime (gloo on this machine)."""

from __future__ import annotations

import pytest

import orchestr as oc
from tests.runtime.supervised import Ranked


async def test_members_join_one_process_group_and_all_reduce(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Ranked, n=3, resources={"cpu": 0.5})
    joined = await ctx.init_distributed(mesh)
    assert joined == [{"rank": r, "world_size": 3, "backend": "gloo"} for r in range(3)]
    assert await mesh.all_reduce.call(2.0) == [[6.0, 3.0]] * 3  # sum of values and of ranks
    with pytest.raises(oc.ActorError, match="already initialised"):
        await ctx.init_distributed(mesh)


async def test_bad_requests_are_refused(ctx: oc.JobContext) -> None:
    packed = await ctx.spawn(Ranked, n=2, per_process=2, resources={"cpu": 0.5})
    with pytest.raises(oc.ConfigError, match="share worker processes"):
        await ctx.init_distributed(packed)
    with pytest.raises(oc.ConfigError, match="backend must be one of gloo, nccl"):
        await ctx.init_distributed(packed, backend="mpi")
    # the internal endpoints every actor answers are not listed to users
    with pytest.raises(oc.ActorError, match="no endpoint 'missing'; endpoints: all_reduce$"):
        await _call_missing(packed)


async def _call_missing(mesh: oc.Mesh) -> None:
    from orchestr._call._client import current_client

    m = mesh.members[0]
    await current_client().call(m.address, m.actor_id, mesh.label(m), "missing", (), {})
