"""The KV store actor between real actors: blocks written by one and read by another through
the store's memory, demoted to disk and promoted back, a writer that never finishes, a lease
that runs out, and bad input."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch

import orchestr as oc
from orchestr.roles import KVNamespace, KVStore
from orchestr.roles.kvstore import get_blocks
from tests.roles.kvstore_actors import Reader, Writer

NS = KVNamespace("tiny-llama", block_size=16, weight_version=1)
SIZE = 4096


def chain(n: int, start: int = 0) -> list[bytes]:
    return [f"block-{i}".encode() for i in range(start, start + n)]


async def wait_for(check: Callable[[], Awaitable[bool]], what: str, tries: int = 400) -> None:
    """Poll ``check`` every 50 ms, up to ``tries`` times (the store's housekeeping runs on a
    timer of its own)."""
    for _ in range(tries):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {what} after {tries * 0.05:.0f} s")


async def test_blocks_go_writer_to_store_to_reader_through_the_disk_under_leases(
    ctx: oc.JobContext,
) -> None:
    store, writer, reader = await asyncio.gather(
        ctx.spawn(
            KVStore,
            SIZE,
            8,
            disk_blocks=8,
            high_watermark=0.7,
            low_watermark=0.4,
            maintain_s=0.05,
        ),
        ctx.spawn(Writer, SIZE),
        ctx.spawn(Reader, SIZE),
    )
    assert await writer.put.call_one(store, NS, chain(4), [10, 11, 12, 13]) == 4
    assert await writer.put.call_one(store, NS, chain(4), [0, 0, 0, 0]) == 0  # stored already
    assert await reader.get.call_one(store, NS, [*chain(4), b"missing"]) == [10, 11, 12, 13]
    found = await store.match.call_one(NS, chain(6))
    assert found == {"tokens": 64, "by_tier": {"host": 64, "disk": 0}}
    other = KVNamespace("tiny-llama", block_size=16, weight_version=2)
    assert await reader.get.call_one(store, other, chain(4)) == []  # another version's
    # four more: 8 of 8 slots, over 0.7; the store demotes the oldest to disk, down to 3
    assert await writer.put.call_one(store, NS, chain(4, 4), [14, 15, 16, 17]) == 4

    async def demoted() -> bool:
        tiers = (await store.stats.call_one())["tiers"]
        return tiers["host"]["used"] <= 3 and tiers["disk"]["blocks"] >= 5

    await wait_for(demoted, "demotion to disk")
    assert (await store.match.call_one(NS, chain(8)))["by_tier"]["disk"] >= 5 * 16
    # a read of disk-only blocks promotes them first, and they come back byte for byte
    assert await reader.get.call_one(store, NS, chain(8)) == list(range(10, 18))
    stats = await store.stats.call_one()
    assert stats["promotions"] >= 1 and stats["demotions"] >= 5

    async def released() -> bool:  # (a read within its lease lets go without waiting)
        return (await store.stats.call_one())["leases"] == 0

    await wait_for(released, "the readers' leases to end")
    page = await store.events.call_one()
    kinds = {(kind, tier) for _, kind, _, _, tier in page["events"]}
    assert {("stored", "host"), ("stored", "disk"), ("removed", "host")} <= kinds
    assert not page["lost"] and page["last"] == page["events"][-1][0]
    # a read that outlives its lease is refused
    await writer.put.call_one(store, NS, chain(2, 20), [1, 2])
    lease = await store.lease.call_one(NS, chain(2, 20), 2.0)
    assert lease["tokens"] == 32 and len(lease["offsets"]) == 2
    await store.check_lease.call_one(lease["lease"])
    await asyncio.sleep(2.1)
    with pytest.raises(oc.ActorError, match="LeaseExpiredError: lease .* expired"):
        await store.check_lease.call_one(lease["lease"])
    # bad input
    with pytest.raises(oc.ActorError, match="block 0 is 4097 bytes.*of 4096 bytes"):
        await writer.put_wrong_size.call_one(store, NS, chain(1))
    assert (await store.stats.call_one())["open_puts"] == 0  # the put was aborted
    with pytest.raises(oc.ActorError, match="TypeError: a block hash is non-empty bytes"):
        await store.match.call_one(NS, ["text"])
    with pytest.raises(oc.ActorError, match="KVStoreError: put 999 is not open"):
        await store.end_put.call_one(999)
    with pytest.raises(oc.SpawnError, match="block_bytes >= 1"):
        await ctx.spawn(KVStore, 0, 4)
    with pytest.raises(oc.SpawnError, match="watermarks"):
        await ctx.spawn(KVStore, SIZE, 4, high_watermark=0.5, low_watermark=0.9)
    await store.aclose.call_one()
    with pytest.raises(oc.ActorError, match="ClosedResourceError"):
        await store.begin_put.call_one(NS, chain(1))


async def test_a_writer_that_never_finishes_leaves_nothing_and_its_space_returns(
    ctx: oc.JobContext,
) -> None:
    store, writer, late = await asyncio.gather(
        ctx.spawn(KVStore, SIZE, 4, put_timeout_s=5.0, maintain_s=0.05),
        ctx.spawn(Writer, SIZE),
        ctx.spawn(Writer, SIZE),
    )
    assert await writer.begin_only.call_one(store, NS, chain(4)) == 4
    # every slot is reserved by a put that will never end (within its 5 s): no room, none
    # of it visible
    assert await late.put.call_one(store, NS, chain(2, 10), [1, 2]) == 0
    assert (await store.match.call_one(NS, chain(4)))["tokens"] == 0
    await ctx.stop(writer)

    async def reclaimed() -> bool:
        return (await store.stats.call_one()).get("expired_puts", 0) == 1

    await wait_for(reclaimed, "the put's timeout")
    assert await late.put.call_one(store, NS, chain(2, 10), [1, 2]) == 2
    assert (await store.stats.call_one())["tiers"]["host"]["used"] == 2


class _LateReplies:
    """A store whose lease replies reach the reader ``delay`` seconds after the store granted
    them (a slow network): the reader cannot know the lease held through its read."""

    def __init__(self, store: Any, delay: float) -> None:
        self._store, self._delay = store, delay
        self.release, self.end_read = store.release, store.end_read
        self.lease = self

    async def call_one(self, *args: Any) -> Any:
        granted = await self._store.lease.call_one(*args)
        await asyncio.sleep(self._delay)
        return granted


async def test_a_read_that_may_have_outlived_its_lease_asks_and_is_refused(
    ctx: oc.JobContext,
) -> None:
    store = await ctx.spawn(KVStore, SIZE, 4, lease_s=0.05, maintain_s=0.05)
    writer = await ctx.spawn(Writer, SIZE)
    assert await writer.put.call_one(store, NS, chain(2), [3, 4]) == 2
    out = [torch.zeros(SIZE, dtype=torch.uint8) for _ in range(2)]
    with pytest.raises(oc.ActorError, match="LeaseExpiredError"):
        await get_blocks(_LateReplies(store, 0.2), NS, chain(2), out)
    assert (await store.stats.call_one())["leases"] == 0  # ended, refused, released
    # the same through a store whose leases outlast any read here (a 50 ms lease might not,
    # on a loaded machine)
    lasting = await ctx.spawn(KVStore, SIZE, 4)
    assert await writer.put.call_one(lasting, NS, chain(2), [3, 4]) == 2
    assert await get_blocks(_LateReplies(lasting, 0.0), NS, chain(2), out) == 2  # in time
    assert [int(t[0]) for t in out] == [3, 4]
