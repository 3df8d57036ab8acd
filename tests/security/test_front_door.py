"""Rule: the serving front door (an HTTP listener) answers another local user who lacks its
API key with 401 and does no work for it: no request reaches a generator, and a body is not
even read. Garbage on the socket gets a 400 from the HTTP parser, and the server serves on."""

from __future__ import annotations

import pathlib

import pytest

from orchestr.roles import Generator, models
from orchestr.roles.serving import FrontDoor, ServedModel
from tests.cluster import open_cluster
from tests.roles.serving.test_frontdoor import http

from .conftest import Attacker


def _request(method: str, path: str, body: bytes = b"", auth: str | None = None) -> str:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    if auth is not None:
        head += f"Authorization: {auth}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return (head.encode() + body).hex()


def _status(report: dict[str, object]) -> int:
    reply = bytes.fromhex(str(report["received"]))
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


@pytest.mark.timeout(120)
async def test_another_user_without_the_key_gets_nothing(
    attacker: Attacker, tmp_path: pathlib.Path
) -> None:
    folder = models.make_tiny("llama", tmp_path / "m")
    body = b'{"model": "m", "prompt": "hi", "max_tokens": 4}'
    async with open_cluster() as ctx:
        gen = await ctx.spawn(Generator, checkpoint=str(folder), torch_threads=1)
        async with (
            FrontDoor(gen) as front,
            http(front, ServedModel(folder, ["m"]), api_key="k3y") as url,
        ):
            port = int(url.rpartition(":")[2])
            for request in (
                _request("POST", "/v1/completions", body),
                _request("POST", "/v1/completions", body, auth="Bearer wrong"),
                _request("POST", "/v1/completions", body, auth="k3y"),  # no scheme
                _request("POST", "/v1/chat/completions", body, auth="Bearer k3y2"),
                _request("GET", "/v1/models"),
                _request("GET", "/metrics"),
                _request("POST", "/tokenize", b'{"prompt": "hi"}'),
            ):
                report = await attacker.run("send", port=port, data=request, wait=5.0)
                assert _status(report) == 401, bytes.fromhex(str(report["received"]))[:200]
            # a body announced far beyond the limit, without the key: refused before it is read
            huge = _request("POST", "/v1/completions", b"x" * 1024).replace(
                b"Content-Length: 1024".hex(), b"Content-Length: 999999999".hex()
            )
            assert _status(await attacker.run("send", port=port, data=huge, wait=5.0)) == 401
            garbage = await attacker.run("send", port=port, data=(b"\x00\xff" * 64).hex())
            assert _status(garbage) in (0, 400)
            assert (await gen.stats.call_one())["finished"] == 0  # nothing was generated
            # the owner, with the key, is served as before
            ok = _request("POST", "/v1/completions", body, auth="Bearer k3y")
            assert _status(await attacker.run("send", port=port, data=ok, wait=30.0)) == 200
