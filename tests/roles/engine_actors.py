"""A tiny causal LM for the generator's tests; workers import :func:`tiny_lm` by path."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyCausalLM(nn.Module):
    """Token and position embeddings, pre-norm causal attention blocks, a vocabulary head."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, max_seq_len: int) -> None:
        super().__init__()
        self.vocab_size = vocab
        self.max_seq_len = max_seq_len
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq_len, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tiny_lm(
    vocab: int = 32, dim: int = 32, heads: int = 2, layers: int = 1, max_seq_len: int = 512
) -> TinyCausalLM:
    return TinyCausalLM(vocab, dim, heads, layers, max_seq_len)


class _Broken(nn.Module):
    vocab_size = 8

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the model broke")


def broken_lm() -> nn.Module:
    """A model whose forward pass always raises."""
    return _Broken()
