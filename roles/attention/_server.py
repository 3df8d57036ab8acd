"""The attention server: an actor that runs core-attention tasks for other roles.

A task is a shard of queries and the keys they attend to: given inline (``k``, ``v``) or by
reference to KV blocks where they live, a generator's paged block pool registered as a
:class:`~orchestr.Buffer` (``source``), read one-sided over the data plane (shared memory on
one host, ``tcp`` or ``rdma`` across) with one vectored read per task. Tasks are rebatched:
every task of a call, and of the calls that arrive while one is being read, run as one padded
product (:func:`~._core.attend_batch`). Each answer is ``(out, lse)``, for the caller to merge
with its other shards (:func:`~._core.merge`).

A task referencing a pool names ``layer``, the sequence's ``blocks`` covering the key
positions ``tokens = [lo, hi)`` (the first block starting at ``lo // block_size *
block_size``), and the pool's ``layout`` (``(planes, plane_bytes, row_bytes)``: every
layer's keys then values, :attr:`~orchestr.roles.generator.PagedEngine.kv_layout`),
``block_size``, ``kv_heads``, ``head_dim`` and ``dtype``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import torch

import orchestr as oc

from ._core import Shard, attend_batch

__all__ = ["AttentionServer", "layer_spans"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layer_spans(
    blocks: Sequence[int], layer: int, layout: Sequence[int]
) -> list[tuple[int, int, int]]:
    """``(offset, nbytes, at)`` spans of ``blocks``' keys then values of ``layer`` in a pool of
    ``layout``, runs of consecutive blocks merged; ``at`` is where each lands in a copy
    ``[2, len(blocks), row_bytes]``."""
    planes, plane_bytes, row = layout
    spans = []
    for half, plane in enumerate((layer, planes // 2 + layer)):
        i = 0
        while i < len(blocks):
            j = i
            while j + 1 < len(blocks) and blocks[j + 1] == blocks[j] + 1:
                j += 1
            at = (half * len(blocks) + i) * row
            spans.append((plane * plane_bytes + blocks[i] * row, (j - i + 1) * row, at))
            i = j + 1
    return spans


class AttentionServer(oc.Actor):
    """Runs core-attention tasks (:meth:`attend`); holds no state but its counters."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    def __init__(self, *, torch_threads: int | None = None) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self._pending: list[tuple[list[Shard], float, asyncio.Future[Any]]] = []
        self._flush_due = False
        self.tasks = self.batches = self.largest = self.bytes_read = 0

    @oc.endpoint(concurrent=True)
    async def attend(self, tasks: list[dict[str, Any]], scale: float) -> list[Any]:
        """``[(out [n, heads, dim], lse [n, heads])]``, one per task, in order. Blocks on the
        reads of referenced blocks and one batched product. Raises ``ValueError`` for a task
        that is malformed or does not fit its pool, and what the reads raise. Cancel-safe:
        a cancelled call's answers are dropped."""
        shards = [await self._shard(t) for t in _tasks(tasks)]
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((shards, float(scale), future))
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)
        result: list[Any] = await future
        return result

    @oc.endpoint
    def stats(self) -> dict[str, int]:
        """Tasks run, batched products, the most tasks in one, bytes of KV read."""
        return {
            "tasks": self.tasks,
            "batches": self.batches,
            "largest_batch": self.largest,
            "bytes_read": self.bytes_read,
        }

    def _flush(self) -> None:
        self._flush_due = False
        pending, self._pending = self._pending, []
        by_scale: dict[float, list[tuple[list[Shard], asyncio.Future[Any]]]] = {}
        for shards, scale, future in pending:
            by_scale.setdefault(scale, []).append((shards, future))
        for scale, calls in by_scale.items():
            every = [s for shards, _ in calls for s in shards]
            try:
                results = attend_batch(every, scale)
            except Exception as exc:  # one malformed batch: each call learns why
                for _, future in calls:
                    if not future.done():
                        future.set_exception(exc)
                continue
            self.tasks += len(every)
            self.batches += 1
            self.largest = max(self.largest, len(every))
            at = 0
            for shards, future in calls:
                if not future.done():
                    future.set_result(results[at : at + len(shards)])
                at += len(shards)

    async def _shard(self, task: Mapping[str, Any]) -> Shard:
        q = task["q"]
        q_pos = task.get("q_positions")
        q_pos = None if q_pos is None else torch.as_tensor(q_pos, dtype=torch.int64)
        if "source" not in task:
            k, v = task["k"], task["v"]
            k_pos = task.get("k_positions")
            k_pos = None if k_pos is None else torch.as_tensor(k_pos, dtype=torch.int64)
            return Shard(q, k, v, q_pos, k_pos)
        lo, hi = (int(x) for x in task["tokens"])
        size, blocks = int(task["block_size"]), [int(b) for b in task["blocks"]]
        first = lo // size * size
        if not 0 <= lo < hi or len(blocks) != -(-(hi - first) // size):
            raise ValueError(f"tokens [{lo}, {hi}) need {-(-(hi - first) // size)} blocks")
        heads, dim = int(task["kv_heads"]), int(task["head_dim"])
        dtype = DTYPES[task["dtype"]]
        row = size * heads * dim * dtype.itemsize
        layout = [int(x) for x in task["layout"]]
        if layout[2] != row:
            raise ValueError(f"the pool's blocks are {layout[2]} bytes a plane, not {row}")
        copy = torch.empty(2, len(blocks), row, dtype=torch.uint8)
        flat = copy.view(-1)
        spans = layer_spans(blocks, int(task["layer"]), layout)
        await task["source"].read_spans([(off, flat[at : at + n]) for off, n, at in spans])
        self.bytes_read += copy.numel()
        kv = copy.view(dtype).view(2, len(blocks) * size, heads, dim)[:, lo - first : hi - first]
        positions = torch.arange(lo, hi) if q_pos is not None else None
        return Shard(q, kv[0], kv[1], q_pos, positions)


def _tasks(tasks: Any) -> list[Mapping[str, Any]]:
    if not isinstance(tasks, list) or not all(isinstance(t, Mapping) for t in tasks):
        raise ValueError("attend takes a list of tasks (dicts)")
    for t in tasks:
        if not isinstance(t.get("q"), torch.Tensor):
            raise ValueError("a task's q is a tensor [n, heads, dim]")
        if "source" not in t and not all(isinstance(t.get(x), torch.Tensor) for x in "kv"):
            raise ValueError("a task gives its keys: k and v tensors, or a source pool")
        if "source" in t:
            missing = [
                x
                for x in (
                    "layer",
                    "blocks",
                    "tokens",
                    "layout",
                    "block_size",
                    "kv_heads",
                    "head_dim",
                    "dtype",
                )
                if x not in t
            ]
            if missing or t.get("dtype") not in DTYPES:
                raise ValueError(f"a task over a pool needs {missing or ['a known dtype']}")
    return list(tasks)
