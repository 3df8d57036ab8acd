"""``ctx.serve_actor``: a role hosted by a program that is not an orchestr worker (here a plain
asyncio script hosting a ``KVStore``, as a cache service would), found by name and used by a
job's actors, stopped cleanly with the program, and recorded dead at once when the program is
killed; ``ctx.lookup`` and its errors."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import secrets
import signal
import socket
import sys
import textwrap

import pytest

import orchestr as oc
from orchestr._cluster._head import HeadService
from orchestr._cluster._headstate import HeadState
from orchestr._cluster._headstore import HeadStore
from orchestr._control._grpc import ControlChannel
from orchestr._control._head_client import HeadClient
from orchestr._job._hosting import Hosting
from orchestr.roles import Generator, KVNamespace, kv_block_bytes, models
from tests.roles.kvstore_actors import Reader, Writer
from tests.runtime.actors import Counter

ROOT = pathlib.Path(__file__).resolve().parents[3]
NS = KVNamespace("tiny-llama", block_size=16, weight_version=1)

PROGRAM = """
import asyncio, sys
import orchestr as oc
from orchestr.roles import KVStore

async def main():
    store = KVStore(int(sys.argv[1]), 64)  # built by the program, as any object of its own
    async with oc.connect() as job:  # $ORCHESTR_ADDRESS and $ORCHESTR_TOKEN
        await job.serve_actor(store, name="cache")
        print("serving", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, input)  # until told to stop
    await store.aclose()
    print("closed", flush=True)

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return pathlib.Path(models.make_tiny("llama", tmp_path_factory.mktemp("m") / "llama"))


async def _start(
    ctx: oc.JobContext, script: pathlib.Path, block_bytes: int
) -> asyncio.subprocess.Process:
    env = dict(
        os.environ,
        ORCHESTR_ADDRESS=ctx.head_address,
        ORCHESTR_TOKEN=ctx.token,
        PYTHONPATH=str(ROOT),
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        str(block_bytes),
        env=env,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    lines: list[bytes] = []  # its own log lines come first
    while not lines or lines[-1] != b"serving\n":
        lines.append(await asyncio.wait_for(proc.stdout.readline(), 60))
        assert lines[-1], b"".join(lines)
    return proc


async def _states(ctx: oc.JobContext, name: str) -> list[str]:
    return [a.state for a in await ctx.actors() if a.name == name]


@pytest.mark.timeout(180)
async def test_a_program_hosts_a_kv_store_that_a_jobs_generators_use(
    ctx: oc.JobContext, tmp_path: pathlib.Path, folder: pathlib.Path
) -> None:
    script = tmp_path / "cache_service.py"
    script.write_text(textwrap.dedent(PROGRAM))
    size = kv_block_bytes(str(folder), 16)
    proc = await _start(ctx, script, size)
    try:
        store = await ctx.lookup("cache")
        (info,) = [a for a in await ctx.actors() if a.name == "cache"]
        assert (info.state, info.node_id, info.pid) == ("alive", "", proc.pid)
        assert info.class_path == "orchestr.roles:KVStore" and "begin_put" in info.endpoints
        # the job's generators share it: the second computes only what the first did not
        # (the other actors of the job, used below, start beside them)
        gens, writer, reader = await asyncio.gather(
            ctx.spawn(Generator, n=2, checkpoint=str(folder), torch_threads=1, kv_store=store),
            ctx.spawn(Writer, size),
            ctx.spawn(Reader, size),
        )
        ask = {"prompt": [5 + i % 300 for i in range(100)], "max_new_tokens": 4, "temperature": 0.0}
        (first,) = await gens[0].generate.call_one([{"id": "a", **ask}])
        for _ in range(1200):  # offloaded after the step, by a task of the generator's
            if (await store.stats.call_one())["blocks"] >= 6:
                break
            await asyncio.sleep(0.05)
        (second,) = await gens[1].generate.call_one([{"id": "b", **ask}])
        assert second.tokens == first.tokens
        assert (await gens[1].stats.call_one())["tokens"] == (100 - 6 * 16) + 3
        # and other actors of the job: one writes blocks into the store's memory in the
        # other program, one reads them back, byte for byte
        chain = [f"block-{i}".encode() for i in range(3)]
        assert await writer.put.call_one(store, NS, chain, [7, 8, 9]) == 3
        assert await reader.get.call_one(store, NS, [*chain, b"missing"]) == [7, 8, 9]
        assert (await store.match.call_one(NS, chain))["tokens"] == 48
        # the program stops: its store is recorded stopped, and a call says so
        assert proc.stdin is not None
        proc.stdin.write(b"\n")
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0 and out.endswith(b"closed\n"), err
        assert await _states(ctx, "cache") == ["stopped"]
        with pytest.raises(oc.ActorDiedError, match=r"cache\[0\] was stopped"):
            await store.stats.call_one()
        with pytest.raises(oc.MeshError, match="no live mesh is named 'cache'"):
            await ctx.lookup("cache")

        # hosted again, then killed: recorded dead at once, callers fail instead of waiting
        proc = await _start(ctx, script, size)
        store = await ctx.lookup("cache")
        assert await writer.put.call_one(store, NS, chain[:1], [5]) == 1
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        for _ in range(1200):
            if "dead" in await _states(ctx, "cache"):
                break
            await asyncio.sleep(0.05)
        (dead,) = [a for a in await ctx.actors() if a.mesh_id == store.mesh_id]
        assert dead.state == "dead" and "went away without stopping it" in dead.last_output
        with pytest.raises(oc.ActorError, match="cache"):
            await reader.get.call_one(store, NS, chain[:1])
        with pytest.raises(oc.ActorDiedError, match=r"cache\[0\] died"):
            await store.stats.call_one()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_this_program_hosts_an_actor_and_looks_meshes_up(ctx: oc.JobContext) -> None:
    counter = Counter()
    mesh = await ctx.serve_actor(counter, name="counter-here")
    assert (mesh.name, len(mesh), counter.actor_id) == ("counter-here", 1, mesh.members[0].actor_id)
    assert await mesh.add.call_one(3) == 3
    # an actor of this job calls it by its handle, found by name
    found = await ctx.lookup("counter-here")
    assert found == mesh
    spawned = await ctx.spawn(Counter, n=2, name="counters")
    assert len(await ctx.lookup("counters")) == 2
    assert await spawned.add.call(1) == [1, 1]
    with pytest.raises(oc.ConfigError, match="hosted already"):
        await ctx.serve_actor(counter, name="again")
    with pytest.raises(oc.ConfigError, match="an Actor instance"):
        await ctx.serve_actor(object(), name="x")
    with pytest.raises(oc.ConfigError, match="1 to 128 printable"):
        await ctx.serve_actor(Counter(), name="")
    await ctx.spawn(Counter, name="counters")
    with pytest.raises(oc.MeshError, match="2 live meshes are named 'counters'"):
        await ctx.lookup("counters")
    await ctx.stop(mesh)
    await ctx.stop(mesh)  # idempotent
    assert await _states(ctx, "counter-here") == ["stopped"]


@pytest.mark.timeout(60)
async def test_a_hosted_actor_is_registered_again_after_a_head_restart(
    tmp_path: pathlib.Path,
) -> None:

    config = dataclasses.replace(oc.load_config(), heartbeat_interval=0.1, heartbeat_timeout=1.0)
    token = secrets.token_urlsafe(16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "head.sqlite"
    channel = ControlChannel(f"127.0.0.1:{port}", token, config)
    hosting = Hosting(HeadClient(channel), token, config)
    try:
        async with HeadService(token, config, port=port, store=HeadStore(path)) as head:
            mesh = await hosting.serve(Counter(), "kept")
            (actor_id,) = [m.actor_id for m in mesh.members]
            assert head.state.actors[actor_id].state == "alive"
        # the head is gone; a new one on its store registers the actor again once its
        # program reconnects, with the same ids: handles taken before still work
        async with HeadService(token, config, port=port, store=HeadStore(path)) as head:
            for _ in range(600):
                if actor_id in head._host_streams:
                    break
                await asyncio.sleep(0.05)
            record = head.state.actors[actor_id]
            assert (record.state, record.mesh_id) == ("alive", mesh.mesh_id)
            await asyncio.sleep(1.5)  # past the timeout in which orphans are declared dead
            assert head.state.actors[actor_id].state == "alive"
            await hosting.aclose()
            assert head.state.actors[actor_id].state == "stopped"
    finally:
        await hosting.aclose()
        await channel.aclose()


async def test_an_actor_whose_program_never_comes_back_is_dead_after_the_timeout(
    tmp_path: pathlib.Path,
) -> None:

    config = dataclasses.replace(oc.load_config(), heartbeat_interval=0.1, heartbeat_timeout=0.5)
    state = HeadState()
    state.host(
        "m-1",
        "a-000000000001",
        "gone",
        "tests.runtime.actors:Counter",
        "tcp://127.0.0.1:9",
        ["add"],
        1,
    )
    path = tmp_path / "head.sqlite"
    HeadStore(path).save(actors=list(state.actors.values()))
    async with HeadService(secrets.token_urlsafe(16), config, store=HeadStore(path)) as head:
        assert head.state.actors["a-000000000001"].state == "alive"
        for _ in range(600):
            if head.state.actors["a-000000000001"].state == "dead":
                break
            await asyncio.sleep(0.05)
        record = head.state.actors["a-000000000001"]
        assert record.state == "dead" and "did not register within" in record.last_output
