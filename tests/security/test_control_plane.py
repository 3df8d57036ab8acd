"""Rule: a control-plane request without the cluster token is refused before its body is read,
and nothing a server that does not know the token captures (a process holding a dead head's
port) works against the real head, as a token or replayed."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import sys

import pytest

from tests.cluster import open_cluster

from ..cli.test_cluster import cli, start_cluster, state_dir  # noqa: F401 (a fixture)
from ..procinfo import rss_mib
from . import http2
from .conftest import Attacker

UNSIGNED_FLOOD = """
import asyncio, os, sys, grpc
async def main():
    channel = grpc.aio.insecure_channel(sys.argv[1], options=[
        ("grpc.max_send_message_length", 64 << 20)])
    call = channel.unary_unary("/orchestr.v1.Head/SubmitJob")
    body = os.urandom(40 << 20)
    async def one(metadata):
        try:
            await call(body, metadata=metadata, timeout=30)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    forged = (("orchestr-signature", "v1.x.1.a.b.c"),)
    old = (("authorization", "Bearer " + "t" * 43),)
    host = channel.unary_stream("/orchestr.v1.Head/HostActor")
    # an unsigned registration of an actor "x" (a:B) at an address of its choosing
    registration = bytes.fromhex("0a01781203613a42" "1a0f7463703a2f2f312e322e332e343a34")
    async def hosted():
        try:
            async for _ in host(registration, timeout=30):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    # an unsigned event log for the dashboard, as an attached controller would send it
    events = channel.unary_unary("/orchestr.v1.Head/JobEvents")
    async def attached():
        try:
            await events(bytes.fromhex("0a0c6a6f622d3031323361626364"), timeout=30)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    print(await asyncio.gather(one(()), one(forged), one(old), hosted(), attached()))
asyncio.run(main())
"""


async def test_an_unsigned_request_is_refused_before_its_body_is_read() -> None:
    async with open_cluster() as ctx:  # the head runs in this process
        before = rss_mib()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            UNSIGNED_FLOOD,
            ctx.head.address,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
        assert out.decode().strip() == str(["UNAUTHENTICATED"] * 5)
        grown = rss_mib() - before
        assert grown < 40, f"the head took in {grown:.0f} MiB for three refused requests"
        assert len(await ctx.nodes()) == 1
        assert all(a.node_id for a in await ctx.actors())  # no actor registered by it


def _head(state: pathlib.Path) -> dict[str, object]:
    return json.loads((state / "head.json").read_text())


@pytest.mark.timeout(120)
async def test_what_a_fake_head_captures_opens_nothing(
    attacker: Attacker,
    state_dir: pathlib.Path,  # noqa: F811
) -> None:
    address = await asyncio.to_thread(start_cluster, state_dir)
    port = int(address.rpartition(":")[2])
    token = (state_dir / "token").read_text().strip()
    os.kill(int(_head(state_dir)["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
    # another user takes the port and listens to the node's heartbeats for a while
    greeting = (http2.SERVER_GREETING + http2.SETTINGS_ACK).hex()
    fake = await attacker.serving(port, 4.0, greet=greeting)
    captured = [bytes.fromhex(c) for c in (await fake)["connections"]]
    requests = [h for c in captured for h in http2.header_blocks(c)]
    paths = [dict(h).get(":path") for h in requests]
    assert "/orchestr.v1.Head/Heartbeat" in paths, paths
    for headers in requests:
        for name, value in headers:
            assert token not in value and "Bearer" not in value, (name, value)
        assert "orchestr-signature" in dict(headers)

    # the head comes back on its port; every captured connection is played to it again
    again = await asyncio.to_thread(cli, "start", "--head", "--state-dir", str(state_dir))
    assert again.returncode == 0, again.stderr
    assert _head(state_dir)["address"] == address
    statuses = []
    for connection in captured:
        report = await attacker.run("send", port=port, data=connection.hex(), wait=2.0)
        answers = http2.header_blocks(bytes.fromhex(report["received"]))
        statuses += [dict(h)["grpc-status"] for h in answers if "grpc-status" in dict(h)]
    assert statuses and set(statuses) == {"16"}  # UNAUTHENTICATED, every one
