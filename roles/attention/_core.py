"""Core attention, ``softmax(q kᵀ · scale) v``, over shards of the keys, merged exactly by
log-sum-exp. No I/O here.

A shard of a sequence's keys gives, for each query row and head, a partial output ``o_i``
(softmax over the shard's keys only) and ``lse_i = log Σ exp(scores)`` over them. Over all
shards, with ``m = max_i lse_i`` and ``w_i = exp(lse_i - m)``, the whole attention is
``Σ w_i o_i / Σ w_i`` and its lse ``m + log Σ w_i``: :func:`merge`. DistCA splits the core
attention of long sequences this way; the stateless shards can run anywhere.

:func:`attend` is one shard; :func:`attend_batch` many shards of many requests, padded into
one batched product (the rebatching an attention server does: one matmul for many tasks).
Queries ``[n, heads, dim]``, keys and values ``[m, kv_heads, dim]`` with ``heads`` a
multiple of ``kv_heads`` (grouped-query heads share a key head). With positions, a query
sees only keys at positions ≤ its own (causal); a row that sees no key gets output 0 and lse
``-inf``, and contributes nothing to a merge. Computed in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Shard", "attend", "attend_batch", "merge"]


@dataclass
class Shard:
    """One core-attention task with its keys in hand: ``q [n, heads, dim]``, ``k``/``v``
    ``[m, kv_heads, dim]``, and optionally the queries' and keys' positions (causal)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_positions: torch.Tensor | None = None
    k_positions: torch.Tensor | None = None

    def check(self) -> None:
        """Raises ``ValueError`` for shapes that do not fit together."""
        q, k, v = self.q, self.k, self.v
        if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
            raise ValueError(
                f"q is [n, heads, dim] and k, v [m, kv_heads, dim]: got {tuple(q.shape)}, "
                f"{tuple(k.shape)}, {tuple(v.shape)}"
            )
        if q.shape[2] != k.shape[2] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
            raise ValueError(
                f"{q.shape[1]} query heads of dim {q.shape[2]} cannot share {k.shape[1]} key "
                f"heads of dim {k.shape[2]}"
            )
        if (self.q_positions is None) != (self.k_positions is None):
            raise ValueError("give both q_positions and k_positions, or neither")
        if self.q_positions is not None and self.k_positions is not None:
            if self.q_positions.shape != (q.shape[0],) or self.k_positions.shape != (k.shape[0],):
                raise ValueError("one position per query row and per key row")


def attend(shard: Shard, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [n, heads, dim], lse [n, heads])`` of one shard."""
    ((out, lse),) = attend_batch([shard], scale)
    return out, lse


def attend_batch(shards: Sequence[Shard], scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each shard's ``(out, lse)``, computed in one padded batch per shape of heads (shards of
    one query head count, key head count and dim batch together)."""
    for s in shards:
        s.check()
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(shards):
        groups.setdefault((*s.q.shape[1:], s.k.shape[1]), []).append(i)
    out: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(shards)  # type: ignore[list-item]
    for members in groups.values():
        for i, result in zip(members, _batch([shards[i] for i in members], scale), strict=True):
            out[i] = result
    return out


def _batch(shards: Sequence[Shard], scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # grouped-query heads as rows: a key head's ``group`` query heads attend as one block of
    # ``group * n`` rows, so keys and values are never repeated per query head
    heads, dim = shards[0].q.shape[1:]
    kv_heads = shards[0].k.shape[1]
    group = heads // kv_heads
    t = len(shards)
    n = max(s.q.shape[0] for s in shards)
    m = max(max(s.k.shape[0] for s in shards), 1)
    q = torch.zeros(t, kv_heads, group, n, dim)
    k = torch.zeros(t, kv_heads, m, dim)
    v = torch.zeros(t, kv_heads, m, dim)
    visible = torch.zeros(t, n, m, dtype=torch.bool)
    for i, s in enumerate(shards):
        rows, keys = s.q.shape[0], s.k.shape[0]
        q[i, :, :, :rows] = s.q.float().view(rows, kv_heads, group, dim).permute(1, 2, 0, 3)
        k[i, :, :keys] = s.k.float().transpose(0, 1)
        v[i, :, :keys] = s.v.float().transpose(0, 1)
        if s.q_positions is not None and s.k_positions is not None:
            visible[i, :rows, :keys] = s.k_positions[None, :] <= s.q_positions[:, None]
        else:
            visible[i, :rows, :keys] = True
    rows_mask = visible[:, None, None].expand(t, 1, group, n, m).reshape(t, 1, group * n, m)
    scores = torch.matmul(q.view(t, kv_heads, group * n, dim), k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~rows_mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [t, kv_heads, group * n]
    weights = torch.exp(scores - lse[..., None].clamp_min(torch.finfo(torch.float32).min))
    weights = weights.masked_fill(~rows_mask, 0.0)
    res = torch.matmul(weights, v).view(t, kv_heads, group, n, dim)
    lse = lse.view(t, kv_heads, group, n)
    return [
        (
            res[i, :, :, : s.q.shape[0]].permute(2, 0, 1, 3).reshape(s.q.shape[0], heads, dim),
            lse[i, :, :, : s.q.shape[0]].permute(2, 0, 1).reshape(s.q.shape[0], heads),
        )
        for i, s in enumerate(shards)
    ]


def merge(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over all the shards ``parts`` (each ``(out [n, heads, dim], lse [n,
    heads])`` over disjoint keys of the same queries): ``(out, lse)``."""
    if not parts:
        raise ValueError("nothing to merge")
    lses = torch.stack([lse for _, lse in parts])  # [s, n, heads]
    top = lses.max(dim=0).values
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(lses - safe)  # 0 where a shard saw nothing
    total = weights.sum(dim=0)
    out = sum(w[..., None] * o for w, (o, _) in zip(weights, parts, strict=True))
    assert isinstance(out, torch.Tensor)
    out = out / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return out, safe + torch.log(total)
