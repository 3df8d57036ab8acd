"""A split model's KV blocks as a whole model's engine lays them out.

Each rank of a tensor-parallel generator holds its key/value heads of every block
(:mod:`orchestr.roles._common._hf._tp`). What moves blocks between engines (the KV store
link, prefill/decode handoffs) speaks the whole model's layout: per plane (every layer's
keys, then values), a block's row is ``[block_size, kv_heads, head_dim]`` with all the heads.
:class:`SplitKV` gives the leader that view. Exporting blocks gathers each rank's heads into
whole rows. Writing blocks sends each rank its heads. Lending blocks to a reader stages a
whole copy in shared memory, because no one region holds them whole. Pools of different
degrees therefore exchange blocks in one form: a tp=2 prefill generator hands to a tp=1
decode generator and the reverse, and each decode rank ends up holding the heads it reads.
"""

from __future__ import annotations

import math

import torch

from orchestr import fabric
from orchestr.roles._common._hf._tp import TPShard

from .._runner._cache import KVCache, as_planes
from ._tp import TPRanks

__all__ = ["SplitKV"]


class SplitKV:
    """The whole-model view of ``kv`` (rank 0's share) and the other ranks' shares of
    ``shard``'s model, reached through ``ranks``."""

    def __init__(self, kv: KVCache, ranks: TPRanks, shard: TPShard) -> None:
        self.kv, self.ranks = kv, ranks
        full = shard.full
        self.heads = [TPShard(full, shard.tp, r).kv_heads for r in range(shard.tp)]
        first = kv.keys[0]
        self.dtype = first.dtype
        self.planes = 2 * len(kv.keys)
        self.row = (first.shape[1], full.num_key_value_heads, full.head_dim)
        self.row_bytes = math.prod(self.row) * first.element_size()
        self.num_blocks = first.shape[0]

    @property
    def block_nbytes(self) -> int:
        return self.planes * self.row_bytes

    @property
    def layout(self) -> tuple[int, int, int]:
        """``(planes, plane_bytes, row_bytes)`` of a whole pool of this many blocks."""
        return self.planes, self.num_blocks * self.row_bytes, self.row_bytes

    def rows(self, blocks: list[int]) -> torch.Tensor:
        """A copy of ``blocks`` as whole rows, ``[blocks, planes, block_size, kv_heads,
        head_dim]``, every rank's heads in their places."""
        group = self.ranks.joined()
        group.send({"op": "kv_export", "blocks": blocks})
        mine = self.kv.rows(blocks)
        whole = mine.new_empty((len(blocks), self.planes, *self.row))
        whole[..., self.heads[0], :] = mine
        for rank in range(1, len(self.heads)):
            h = self.heads[rank]
            part = mine.new_empty((len(blocks), self.planes, self.row[0], h.stop - h.start,
                                   self.row[2]))  # fmt: skip
            whole[..., h, :] = group.receive_tensor(part, rank)
        return whole

    def export(self, blocks: list[int]) -> list[torch.Tensor]:
        """:meth:`KVCache.export` of whole rows: a flat ``uint8`` CPU tensor per block."""
        if not blocks:
            return []
        flat = self.rows(blocks).cpu().view(torch.uint8).reshape(len(blocks), -1)
        return list(flat.unbind(0))

    def planes_of(self, data: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """:meth:`KVCache.planes_of` for whole blocks."""
        return as_planes(data, self.planes, self.row, self.dtype)

    def write(self, blocks: list[int], planes: torch.Tensor) -> None:
        """Write whole blocks (:meth:`planes_of`) into ``blocks``: each rank its heads."""
        if not blocks:
            return
        group = self.ranks.joined()
        group.send({"op": "kv_write", "blocks": blocks})
        for rank in range(1, len(self.heads)):
            group.send_tensor(planes[..., self.heads[rank], :].to(self.kv.keys[0].device), rank)
        self.kv.write(blocks, planes[..., self.heads[0], :])

    def copy_in(
        self, blocks: list[int], source: torch.Tensor, theirs: list[int], plane_bytes: int
    ) -> None:
        """Copy blocks ``theirs`` of a whole pool's memory (``source``, flat ``uint8``,
        ``plane_bytes`` to a plane) into ``blocks``. Raises ``ValueError`` as
        :func:`~.._runner._spans.copy_blocks` does."""
        if len(blocks) != len(theirs):
            raise ValueError(f"{len(blocks)} blocks here for {len(theirs)} there")
        row = self.row_bytes
        if source.numel() != self.planes * plane_bytes or plane_bytes % row:
            raise ValueError("the source is not a block pool of this layout")
        there = plane_bytes // row
        if not all(0 <= b < self.num_blocks for b in blocks) or not all(
            0 <= t < there for t in theirs
        ):
            raise ValueError(
                f"a block id lies outside its pool ({self.num_blocks} blocks here, {there} there)"
            )
        index = torch.tensor(theirs, dtype=torch.long)
        picked = source.view(self.planes, there, row).index_select(1, index)
        self.write(blocks, picked.view(self.dtype).view(self.planes, len(blocks), *self.row))

    def lend(self, blocks: list[int]) -> tuple[torch.Tensor, list[int], tuple[int, int, int]]:
        """A whole copy of ``blocks`` in shared memory, laid out as a pool of just those
        blocks (so a reader on this host may borrow it): the memory, the blocks' ids in it
        (``0 ..``) and its layout."""
        n = len(blocks)
        staged = fabric.empty(self.planes * max(n, 1) * self.row_bytes, dtype=torch.uint8)
        if n:
            whole = self.rows(blocks).transpose(0, 1).contiguous().cpu()
            staged.copy_(whole.view(torch.uint8).reshape(-1))
        return staged, list(range(n)), (self.planes, n * self.row_bytes, self.row_bytes)
