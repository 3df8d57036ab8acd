"""A writer and a reader of a KV store, as two generators would be; workers import them by
path."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import torch

import orchestr as oc
from orchestr.roles import KVNamespace
from orchestr.roles.kvstore import KVWriter, get_blocks, put_blocks


def block(fill: int, size: int) -> torch.Tensor:
    """A block whose bytes say which it is: ``fill`` then its index mod 251, repeated."""
    t = torch.arange(size, dtype=torch.int64).remainder(251).to(torch.uint8)
    t[0] = fill
    return t


class Writer(oc.Actor):
    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes

    @oc.endpoint
    async def put(self, store: Any, ns: KVNamespace, hashes: list[bytes], fills: list[int]) -> int:
        return await put_blocks(store, ns, hashes, [block(f, self.block_bytes) for f in fills])

    @oc.endpoint
    async def put_wrong_size(self, store: Any, ns: KVNamespace, hashes: list[bytes]) -> int:
        return await put_blocks(store, ns, hashes, [block(0, self.block_bytes + 1) for _ in hashes])

    @oc.endpoint
    async def begin_only(self, store: Any, ns: KVNamespace, hashes: list[bytes]) -> int:
        """Reserve and write nothing: a writer that dies mid-put."""
        grant = await store.begin_put.call_one(ns, hashes)
        return len(grant["writes"])


class Reader(oc.Actor):
    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes

    @oc.endpoint
    async def get(self, store: Any, ns: KVNamespace, hashes: list[bytes]) -> list[int]:
        """The fills of the longest stored prefix, each block checked byte for byte."""
        out = [torch.zeros(self.block_bytes, dtype=torch.uint8) for _ in hashes]
        n = await get_blocks(store, ns, hashes, out)
        fills = []
        for t in out[:n]:
            fill = int(t[0])
            assert torch.equal(t, block(fill, self.block_bytes)), "a block came back changed"
            fills.append(fill)
        return fills


async def outcome(move: Awaitable[Any]) -> str:
    """``"ok"`` or the name of the error ``move`` raised."""
    try:
        await move
    except Exception as exc:
        return type(exc).__name__
    return "ok"


class Prober(oc.Actor):
    """A peer that holds a store's grants and tries to reach past them, as a buggy or hostile
    job would: each endpoint returns what every try came to (``"ok"`` or the error's name)."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes

    @oc.endpoint
    async def probe_lease(
        self, store: Any, ns: KVNamespace, hashes: list[bytes], transport: str
    ) -> dict[str, str]:
        """Lease ``hashes`` (stored), then read the leased block, the slot after the last
        one, all of the store's memory, and write into the leased block; with ``transport``."""
        lease = await store.lease.call_one(ns, hashes)
        buf, size = lease["buffer"], self.block_bytes
        first, last = min(lease["offsets"]), max(lease["offsets"])
        dst = torch.zeros(size, dtype=torch.uint8)
        try:
            tries = {
                "own block": buf.read_into(dst, offset=first, transport=transport),
                "next slot": buf.read_into(dst, offset=last + size, transport=transport),
                "across": buf.read_into(dst, offset=last + size // 2, transport=transport),
                "whole memory": buf.read_into(
                    torch.zeros(buf.nbytes, dtype=torch.uint8), transport=transport
                ),
                "write own block": buf.write_from(dst, offset=first, transport=transport),
            }
            got = {what: await outcome(move) for what, move in tries.items()}
        finally:
            await store.release.call_one(lease["lease"])
        got["after release"] = await outcome(buf.read_into(dst, offset=first, transport=transport))
        return got

    @oc.endpoint
    async def probe_put(
        self, store: Any, ns: KVNamespace, hashes: list[bytes], stored_offset: int, transport: str
    ) -> dict[str, str]:
        """Reserve ``hashes`` (one new block), write it, then try to write over the block at
        ``stored_offset`` (another's, stored) and past the reserved slot; publish; write the
        published block again."""
        grant = await store.begin_put.call_one(ns, hashes)
        buf, size = grant["buffer"], self.block_bytes
        ((_, mine),) = grant["writes"]
        junk = torch.full((size,), 0xEE, dtype=torch.uint8)
        tries = {
            "own slot": buf.write_from(block(7, size), offset=mine, transport=transport),
            "stored block": buf.write_from(junk, offset=stored_offset, transport=transport),
            "past own slot": buf.write_from(junk, offset=mine + size // 2, transport=transport),
            "read stored": buf.read_into(junk.clone(), offset=stored_offset, transport=transport),
        }
        got = {what: await outcome(move) for what, move in tries.items()}
        got["published"] = str(await store.end_put.call_one(grant["put"]))
        got["after publish"] = await outcome(buf.write_from(junk, offset=mine, transport=transport))
        return got

    @oc.endpoint
    async def write_as(
        self, store: Any, ns: KVNamespace, hashes: list[bytes], key: str | None
    ) -> str:
        """Put ``hashes`` as the writer ``key`` (``None``: a plain mesh, no key)."""
        target = store if key is None else KVWriter(store, key)
        blocks = [block(9, self.block_bytes) for _ in hashes]
        return await outcome(put_blocks(target, ns, hashes, blocks))

    @oc.endpoint
    async def read_as(
        self, store: Any, ns: KVNamespace, hashes: list[bytes], key: str | None
    ) -> list[int] | str:
        """The fills of the stored prefix of ``hashes``, read as the writer ``key``, or the
        error's name."""
        out = [torch.zeros(self.block_bytes, dtype=torch.uint8) for _ in hashes]
        try:
            n = await get_blocks(store if key is None else KVWriter(store, key), ns, hashes, out)
        except Exception as exc:
            return type(exc).__name__
        return [int(t[0]) for t in out[:n]]
