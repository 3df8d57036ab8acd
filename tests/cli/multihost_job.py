"""The job the multi-host tests run in the head's namespace: ``orchestr run --state-dir D
multihost_job.py SCENARIO``. Its actors are imported by workers on the other hosts as
``multihost_job:Peer`` (the job's folder travels with the spawn).

It says where it stands on stdout, one line each, for the test to follow: ``READY {json}`` when
the partition may begin, ``NODE id`` whenever the member called answers from another node than
before, ``RESULT {json}`` at the end.

Scenarios:

- ``mesh``: a mesh of two placed STRICT_SPREAD; where each member runs; calls from here to both,
  between the members, and a 32 MiB buffer read by the member on n2 from the one on n1 (tcp).
- ``partition-restart`` / ``partition-fail``: calls in a loop to the member on n2; the test takes
  n2's link down meanwhile. With ``restart`` the mesh restarts its members with at-least-once
  calls, so the loop should go on with the member restarted on n1, and so should a call from the
  member on n1 to the one on n2 that was waiting for an answer (``RELAY`` says who answered it);
  the loop then goes on until the file ``$MULTIHOST_LINK_UP`` appears (the test has set the link
  up again). With ``fail`` nothing is restarted, so the job should fail saying which node was
  lost.
- ``small``: a mesh of two, STRICT_SPREAD, pinged once: is the cluster usable.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import orchestr as oc

MiB = 1 << 20
#: Calls the restarted member answers, n2 still cut off, before the job goes on.
CALLS_AFTER_RECOVERY = 20
#: The partition loop gives up after this long; the test's hard timeout is longer still.
LOOP_LIMIT_S = 100.0


def say(*words: Any) -> None:
    print(*words, flush=True)  # the test reads these lines as they come


class Peer(oc.Actor):
    def __init__(self) -> None:
        self.kept: list[oc.Buffer] = []
        self.naps = 0

    @oc.endpoint
    def where(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "node": os.environ.get("ORCHESTR_NODE_ID"),
            "host": os.environ.get("ORCHESTR_BIND_HOST"),
            "pid": os.getpid(),
            "netns": os.stat("/proc/self/ns/net").st_ino,
        }

    @oc.endpoint
    def ping(self, x: int) -> list[Any]:
        return [x + 1, os.environ.get("ORCHESTR_NODE_ID")]

    @oc.endpoint
    async def relay(self, peer: oc.Mesh, x: int) -> list[Any]:
        """A call from this member to ``peer`` (another member), answered with both nodes."""
        answer, there = await peer.ping.call_one(x)
        return [answer, there, os.environ.get("ORCHESTR_NODE_ID")]

    @oc.endpoint(concurrent=True)
    async def nap_unless_moved(self, node: str) -> str | None:
        """Never answers on ``node``; anywhere else (a restarted member) answers at once."""
        here = os.environ.get("ORCHESTR_NODE_ID")
        if here == node:
            self.naps += 1
            await asyncio.Event().wait()
        return here

    @oc.endpoint
    def napping(self) -> int:
        return self.naps

    @oc.endpoint
    async def relay_nap(self, peer: oc.Mesh, node: str) -> str | None:
        """Waits in a call from this member to ``peer`` that only a restart of it can answer."""
        answer: str | None = await peer.nap_unless_moved.call_one(node)
        return answer

    @oc.endpoint
    def share(self, nbytes: int) -> list[Any]:
        """A buffer of ``nbytes`` random bytes, registered for one-sided reads, and its sha256."""
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        buf = oc.Buffer(data)
        self.kept.append(buf)
        return [buf, hashlib.sha256(data.numpy()).hexdigest()]

    @oc.endpoint
    async def pull(self, buf: oc.Buffer) -> list[Any]:
        """Read ``buf`` from its owner (no fallback allowed); the transport and the sha256."""
        dst = torch.empty(buf.nbytes, dtype=torch.uint8)
        used = await buf.read_into(dst, fallback="error")
        return [used, hashlib.sha256(dst.numpy()).hexdigest(), dst.numel()]


async def placed(ctx: oc.JobContext, mesh: oc.Mesh) -> dict[int, dict[str, Any]]:
    """Where each member runs, as it says and as the head says."""
    said = {w["rank"]: w for w in await mesh.where.call()}
    for a in await ctx.actors():
        if a.name == mesh.name and a.state == "alive":
            said[a.rank] |= {"head_node": a.node_id, "call_address": a.call_address}
    return said


async def mesh_scenario(ctx: oc.JobContext) -> dict[str, Any]:
    mesh = await ctx.spawn(Peer, n=2, strategy="STRICT_SPREAD")
    where = await placed(ctx, mesh)
    pings = await mesh.ping.call(41)
    relays = [await mesh[0].relay.call_one(mesh[1], 1), await mesh[1].relay.call_one(mesh[0], 2)]
    by_host = {w["host"]: rank for rank, w in where.items()}
    owner, reader = by_host[os.environ["MULTIHOST_N1"]], by_host[os.environ["MULTIHOST_N2"]]
    buf, digest = await mesh[owner].share.call_one(32 * MiB)
    used, got, n = await mesh[reader].pull.call_one(buf)
    return {
        "where": where,
        "pings": pings,
        "relays": relays,
        "transfer": {"used": used, "sent": digest, "received": got, "bytes": n},
    }


async def partition_scenario(ctx: oc.JobContext, restart: bool) -> dict[str, Any]:
    policy = oc.RestartPolicy(max_restarts=1, backoff_s=0.1, retry="at_least_once")
    mesh = await ctx.spawn(Peer, n=2, strategy="STRICT_SPREAD", restart=policy if restart else None)
    where = await placed(ctx, mesh)
    target = next(r for r, w in where.items() if w["host"] == os.environ["MULTIHOST_N2"])
    first_node = where[target]["node"]
    ready = {"rank": target, "node": first_node, "pid": where[target]["pid"]}
    if not restart:  # the member's death fails the job: it cancels this loop
        say("READY", json.dumps(ready))
        return await call_loop(mesh[target], lambda node, after: False)
    # A call between the members, in flight through the partition: only the callee's death
    # seen by the caller's worker (no supervisor there) ends it, and retry sends it again.
    relay = asyncio.ensure_future(mesh[1 - target].relay_nap.call_one(mesh[target], first_node))
    try:
        async with asyncio.timeout(30):
            while not await mesh[target].napping.call_one():  # noqa: ASYNC110 (another process)
                await asyncio.sleep(0.05)
        say("READY", json.dumps(ready))
        # until the member answers from another node, then for a while (n2 still cut off)
        moved = await call_loop(mesh[target], lambda node, after: after >= CALLS_AFTER_RECOVERY)
        say("RELAY", await relay)
    finally:
        relay.cancel()
    # on through the link coming back up, until the test says it is (a file appears)
    flag = os.environ["MULTIHOST_LINK_UP"]
    rejoined = await call_loop(mesh[target], lambda node, after: os.path.exists(flag))
    return {"moved": moved, "rejoined": rejoined, "where_after": await placed(ctx, mesh)}


async def call_loop(member: oc.Mesh, done: Callable[[str, int], bool]) -> dict[str, Any]:
    """Call ``member`` until ``done(node it answered from, calls answered from a node other
    than the first)``; gives up after LOOP_LIMIT_S."""
    nodes: list[str] = []
    slowest, after, i = 0.0, 0, 0
    started = time.monotonic()
    while True:
        if time.monotonic() - started > LOOP_LIMIT_S:
            raise RuntimeError(f"the loop did not end in {LOOP_LIMIT_S:g} s: {nodes}")
        t0 = time.monotonic()
        answer, node = await member.ping.call_one(i)
        slowest = max(slowest, time.monotonic() - t0)
        assert answer == i + 1, (answer, i)
        if not nodes or nodes[-1] != node:
            nodes.append(node)
            say("NODE", node)
        after += node != nodes[0]
        i += 1
        if done(node, after):
            return {"calls": i, "nodes": nodes, "slowest_call_s": slowest}
        await asyncio.sleep(0.02)  # a steady trickle of calls, not a busy loop on 2 cores


async def small_scenario(ctx: oc.JobContext) -> dict[str, Any]:
    mesh = await ctx.spawn(Peer, n=2, strategy="STRICT_SPREAD")
    return {"pings": await mesh.ping.call(1), "where": await placed(ctx, mesh)}


async def main(ctx: oc.JobContext) -> None:
    scenario = sys.argv[1]
    if scenario == "mesh":
        result = await mesh_scenario(ctx)
    elif scenario.startswith("partition-"):
        result = await partition_scenario(ctx, restart=scenario == "partition-restart")
    elif scenario == "small":
        result = await small_scenario(ctx)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    say("RESULT", json.dumps(result))
