"""A dense copy of the decoding sequences' keys and values, so a decode step attends without
gathering them from the block pool.

Torch has no CPU attention that reads a block table, so reading a sequence's keys through its
blocks means copying them, every layer of every step: at batch 32 that gather was a quarter
of a decode step here. :class:`DecodeMirror` keeps, per layer, ``[rows, kv_heads, capacity,
head_dim]`` tensors in which each decoding sequence owns a row holding its keys and values
in order. A sequence is copied in from its blocks once, when it starts decoding; each step
then appends one token to its row (and to the pool, which stays the cache of record: the
prefix cache, preemption and recompute all work on the pool). The rows in use are kept
packed from row 0, in the order the runner batches the decodes, so the step's keys are a
view, ``keys[:batch, :, :longest]``. The price is a second copy of the decoding sequences'
keys and values.

A row is trusted only while its sequence is the same object, preempted as many times, with
as many tokens computed as the row holds; anything else (a preemption and recompute, a new
weight version that recomputed it, a step it sat out) copies it in again.
"""

from __future__ import annotations

import torch

from .._core._scheduler import Seq

__all__ = ["DecodeMirror"]

#: Rows and positions are allocated in multiples of these.
ROWS, POSITIONS = 8, 256


class DecodeMirror:
    """Rows of keys and values for ``layers`` layers of ``kv_heads`` x ``head_dim``, sized to
    the decoding sequences (about their number times the longest's length)."""

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self._shape = (kv_heads, head_dim)
        self._layers, self._dtype, self._device = layers, dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._rows: list[tuple[Seq, int, int]] = []  # per row: sequence, tokens, preemptions
        self._at = self._index = torch.zeros(0, dtype=torch.long)
        self._alloc(0, 0)

    @property
    def capacity(self) -> tuple[int, int]:
        """Rows and positions allocated."""
        first = self.keys[0]
        return first.shape[0], first.shape[2]

    def place(
        self,
        seqs: list[Seq],
        pool_keys: list[torch.Tensor],
        pool_values: list[torch.Tensor],
        block_size: int,
    ) -> list[Seq]:
        """Make ``seqs`` (sequences about to compute their token at ``num_computed``) rows
        ``0 .. len(seqs) - 1``, copying in from the pool what a row does not hold; returns
        them in row order (the order to batch them in)."""
        wanted = {id(s) for s in seqs}
        # pack the rows still good into rows 0.., in their present order (moving only those
        # behind a gap), then copy in the others after them
        packed: list[tuple[Seq, int, int]] = []
        for old, (s, n, p) in enumerate(self._rows):
            if id(s) in wanted and n == s.num_computed and p == s.preemptions:
                if old != len(packed):
                    self._move(old, len(packed), n)
                packed.append((s, n, p))
        self._rows = packed
        keep_ids = {id(s) for s, _, _ in packed}
        newcomers = [s for s in seqs if id(s) not in keep_ids]
        need_rows = len(self._rows) + len(newcomers)
        need_len = max((s.num_computed + 1 for s in seqs), default=0)
        rows, cap = self.capacity
        # sized to what is needed, rounded up (rows to 8, positions to 256), and remade when
        # that grows past the allocation or falls to a quarter of it
        want = (-(-need_rows // ROWS) * ROWS, -(-need_len // POSITIONS) * POSITIONS)
        if need_rows > rows or need_len > cap or rows * cap > 4 * want[0] * want[1]:
            self._alloc(*want)
        for s in newcomers:
            self._copy_in(s, len(self._rows), pool_keys, pool_values, block_size)
            self._rows.append((s, s.num_computed, s.preemptions))
        # where each placed row's next token goes: the same for every layer of the step
        self._at = torch.tensor(
            [n for _, n, _ in self._rows], dtype=torch.long, device=self._device
        )
        self._index = torch.arange(len(self._rows), device=self._device)
        return [s for s, _, _ in self._rows]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write layer ``layer``'s new key and value ``[rows, kv_heads, head_dim]`` of each
        placed row at its next position."""
        if not self._rows:
            return
        self.keys[layer][self._index, :, self._at] = k.to(self._dtype)
        self.values[layer][self._index, :, self._at] = v.to(self._dtype)

    def advance(self) -> None:
        """The placed rows each hold one token more (call after the step's last layer)."""
        self._rows = [(s, n + 1, p) for s, n, p in self._rows]

    def view(self, layer: int, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The placed rows' keys and values ``[rows, kv_heads, longest, head_dim]`` (views)."""
        b = len(self._rows)
        return self.keys[layer][:b, :, :longest], self.values[layer][:b, :, :longest]

    # -- internals ---------------------------------------------------------------------------
    def _alloc(self, rows: int, cap: int) -> None:
        shape = (rows, self._shape[0], cap, self._shape[1])
        old_k, old_v = self.keys, self.values
        self.keys = [
            torch.zeros(shape, dtype=self._dtype, device=self._device) for _ in range(self._layers)
        ]
        self.values = [
            torch.zeros(shape, dtype=self._dtype, device=self._device) for _ in range(self._layers)
        ]
        for i, (ok, ov) in enumerate(zip(old_k, old_v, strict=True)):
            for r, (_, n, _) in enumerate(self._rows):
                self.keys[i][r, :, :n] = ok[r, :, :n]
                self.values[i][r, :, :n] = ov[r, :, :n]

    def _move(self, src: int, dst: int, n: int) -> None:
        for t in (*self.keys, *self.values):
            t[dst, :, :n] = t[src, :, :n]

    def _copy_in(
        self,
        s: Seq,
        row: int,
        pool_keys: list[torch.Tensor],
        pool_values: list[torch.Tensor],
        size: int,
    ) -> None:
        n = s.num_computed
        if n == 0:
            return
        at = torch.arange(n, device=self._device)
        blocks = torch.tensor(s.blocks[: -(-n // size)], device=self._device)
        slots = blocks[at // size] * size + at % size
        for mk, mv, pk, pv in zip(self.keys, self.values, pool_keys, pool_values, strict=True):
            mk[row, :, :n] = pk.view(-1, *self._shape)[slots].transpose(0, 1)
            mv[row, :, :n] = pv.view(-1, *self._shape)[slots].transpose(0, 1)
