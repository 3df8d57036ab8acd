"""A caller that outpaces an actor gets a clear error past a bound instead of growing without
one: here the actor's worker is stopped (SIGSTOP) while 200 broadcasts of 512 KiB go to it."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

import orchestr as oc
from tests.cluster import open_cluster
from tests.procinfo import rss_mib
from tests.runtime.actors import Counter


async def test_broadcasts_to_a_stopped_actor_stop_at_the_bound() -> None:
    config = oc.load_config(max_unsent_bytes=8 << 20)
    async with open_cluster(config) as ctx:
        mesh = await ctx.spawn(Counter)
        pid = (await mesh.whoami.call_one())["pid"]
        payload = b"x" * (512 << 10)
        before = rss_mib()
        os.kill(pid, signal.SIGSTOP)
        try:
            sent = 0
            with pytest.raises(oc.TransportError, match="MAX_UNSENT_BYTES"):
                for _ in range(200):
                    mesh.echo.broadcast(payload)
                    sent += 1
            with pytest.raises(oc.TransportError, match="not taking what this process sends"):
                await mesh.echo.call_one(b"y")  # a call fails the same way, at once
            grown = rss_mib() - before
        finally:
            os.kill(pid, signal.SIGCONT)
        assert sent < 100, "the bound let through most of 100 MiB"
        assert grown < 48, f"the caller grew by {grown:.0f} MiB"
        for _ in range(50):  # once it runs again, what waited drains and calls go through
            try:
                assert await mesh.add.call_one(1) == 1
                break
            except oc.TransportError:
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("calls did not go through after SIGCONT")
