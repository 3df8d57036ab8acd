"""A writer and a reader of a KV store, as two generators would be; workers import them by
path."""

from __future__ import annotations

from typing import Any

import torch

import orchestr as oc
from orchestr.roles import KVNamespace
from orchestr.roles.kvstore import get_blocks, put_blocks


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
