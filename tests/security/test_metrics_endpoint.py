"""Rule: the head's /metrics answers only scrapes that carry its token when it has one (the
daemons' default), and another user holding idle connections cannot lock real scrapers out."""

from __future__ import annotations

import asyncio
import json
import pathlib
import urllib.error
import urllib.request

import pytest

from tests.cluster import open_cluster
from tests.runtime.cluster.test_metrics import exchange

from ..cli.test_cluster import start_cluster, state_dir  # noqa: F401 (a fixture)
from .conftest import Attacker


def _get(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


async def test_idle_connections_do_not_lock_scrapers_out(attacker: Attacker) -> None:
    async with open_cluster() as ctx:
        address = str(ctx.metrics_address)
        port = int(address.rpartition(":")[2])
        held = asyncio.ensure_future(attacker.run("hold", port=port, count=40, first=1.0, then=0.1))
        await asyncio.sleep(0.5)
        for _ in range(3):
            status, _, body = await exchange(address, b"GET /metrics HTTP/1.1\r\n\r\n")
            assert status == 200 and b"orchestr_nodes" in body
        report = await held
        assert report["closed_first"] >= 24  # the oldest idle ones made room


@pytest.mark.timeout(120)
async def test_a_daemon_head_asks_scrapes_for_its_metrics_token(
    state_dir: pathlib.Path,  # noqa: F811
) -> None:
    await asyncio.to_thread(start_cluster, state_dir)
    token_file = state_dir / "metrics-token"
    assert token_file.stat().st_mode & 0o077 == 0
    token = token_file.read_text().strip()
    assert token != (state_dir / "token").read_text().strip()  # not the cluster's token
    head = json.loads((state_dir / "head.json").read_text())
    url = f"http://{head['metrics_address']}/metrics"
    assert await asyncio.to_thread(_get, url) == 401
    assert await asyncio.to_thread(_get, url, "wrong") == 401
    assert await asyncio.to_thread(_get, url, token) == 200
