"""One rank's share of a tensor-parallel model: which rows or columns of each checkpoint tensor
it holds, a :class:`~._layers.CausalLM` of that share, and loading only those slices.

Megatron's cut, as vLLM and SGLang also make it for these families:

- attention: the query heads are split evenly over the ranks, each rank with the key/value
  heads its queries read (split evenly when the ranks divide them, else one per rank,
  repeated where several ranks share it); ``q_proj``/``k_proj``/``v_proj`` (and their
  biases) are cut by rows (column-parallel), ``o_proj`` by columns (row-parallel: each
  rank's output is a partial sum, added up across ranks by one all-reduce);
- the MLP, each routed expert and the shared expert: ``gate_proj``/``up_proj`` by rows,
  ``down_proj`` by columns (one all-reduce for the whole feed-forward part); the router and
  the shared expert's gate are whole on every rank;
- the embedding and the output head by vocabulary rows: a rank embeds the tokens in its
  range (zeros elsewhere, summed by an all-reduce) and scores its range of the vocabulary
  (gathered).

Norms are whole on every rank, and so is the residual stream. A width the ranks do not
divide (an MLP's, the vocabulary) is cut unevenly, rank ``r`` holding
``[r * n // tp, (r + 1) * n // tp)``; the query heads must divide.
"""

from __future__ import annotations

import dataclasses
import os
import re

import torch
import torch.nn.functional as F
from torch import nn

import orchestr as oc

from ._config import ModelConfig, read_config
from ._layers import CausalLM, _Embedding
from ._load import assemble, read_weights, weight_names

__all__ = ["TPShard", "VocabSlice", "build_shard", "check_tp", "load_shard"]

_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def part(n: int, tp: int, rank: int) -> slice:
    """Rank ``rank``'s rows of ``n`` cut in ``tp``."""
    return slice(rank * n // tp, (rank + 1) * n // tp)


def check_tp(cfg: ModelConfig, tp: int, where: str = "the model") -> None:
    """Raise :class:`ConfigError` unless ``cfg`` can be cut over ``tp`` ranks."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise oc.ConfigError(f"{where}: tp is a whole number >= 1, got {tp!r}")
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % tp:
        raise oc.ConfigError(
            f"{where}: tp={tp} must divide the {heads} attention heads (each rank holds whole "
            "heads)"
        )
    if kv % tp and tp % kv:
        raise oc.ConfigError(
            f"{where}: tp={tp} and the {kv} key/value heads must divide one another (split "
            "them, or give each rank one)"
        )
    widths = [cfg.intermediate_size]
    if cfg.moe is not None:
        widths += [cfg.moe.moe_intermediate_size, cfg.moe.shared_expert_intermediate_size]
    if min(widths) < tp or cfg.vocab_size < tp:
        raise oc.ConfigError(f"{where}: tp={tp} leaves a rank no rows of an MLP or the vocabulary")


@dataclasses.dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``tp``'s share of a model of ``full`` (the checkpoint's config)."""

    full: ModelConfig
    tp: int
    rank: int

    def __post_init__(self) -> None:
        check_tp(self.full, self.tp)
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank {self.rank} of tp={self.tp}")

    @property
    def heads(self) -> slice:
        return part(self.full.num_attention_heads, self.tp, self.rank)

    @property
    def kv_heads(self) -> slice:
        """The key/value heads this rank holds: its share, or the one its queries read."""
        kv = self.full.num_key_value_heads
        if kv % self.tp == 0:
            return part(kv, self.tp, self.rank)
        first = self.rank * kv // self.tp
        return slice(first, first + 1)

    @property
    def vocab(self) -> slice:
        return part(self.full.vocab_size, self.tp, self.rank)

    @property
    def vocab_sizes(self) -> list[int]:
        """Every rank's vocabulary rows, in rank order (what the logits gather)."""
        v = self.full.vocab_size
        return [part(v, self.tp, r).stop - part(v, self.tp, r).start for r in range(self.tp)]

    @property
    def config(self) -> ModelConfig:
        """The config of this rank's modules: its heads and widths; the vocabulary stays whole
        (the embedding and head are sized by :attr:`vocab` instead)."""
        full, tp, r = self.full, self.tp, self.rank

        def width(n: int) -> int:
            s = part(n, tp, r)
            return int(s.stop - s.start)

        moe = full.moe
        if moe is not None:
            moe = dataclasses.replace(
                moe,
                moe_intermediate_size=width(moe.moe_intermediate_size),
                shared_expert_intermediate_size=width(moe.shared_expert_intermediate_size),
            )
        kv = self.kv_heads
        return dataclasses.replace(
            full,
            num_attention_heads=full.num_attention_heads // tp,
            num_key_value_heads=kv.stop - kv.start,
            intermediate_size=width(full.intermediate_size),
            moe=moe,
        )

    def cut(self, name: str) -> tuple[slice, ...] | None:
        """The part of checkpoint tensor ``name`` this rank holds (``None``: all of it)."""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (self.vocab,)
        leaf = name.rsplit(".", 2)
        if len(leaf) < 3:
            return None
        module = leaf[-2]
        d = self.full.head_dim
        if module in ("q_proj", "k_proj", "v_proj", "o_proj"):
            h = self.heads if module in ("q_proj", "o_proj") else self.kv_heads
            rows = slice(h.start * d, h.stop * d)
            return (slice(None), rows) if module == "o_proj" else (rows,)
        if module in ("gate_proj", "up_proj", "down_proj"):
            rows = part(self._width(name), self.tp, self.rank)
            return (slice(None), rows) if module == "down_proj" else (rows,)
        return None  # norms, the router, the shared expert's gate

    def part_of(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``tensor``, checkpoint tensor ``name`` whole (a view)."""
        cut = self.cut(name)
        return tensor if cut is None else tensor[cut]

    def _width(self, name: str) -> int:
        moe = self.full.moe
        if moe is not None and _EXPERT.search(name):
            return int(moe.moe_intermediate_size)
        if moe is not None and ".mlp.shared_expert." in name:
            return moe.shared_expert_intermediate_size
        return self.full.intermediate_size


class VocabSlice(_Embedding):
    """The embedding rows ``[start, start + rows)`` of the vocabulary: a token outside them
    embeds as zeros (the ranks' outputs add up to the whole embedding)."""

    def __init__(self, start: int, rows: int, hidden: int) -> None:
        super().__init__(rows, hidden)
        self.start = start

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return out.masked_fill(outside[..., None], 0.0)


def build_shard(shard: TPShard) -> CausalLM:
    """An empty (uninitialised) :class:`CausalLM` of ``shard``'s share, in the current
    default device (build it under ``torch.device("meta")`` to load into)."""
    cfg = shard.config
    model = CausalLM(cfg)
    vocab = shard.vocab
    rows = vocab.stop - vocab.start
    model.model.embed_tokens = VocabSlice(vocab.start, rows, cfg.hidden_size)
    model.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.shard = shard
    return model


def load_shard(
    folder: str | os.PathLike[str],
    tp: int,
    rank: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> CausalLM:
    """Rank ``rank`` of ``tp``'s share of the checkpoint in ``folder``, reading only its
    slices of each tensor (safetensors slices: the rest is never read). Raises
    :class:`ConfigError` as :func:`~._load.load_model` does, and for a ``tp`` the model
    cannot be cut by."""
    folder = os.fspath(folder)
    full = read_config(folder)
    check_tp(full, tp, folder)
    shard = TPShard(full, tp, rank)
    state = read_weights(
        folder, weight_names(full), full.model_type, dtype=dtype, device=device, cut=shard.cut
    )
    with torch.device("meta"):
        model = build_shard(shard)
    return assemble(model, state)
