"""The torch side of the paged engine: the KV cache's tensors and one model step over them.

:class:`PagedKV` holds, per layer, keys and values as ``[blocks, block_size, kv_heads,
head_dim]``; a token at position ``p`` of a sequence lives in block ``table[p // size]`` at
offset ``p % size``. :class:`PagedRunner` runs what a :class:`~._scheduler.Step` scheduled:
the new tokens of every sequence packed into one row (no padding), each layer's keys and values
written to their slots, and each sequence's queries attending over its own blocks (positions
``0 ..`` its last new one, causally). It returns float32 logits at the last position of each
sequence that samples. The model is a :class:`orchestr.roles.models.CausalLM`, whose layers'
attention is split into ``project`` / ``core`` so the cache sits between them.
"""

from __future__ import annotations

from typing import cast

import torch

from orchestr.roles._common._hf._layers import CausalLM, DecoderLayer

from ._scheduler import Step

__all__ = ["PagedKV", "PagedRunner"]


class PagedKV:
    """The cache's tensors for ``model``: ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        cfg = model.config
        weight = model.lm_head.weight
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        dtype, device = dtype or weight.dtype, device or weight.device
        self.block_size = block_size
        layers = range(cfg.num_hidden_layers)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class PagedRunner:
    """One model step of a :class:`Step` over a :class:`PagedKV`."""

    def __init__(self, model: CausalLM, kv: PagedKV) -> None:
        self.model = model
        self.kv = kv

    @torch.no_grad()
    def run(self, step: Step) -> dict[str, torch.Tensor]:
        """Compute ``step``'s tokens; the logits ``[vocab]`` of each sequence that samples,
        by id. Reads each sequence's ``num_computed`` and ``blocks`` as scheduled (call it
        before :meth:`Scheduler.update`)."""
        if not step.scheduled:
            return {}
        model, size = self.model.model, self.kv.block_size
        device = self.kv.keys[0].device
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans = []  # (start, n, table) per sequence
        last: dict[str, int] = {}
        for seq, n in step.scheduled:
            start = seq.num_computed
            tokens += seq.tokens[start : start + n]
            for p in range(start, start + n):
                positions.append(p)
                slots.append(seq.blocks[p // size] * size + p % size)
            table = torch.tensor(seq.blocks[: -(-(start + n) // size)], device=device)
            spans.append((start, n, table))
            if step.samples(seq, n):
                last[seq.id] = len(tokens) - 1
        ids = torch.tensor([tokens], device=device)
        pos = torch.tensor([positions], device=device)
        slot = torch.tensor(slots, device=device)
        cos, sin = model.rotary(pos)
        hidden = model.embed_tokens(ids)
        layers = cast(list[DecoderLayer], list(model.layers))
        for layer, keys, values in zip(layers, self.kv.keys, self.kv.values, strict=True):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(hidden), cos, sin)
            heads = keys.shape[2:]
            keys.view(-1, *heads)[slot] = k[0].transpose(0, 1).to(keys.dtype)
            values.view(-1, *heads)[slot] = v[0].transpose(0, 1).to(values.dtype)
            outs, offset = [], 0
            for start, n, table in spans:
                width = start + n
                kk = keys[table].reshape(-1, *heads)[:width].transpose(0, 1)[None]
                vv = values[table].reshape(-1, *heads)[:width].transpose(0, 1)[None]
                qpos = torch.arange(start, width, device=device)
                mask = torch.arange(width, device=device)[None, :] <= qpos[:, None]
                qq = q[:, :, offset : offset + n]
                outs.append(attn.core(qq, kk.to(q.dtype), vv.to(q.dtype), mask))
                offset += n
            hidden = hidden + attn.o_proj(torch.cat(outs, dim=1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        if not last:
            return {}
        rows = torch.tensor(list(last.values()), device=device)
        logits = self.model.lm_head(model.norm(hidden[0, rows])).float()
        return {sid: logits[i] for i, sid in enumerate(last)}
