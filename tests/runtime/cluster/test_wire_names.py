"""Names that travel on the wire or sit in the head's store are pinned to public modules, so
moving the file that defines a class changes none of them; a head database written before the
layout moved still restores, and its actors can be made again from their records."""

from __future__ import annotations

import asyncio
import importlib
import shutil
from pathlib import Path

import orchestr as oc
import orchestr.roles as roles
from orchestr._actor._actor import class_path
from orchestr._call import _registry, _serde
from orchestr._call._mesh import Member, Mesh
from orchestr._cluster._head import HeadService
from orchestr._cluster._headstate import HeadState
from orchestr._cluster._headstore import HeadStore
from orchestr._cluster._node import NodeService
from orchestr._control._head_client import HeadClient
from orchestr._job._session import job_session

PUBLIC = {"orchestr", "orchestr.roles", "orchestr.fabric"}
#: Written by tests/runtime/cluster/data/make_head_before_layout.py on a daemon cluster, before any
#: module moved: a Reward and a Generator (given a BackendSpec) with restart policies.
BEFORE = Path(__file__).parent / "data" / "head-before-layout.sqlite"


def _resolve(path: str) -> object:
    module, _, qualname = path.partition(":")
    return getattr(importlib.import_module(module), qualname)


def test_every_registered_dataclass_and_role_travels_by_a_public_name() -> None:
    assert oc.Versioned is not None  # load the lazily imported runtime names too
    names = dict(_registry._dataclasses_by_type)
    assert {
        "orchestr:Versioned",
        "orchestr.roles:Request",
        "orchestr.roles:WeightsRef",
        "orchestr.roles:Handoff",
    } <= set(names.values())
    for cls, name in names.items():
        if not cls.__module__.startswith("orchestr"):
            continue  # a test's own
        assert name.partition(":")[0] in PUBLIC, name
        assert _resolve(name) is cls, name
    for actor in (roles.Generator, roles.Trainer, roles.Reward, roles.KVStore):
        assert class_path(actor) == f"orchestr.roles:{actor.__name__}"
        assert _resolve(class_path(actor)) is actor


def test_a_dataclass_under_its_old_private_name_still_decodes() -> None:
    spec = roles.BackendSpec(name="cpu")
    fields: dict[str, object] = {
        "name": "cpu",
        "dtype": None,
        "compiled": False,
        "compile_options": {},
    }
    assert _registry._dataclass_from_wire("orchestr.roles._backend:BackendSpec", fields) == spec
    # never a class of another package, and never an import
    assert _registry._by_old_name("elsewhere._backend:BackendSpec") is None


async def test_a_head_store_from_before_the_move_restores_and_remakes_its_actors(
    ctx: oc.JobContext, tmp_path: Path
) -> None:
    path = tmp_path / "head.sqlite"
    shutil.copyfile(BEFORE, path)
    path.chmod(0o600)
    store = HeadStore(path)
    try:
        nodes, actors, meshes, reservations = store.load()
    finally:
        store.close()
    state = HeadState()
    state.restore(nodes, actors, now=0.0, reservations=reservations)
    records = {a.name: a for a in state.actors.values()}
    assert set(records) == {"Reward", "Generator"}
    assert {m.class_path for m in meshes} == {
        "orchestr.roles.reward:Reward",
        "orchestr.roles.generator:Generator",
    }
    for name, record in records.items():
        assert record.max_restarts == 2
        assert _resolve(record.class_path) is getattr(roles, name)  # the old path still works
        args, kwargs = _serde.decode(record.init_args)
        if name == "Generator":
            assert kwargs["backend"] == roles.BackendSpec(name="cpu")
        # the head re-creates an actor from exactly these: its class path and arguments
        mesh = await ctx.spawn(record.class_path, *args, **kwargs)
        if name == "Reward":
            assert await mesh.score.call_one([[[1, 2], [2, 1]]]) == [1.0]
        else:
            assert (await mesh.stats.call_one())["running"] == 0


async def test_a_head_on_a_store_from_before_the_move_restarts_its_actors(tmp_path: Path) -> None:
    """The durable head itself: it loads the old database, finds the old node gone, and the
    owner's RestartActor re-creates each actor from its stored class path and arguments."""
    path = tmp_path / "head.sqlite"
    shutil.copyfile(BEFORE, path)
    path.chmod(0o600)
    config = oc.load_config(heartbeat_interval=0.1, heartbeat_timeout=0.5)
    async with HeadService("token", config, store=HeadStore(path)) as head:
        async with NodeService(head.address, "token", config, resources={"cpu": 2.0}) as node:
            async with job_session(head.address, "token", config) as ctx:
                client = HeadClient(ctx.head)
                for _ in range(100):  # the old node misses its heartbeats: its actors wait
                    old = [a for a in await client.actors() if a.name in ("Reward", "Generator")]
                    if len(old) == 2 and all(a.state == "restarting" for a in old):
                        break
                    await asyncio.sleep(0.1)
                assert sorted(a.state for a in old) == ["restarting", "restarting"]
                for info in old:
                    new = await client.restart_actor(info.actor_id, None)
                    assert (new.state, new.node_id, new.restarts) == ("alive", node.node_id, 1)
                    member = Member(new.actor_id, new.call_address, new.rank)
                    mesh = Mesh(new.mesh_id, new.name, new.class_path, [member], new.endpoints)
                    if new.name == "Reward":  # its scorer is named by its old private path
                        assert await mesh.score.call_one([[[1, 2], [2, 1]]]) == [1.0]
                    else:
                        assert (await mesh.stats.call_one())["running"] == 0
