"""What a KV store's grants let their holders reach, tried by a peer in another process that
reaches past them: a lease reads its own blocks and nothing else (not the slot beside them,
not the whole memory, not after it ends), never writes; a put writes its reserved slots only,
and not after it is published or times out; a namespace takes puts and leases from its own
writer only. Over ``shm`` the reader's own check refuses (the owner's user is the boundary on
its host); over ``tcp`` the store's process does."""

from __future__ import annotations

import asyncio

import pytest

import orchestr as oc
from orchestr.roles import KVNamespace, KVStore
from tests.roles.kvstore_actors import Prober, Reader, Writer

NS = KVNamespace("tiny-llama", block_size=16, weight_version=1)
SIZE = 4096
REFUSED = "DescriptorError"


def chain(n: int, start: int = 0) -> list[bytes]:
    return [f"block-{i}".encode() for i in range(start, start + n)]


async def roles(ctx: oc.JobContext) -> tuple[oc.Mesh, oc.Mesh, oc.Mesh, oc.Mesh]:
    """A store of 8 blocks, and a writer, a prober and a reader of it, each in a process."""
    store, writer, prober, reader = await asyncio.gather(
        ctx.spawn(KVStore, SIZE, 8), *(ctx.spawn(cls, SIZE) for cls in (Writer, Prober, Reader))
    )
    return store, writer, prober, reader


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_a_lease_reads_its_own_blocks_and_nothing_else(
    ctx: oc.JobContext, transport: str
) -> None:
    store, writer, prober, reader = await roles(ctx)
    assert await writer.put.call_one(store, NS, chain(4), [1, 2, 3, 4]) == 4
    got = await prober.probe_lease.call_one(store, NS, chain(2), transport)
    assert got == {
        "own block": "ok",
        "next slot": REFUSED,  # block 2, another's block for all this lease knows
        "across": REFUSED,
        "whole memory": REFUSED,
        "write own block": REFUSED,  # a lease is read-only
        "after release": "StaleDescriptorError",  # revoked with the lease
    }
    assert await reader.get.call_one(store, NS, chain(4)) == [1, 2, 3, 4]  # nothing changed


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_a_put_writes_its_reserved_slots_only_and_only_until_published(
    ctx: oc.JobContext, transport: str
) -> None:
    store, writer, prober, reader = await roles(ctx)
    assert await writer.put.call_one(store, NS, chain(2), [5, 6]) == 2
    lease = await store.lease.call_one(NS, chain(2))
    await store.release.call_one(lease["lease"])
    stored = lease["offsets"][1]
    got = await prober.probe_put.call_one(store, NS, chain(1, 2), stored, transport)
    assert got == {
        "own slot": "ok",
        "stored block": REFUSED,
        "past own slot": REFUSED,
        "read stored": REFUSED,
        "published": "1",
        "after publish": "StaleDescriptorError",  # a stored block is immutable
    }
    assert await reader.get.call_one(store, NS, chain(3)) == [5, 6, 7]


async def test_a_put_that_times_out_loses_its_grant(ctx: oc.JobContext) -> None:
    store = await ctx.spawn(KVStore, SIZE, 4, put_timeout_s=0.2, maintain_s=0.05)
    grant = await store.begin_put.call_one(NS, chain(1))
    assert grant["buffer"].spans == [(grant["writes"][0][1], SIZE)]
    # the store's housekeeping drops the put once it is past its time, and revokes its buffer
    with pytest.raises(oc.StaleDescriptorError):
        async with asyncio.timeout(60):
            while True:
                await grant["buffer"].write_from(bytes(SIZE), offset=grant["writes"][0][1])
                await asyncio.sleep(0.05)
    with pytest.raises(oc.ActorError, match="KVStoreError: put .* is not open"):
        await store.end_put.call_one(grant["put"])


async def test_a_namespace_takes_puts_and_leases_from_its_own_writer_only(
    ctx: oc.JobContext,
) -> None:
    store = await ctx.spawn(KVStore, SIZE, 8)
    owner = await ctx.spawn(Prober, SIZE)
    other = await ctx.spawn(Prober, SIZE)
    assert await owner.write_as.call_one(store, NS, chain(2), "job-a secret") == "ok"
    # another job, with another key or none: refused both ways, and nothing it sent landed
    for key in ("job-b secret", "", None):
        assert await other.write_as.call_one(store, NS, chain(2, 2), key) == "ActorError"
        assert await other.read_as.call_one(store, NS, chain(2), key) == "ActorError"
    assert (await store.match.call_one(NS, chain(4)))["tokens"] == 2 * 16
    assert await owner.read_as.call_one(store, NS, chain(2), "job-a secret") == [9, 9]
    # its own namespaces are open to it: another salt is another namespace
    theirs = KVNamespace("tiny-llama", block_size=16, weight_version=1, salt="job-b")
    assert await other.write_as.call_one(store, theirs, chain(2), "job-b secret") == "ok"
    assert await other.read_as.call_one(store, theirs, chain(2), "job-b secret") == [9, 9]
    assert await owner.read_as.call_one(store, theirs, chain(2), "job-a secret") == "ActorError"
    with pytest.raises(oc.ActorError, match="belongs to another writer"):
        await store.begin_put.call_one(NS, chain(1, 9), "job-b secret")


async def test_a_lease_that_ran_out_reaches_no_slot_given_again(ctx: oc.JobContext) -> None:
    """A lease's blocks are the store's again once it runs out; its grant must be gone before
    any of them is given to another put, even when housekeeping has not run since."""
    store = await ctx.spawn(KVStore, SIZE, 2, maintain_s=3600.0)
    writer = await ctx.spawn(Writer, SIZE)
    assert await writer.put.call_one(store, NS, chain(2), [1, 2]) == 2
    lease = await store.lease.call_one(NS, chain(1), ttl=0.05)
    assert lease["tokens"] == 16
    await asyncio.sleep(0.2)  # run out, with no housekeeping since
    assert (await store.remove.call_one(NS, chain(1)))[0] == 1  # its block is free now
    grant = await store.begin_put.call_one(NS, chain(1, 10))  # and given to another writer
    assert [w[1] for w in grant["writes"]] == lease["offsets"]
    out = bytearray(SIZE)
    with pytest.raises(oc.StaleDescriptorError):
        await lease["buffer"].read_into(out, offset=lease["offsets"][0])
    await store.abort_put.call_one(grant["put"])
