"""A generator's side of attention servers: the core attention of long decodes runs there.

With ``Generator(attention=...)``, a decoding sequence whose context has
``min_tokens`` or more has, in every layer, its core attention cut into one shard per server
(key ranges on block boundaries, about equal) and sent as tasks referencing its blocks in the
generator's pool (registered once as a :class:`~orchestr.Buffer`): each server reads its
range one-sided and answers ``(out, lse)``; the shards merge here by log-sum-exp. All long
decodes of a step go in one call per server per layer (the server rebatches them). Shorter
decodes attend here as before. Like the expert hosts' client, :meth:`AttentionOffload.run`
is called from the engine's thread and waits on the actor's loop. It needs the paged
attention kernel (the path whose decode inputs are block tables).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import torch

import orchestr as oc

from ._core import merge

__all__ = ["AttentionOffload"]


class AttentionOffload:
    """Core attention of decodes of ``min_tokens`` or more on ``servers`` (an
    :class:`AttentionServer` mesh), over a paged pool: ``memory`` (every layer's keys then
    values, in shared memory), its ``layout`` (``(planes, plane_bytes, row_bytes)``), blocks
    of ``block_size`` tokens of ``kv_heads`` heads of ``head_dim``. Made on ``loop``."""

    def __init__(
        self,
        servers: oc.Mesh,
        loop: asyncio.AbstractEventLoop,
        *,
        memory: torch.Tensor,
        layout: tuple[int, int, int],
        block_size: int,
        kv_heads: int,
        head_dim: int,
        min_tokens: int,
    ) -> None:
        if not isinstance(servers, oc.Mesh) or len(servers) == 0:
            raise oc.ConfigError(f"attention_servers is an AttentionServer mesh, got {servers!r}")
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
            raise oc.ConfigError(f"min_tokens is a whole number >= 1, got {min_tokens!r}")
        self.servers = [servers[i] for i in range(len(servers))]
        self.loop, self.min_tokens = loop, min_tokens
        self._loop_thread = threading.get_ident()
        self.memory, self.layout = memory, list(layout)
        self.block_size, self.kv_heads, self.head_dim = block_size, kv_heads, head_dim
        self.dtype = str(memory.dtype).removeprefix("torch.")
        self.buffer: oc.Buffer | None = None
        self.decodes = self.calls = 0

    def run(
        self,
        layer: int,
        q: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """The core attention ``[n, heads, dim]`` of ``n`` decodes (``q [n, heads, dim]``,
        block ``tables [n, width]``, context ``lengths [n]`` with the new token), each over
        its whole context. Blocks the engine thread on the servers; raises what a server
        raised."""
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError("attention servers are called from the engine's thread")
        work = self._run(layer, q, tables.tolist(), lengths.tolist(), scale)
        return asyncio.run_coroutine_threadsafe(work, self.loop).result()

    async def _run(
        self, layer: int, q: torch.Tensor, tables: list[list[int]], lengths: list[int], scale: float
    ) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = oc.Buffer(self.memory)
        size = self.block_size
        per_server: list[list[dict[str, Any]]] = [[] for _ in self.servers]
        owners: list[list[tuple[int, int]]] = [[] for _ in self.servers]  # (decode, slot)
        for i, (table, length) in enumerate(zip(tables, lengths, strict=True)):
            blocks = -(-length // size)
            shards = min(len(self.servers), blocks)
            cuts = [blocks * s // shards * size for s in range(shards)] + [length]
            for s in range(shards):
                lo, hi = cuts[s], cuts[s + 1]
                per_server[s].append(
                    {
                        "q": q[i : i + 1],
                        "q_positions": [length - 1],
                        "source": self.buffer,
                        "layer": layer,
                        "blocks": table[lo // size : -(-hi // size)],
                        "tokens": [lo, hi],
                        "layout": self.layout,
                        "block_size": size,
                        "kv_heads": self.kv_heads,
                        "head_dim": self.head_dim,
                        "dtype": self.dtype,
                    }
                )
                owners[s].append((i, s))
        calls = [
            self.servers[s].attend.call_one(tasks, scale)
            for s, tasks in enumerate(per_server)
            if tasks
        ]
        answers = await asyncio.gather(*calls)
        parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in tables]
        for got, own in zip(answers, [o for o in owners if o], strict=True):
            for (out, lse), (i, _) in zip(got, own, strict=True):
                parts[i].append((out, lse))
        self.decodes += len(tables)
        self.calls += len(calls)
        merged = torch.cat([merge(p)[0] for p in parts])
        return merged.to(q.dtype)

    def stats(self) -> dict[str, int]:
        return {"offloaded_decodes": self.decodes, "server_calls": self.calls}
