"""A long-lived head forgets actors that ended long ago, in memory and in its store, so many
short meshes do not grow it without bound; the newest ended ones stay for lookups."""

from __future__ import annotations

from pathlib import Path

import pytest

import orchestr as oc
from orchestr._cluster import _headstate
from orchestr._cluster._head import HeadService
from orchestr._cluster._headstore import HeadStore
from orchestr._cluster._node import NodeService
from orchestr._job._session import job_session
from tests.runtime.actors import Counter


async def test_many_short_meshes_leave_a_bounded_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_headstate, "ENDED_KEPT", 3)
    config = oc.load_config()
    store = HeadStore(tmp_path / "head.sqlite")
    async with HeadService("token", config, store=store) as head:
        async with NodeService(head.address, "token", config, resources={"cpu": 2.0}):
            async with job_session(head.address, "token", config) as ctx:
                meshes = []
                for _ in range(6):
                    mesh = await ctx.spawn(Counter, n=1)
                    await ctx.stop(mesh)
                    meshes.append(mesh)
                live = await ctx.spawn(Counter, n=1)
                assert len(await ctx.actors()) == 4  # the 3 newest ended, and the live one
                assert {m.mesh_id for m in meshes[-3:]} | {live.mesh_id} == set(head.meshes)
                assert await live.add.call_one(1) == 1
    # the live one stopped at the job's end: the 3 newest ended are what the store keeps
    _, actors, saved_meshes, _ = HeadStore(tmp_path / "head.sqlite").load()
    assert {a.mesh_id for a in actors} == {m.mesh_id for m in [*meshes[-2:], live]}
    assert {m.mesh_id for m in saved_meshes} == set(head.meshes)
