"""TinyLM: a small decoder-only transformer, the policy the generator hosts.

Pre-norm blocks of causal self-attention and a GELU MLP, learned position embeddings, a final
LayerNorm and an untied output head. The contract the rest of the system relies on is only
``forward(tokens: LongTensor[B, T]) -> logits[B, T, V]``: any ``nn.Module`` with that
signature can be generated from (:mod:`._rollout`) and trained (:func:`orchestr.roles.grpo_update`).

Padding tokens (``pad_id``) are invisible: never attended to (a token still sees itself, so an all-padding
prefix gives no NaNs) and not counted in positions, so a sequence's logits do not depend on the
padding before or after it: left padding to a batch's longest prompt, or none, gives the same
answer. Positions count from the prompt's separator (``sep_id``) by default: the separator always has position
``sep_position``, its i-th predecessor ``sep_position - i`` and the i-th completion token
``sep_position + i``. Digit reversal is then a fixed mirror around one position, whatever the
prompt's length; ``positions="from_start"`` counts from the first token instead, the usual
convention. Position embeddings are learned from small random values: unlike a sinusoidal
start, an untrained far position then attends diffusely rather than confidently to a
neighbour's key, which keeps the long tail explorable under RL.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["TinyLM", "TinyLMConfig"]

Positions = Literal["from_sep", "from_start"]


@dataclasses.dataclass(frozen=True)
class TinyLMConfig:
    """Shape of a :class:`TinyLM`.

    ``positions``: ``"from_sep"`` numbers tokens relative to the first ``sep_id`` in the row,
    which has position ``sep_position`` (every row must hold one); ``"from_start"`` numbers
    them from the first token that is not padding, under which the separator's position varies with
    the prompt's length.

    The defaults fit the example task, :mod:`orchestr.roles.reverse_task` (14 tokens, prompts
    of up to 16 digits, ``<sep>`` 11, ``<pad>`` 13); another task names its own.
    """

    vocab_size: int = 14
    max_positions: int = 36
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 256
    pad_id: int | None = 13
    positions: Positions = "from_sep"
    sep_id: int = 11
    sep_position: int = 17

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})"
            )
        if min(self.vocab_size, self.max_positions, self.d_model, self.n_layers, self.d_ff) < 1:
            raise ValueError(f"every size in {self} must be positive")
        if not 0 <= self.sep_position < self.max_positions:
            raise ValueError(
                f"sep_position ({self.sep_position}) must be in 0..max_positions-1 "
                f"({self.max_positions - 1})"
            )


class _Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.out = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        y: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return y


class TinyLM(nn.Module):
    """A causal LM: ``forward(tokens[B, T]) -> logits[B, T, V]``.

    Raises ``ValueError`` for a token id outside the vocabulary or a position outside the table
    (an embedding lookup would fail with a less helpful message).
    """

    def __init__(self, cfg: TinyLMConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or TinyLMConfig()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.apply(self._init)
        # GPT-2's scaling: each residual branch starts small, so depth does not blow up the sum.
        for block in self.blocks:
            assert isinstance(block, _Block)
            for lin in (block.proj, block.out):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def positions(self, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` position ids; padding gets 0 (it is masked, so its id does not matter).

        Raises ``ValueError`` when a real token falls outside the position table, or, for
        ``"from_sep"``, when a row has no separator.
        """
        cfg = self.cfg
        if cfg.positions == "from_start":
            pos = keep.long().cumsum(-1) - 1
        else:
            is_sep = tokens == cfg.sep_id
            if not bool(is_sep.any(-1).all()):
                raise ValueError(
                    "positions='from_sep' needs a separator token in every row; encode prompts "
                    "with the task's encode_prompt, or build the model with positions='from_start'"
                )
            sep_col = is_sep.long().argmax(-1, keepdim=True)
            pos = torch.arange(tokens.shape[1], device=tokens.device) - sep_col + cfg.sep_position
        real = pos[keep]
        if real.numel() and (int(real.min()) < 0 or int(real.max()) >= cfg.max_positions):
            raise ValueError(
                f"positions {int(real.min())}..{int(real.max())} fall outside the model's table "
                f"0..{cfg.max_positions - 1}; build it with a larger max_positions (or "
                "sep_position) for prompts or completions this long"
            )
        return torch.where(keep, pos, 0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, time], got shape {tuple(tokens.shape)}")
        b, t = tokens.shape
        if t and b and (int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size):
            lo, hi = int(tokens.min()), int(tokens.max())
            raise ValueError(f"token ids must be in [0, {cfg.vocab_size}), got ids {lo}..{hi}")
        causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
        if cfg.pad_id is None:
            keep = torch.ones_like(tokens, dtype=torch.bool)
        else:
            keep = tokens != cfg.pad_id
        eye = torch.eye(t, dtype=torch.bool, device=tokens.device)
        mask = (causal & (keep[:, None, :] | eye))[:, None]  # [B, 1, T, T]
        x = self.tok(tokens) + self.pos(self.positions(tokens, keep))
        for block in self.blocks:
            x = block(x, mask)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits
