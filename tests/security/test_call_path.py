"""Rule: nothing is decoded, allocated or imported for a peer before it authenticates, and a
caller's secret is useless to a server that has not proven it knows the token. The call path
(each worker's call server) attacked by another local user."""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path

import msgpack
import pytest

import orchestr as oc
from tests.cluster import open_cluster

from .. import rawcall
from ..procinfo import rss_mib
from .actors import Target
from .conftest import Attacker

PLANTED = "orchestr_planted_by_attacker"


def _dataclass(name: str) -> msgpack.ExtType:
    return msgpack.ExtType(3, msgpack.packb([name, {}]))


def _nested(depth: int) -> bytes:
    value: object = _dataclass("a:B")
    for _ in range(depth):
        value = msgpack.ExtType(3, msgpack.packb(["a:B", {"x": value}]))
    return msgpack.packb([0, 0, {"nonce": value}])


def _raw(body: bytes, extra: int = 0) -> bytes:
    return struct.pack("<IQ", len(body), extra) + body


def _port(address: str) -> int:
    return int(address.partition("?")[0].rpartition(":")[2])


def _memfds(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:")
        except OSError:
            pass
    return count


@pytest.fixture
async def planted(attacker_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module the attacker planted in a folder on the workers' import path; importing it
    leaves a marker."""
    marker = attacker_dir / "imported"
    module = attacker_dir / f"{PLANTED}.py"
    module.write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.setenv("PYTHONPATH", str(attacker_dir))
    return marker


async def test_nothing_is_imported_for_an_unauthenticated_peer(
    attacker: Attacker, planted: Path
) -> None:
    nonce = os.urandom(32)
    attacks = [
        # the frame of the old protocol: the token's place, then a dataclass naming the module
        rawcall.frame([0, "wrong-token", _dataclass(f"{PLANTED}:X")]),
        rawcall.frame([0, 0, {"nonce": _dataclass(f"{PLANTED}:X")}]),
        # a HELLO, then an AUTH that carries the dataclass
        rawcall.frame([0, 0, {"nonce": nonce}])
        + rawcall.frame([9, 0, {"proof": nonce, "process": _dataclass(f"{PLANTED}:X")}]),
        # a call before any handshake
        rawcall.frame([1, 1, "a-x", "add", [_dataclass(f"{PLANTED}:X")], {}]),
    ]
    async with open_cluster() as ctx:
        target = await ctx.spawn(Target)
        port = _port(target.members[0].address)
        for data in attacks:
            report = await attacker.run("send", port=port, data=data.hex())
            assert report["closed"], data
            assert PLANTED.encode().hex() not in report["received"]  # nothing tells it exists
        assert not await asyncio.to_thread(planted.exists)
        assert await target.imported.call_one(PLANTED) is False
        assert await target.add.call_one(1) == 1  # and the worker still serves


async def test_an_actor_a_program_hosts_serves_no_one_without_the_token(
    attacker: Attacker,
) -> None:
    """The call server ``serve_actor`` starts in a program of one's own (here this one) is
    the workers' own: another user's calls before the handshake, a wrong token's frame and
    garbage close the connection, and the actor runs nothing for them."""
    async with open_cluster() as ctx:
        target = Target()
        hosted = await ctx.serve_actor(target, name="hosted-target")
        port = _port(hosted.members[0].address)
        attacks = [
            rawcall.frame([1, 1, hosted.members[0].actor_id, "add", [5], {}]),  # no handshake
            rawcall.frame([0, "wrong-token", {}]),
            _raw(os.urandom(64)),
        ]
        for data in attacks:
            report = await attacker.run("send", port=port, data=data.hex())
            assert report["closed"], data
        assert target.total == 0
        assert await hosted.add.call_one(1) == 1  # and it still serves the cluster


async def test_nested_extensions_before_authentication_close_the_connection(
    attacker: Attacker,
) -> None:
    async with open_cluster() as ctx:
        target = await ctx.spawn(Target)
        port = _port(target.members[0].address)
        pid = await target.pid.call_one()
        for depth in (300, 400):  # 3.6 KB, under the handshake limit; and 4.8 KB, over it
            report = await attacker.run("send", port=port, data=_raw(_nested(depth)).hex())
            assert report["closed"]
        assert await target.pid.call_one() == pid  # the same process: it did not crash
        assert await target.add.call_one(2) == 2


async def test_a_frame_header_before_authentication_allocates_nothing(
    attacker: Attacker,
) -> None:
    async with open_cluster() as ctx:
        target = await ctx.spawn(Target)
        port = _port(target.members[0].address)
        pid = await target.pid.call_one()
        rss, memfds = rss_mib(pid), _memfds(pid)
        for extra in (128 << 20, 1 << 30):  # buffers of 128 MiB, 1 GiB announced
            header = struct.pack("<IQ", 16, extra) + bytes(16)
            report = await attacker.run("send", port=port, data=header.hex())
            assert report["closed"]
        # a message larger than a handshake, announced and then trickled
        report = await attacker.run("send", port=port, data=_raw(bytes(8192))[:1000].hex())
        assert report["closed"]
        assert _memfds(pid) == memfds
        assert rss_mib(pid) - rss < 8
        assert await target.add.call_one(3) == 3


async def test_unauthenticated_connections_time_out_and_are_capped(attacker: Attacker) -> None:
    config = oc.load_config(handshake_timeout=2.0, max_pending_handshakes=8)
    async with open_cluster(config) as ctx:
        target = await ctx.spawn(Target)
        port = _port(target.members[0].address)
        held = asyncio.ensure_future(attacker.run("hold", port=port, count=20, first=0.5, then=6.0))
        await asyncio.sleep(1.0)
        # the attacker holds 8 connections open in the handshake: callers still get in
        fresh = await ctx.spawn(Target)
        assert await fresh.add.call_one(4) == 4
        report = await held
        assert report["closed_first"] >= 12  # the oldest went as newer ones came
        assert report["closed_then"] == 20  # and the rest at the handshake deadline
        assert await target.add.call_one(5) == 5


async def test_a_fake_worker_learns_nothing_that_works(attacker: Attacker) -> None:
    """Another user holds a port a caller dials (say, of a worker that exited): it answers
    with a made-up challenge. The caller refuses it and sends nothing but its nonce; what it
    sent gets nobody into a real worker."""
    async with open_cluster() as ctx:
        target = await ctx.spawn(Target)
        member = target.members[0]
        port = await _free_port()
        challenge = rawcall.frame([8, 0, {"nonce": os.urandom(32), "proof": os.urandom(32)}])
        fake = await attacker.serving(port, 3.0, reply=challenge.hex())
        address = f"tcp://127.0.0.1:{port}?proc={member.address.split('?proc=')[1]}"
        with pytest.raises(oc.AuthenticationError, match="did not prove it knows the cluster"):
            await ctx.client.call(address, member.actor_id, "Target[0]", "add", (100,), {})
        captured = bytes.fromhex("".join((await fake)["connections"]))
        assert captured and ctx.token.encode() not in captured
        assert len(captured) < 100  # one HELLO: a nonce and nothing else
        # replayed to the real worker, it gets a challenge and nothing more
        report = await attacker.run(
            "send", port=_port(member.address), data=captured.hex(), wait=1.0
        )
        kinds = [f[0] for f in _frames(bytes.fromhex(report["received"]))]
        assert kinds == [rawcall.CHALLENGE]
        assert await target.add.call_one(1) == 1  # the 100 never arrived


async def test_a_handshake_relayed_to_another_worker_fails(attacker: Attacker) -> None:
    """The fake server passes the caller's connection through to one of the cluster's real
    workers: that worker's proof names its own address, not the one the caller dialled."""
    async with open_cluster() as ctx:
        target = await ctx.spawn(Target)
        member = target.members[0]
        port = await _free_port()
        relay = await attacker.serving(port, 3.0, relay=_port(member.address))
        address = f"tcp://127.0.0.1:{port}?proc={member.address.split('?proc=')[1]}"
        with pytest.raises(oc.AuthenticationError, match="did not prove"):
            await ctx.client.call(address, member.actor_id, "Target[0]", "add", (100,), {})
        captured = bytes.fromhex("".join((await relay)["connections"]))
        assert [f[0] for f in _frames(captured)] == [rawcall.HELLO]
        assert await target.add.call_one(1) == 1


async def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _frames(data: bytes) -> list[list[object]]:
    frames = []
    while len(data) >= 12:
        n, extra = struct.unpack("<IQ", data[:12])
        frames.append(msgpack.unpackb(data[12 : 12 + n]))
        data = data[12 + n + extra :]
    return frames
