"""orchestr's own torch modules for Llama/Qwen2-style decoders, dense or with a mixture of
experts (Qwen2-MoE), named as Hugging Face names their tensors
(``model.layers.3.self_attn.q_proj.weight``, ``model.layers.0.mlp.experts.5.up_proj.weight``)
so a checkpoint loads as it is.

The model is built to be cut: each layer's attention (:class:`Attention`) and feed-forward
part (:class:`MLP`, or :class:`SparseMoE` whose routing, experts and shared expert are
separate calls) are separate modules with explicit inputs (hidden states, positions, the
attention mask; routed tokens and their weights), so they can run in different processes. Rotary embeddings (:class:`Rotary`)
are computed from positions in float32, as the reference does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ._config import ModelConfig, RopeScaling

if TYPE_CHECKING:
    from ._tp import TPShard

__all__ = [
    "MLP",
    "Attention",
    "CausalLM",
    "Decoder",
    "DecoderLayer",
    "RMSNorm",
    "Rotary",
    "SparseMoE",
    "causal_mask",
]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype  # normalised in float32 (one fused kernel), as transformers does
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(dtype)


def inverse_frequencies(dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """The rotary inverse frequencies of a head of ``dim``, after ``scaling``."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling.type == "linear":
        return inv / scaling.factor
    if scaling.type == "llama3":
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv


class Rotary(nn.Module):
    """cos and sin of each position's rotation, ``[batch, seq, head_dim]``, in float32."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dim, self.theta, self.scaling = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
        self._inv: dict[torch.device, torch.Tensor] = {}

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._inv.get(positions.device)
        if inv is None:
            inv = self._inv[positions.device] = inverse_frequencies(
                self.dim, self.theta, self.scaling
            ).to(positions.device)
        freqs = positions.float()[..., None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + turned * sin).to(x.dtype)


def causal_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[batch, 1, width, width]``: query ``i`` sees keys ``j <= i`` within its length."""
    idx = torch.arange(width, device=lengths.device)
    causal = idx[None, :] <= idx[:, None]
    valid = idx[None, :] < lengths[:, None]
    return (causal[None] & valid[:, None, :])[:, None]


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions: ``forward(hidden, cos, sin,
    mask)`` over ``[batch, seq, hidden]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        bias = cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def project(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        qkv: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values, ``[batch, heads, seq, head_dim]``, rotated. ``qkv``:
        the three projections of ``hidden`` already made, side by side ``[batch, seq,
        (heads + 2 * kv_heads) * head_dim]`` (one fused product, as an inference engine
        makes it); by default they are made here, one product each."""
        if qkv is None:
            qkv = torch.cat((self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)), -1)
        b, t, _ = qkv.shape
        h, kv = self.heads, self.kv_heads
        x = qkv.view(b, t, h + 2 * kv, self.head_dim).transpose(1, 2)
        # queries and keys rotate together (the same arithmetic per element as apart)
        qk = _rotate(x[:, : h + kv], cos[:, None], sin[:, None])
        return qk[:, :h], qk[:, h:], x[:, h + kv :]

    def core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Softmax attention of ``q`` ``[batch, heads, t, head_dim]`` over ``k``/``v``
        ``[batch, kv_heads, s, head_dim]`` where ``mask`` ``[.., t, s]`` allows (boolean, or
        added to the scores), the heads merged: ``[batch, t, heads * head_dim]`` (before the
        output projection). ``mask=None``: causal, for ``t == s`` (torch's fastest path)."""
        grouped = self.heads != self.kv_heads  # each kv head serves heads // kv_heads
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=grouped
        )
        b, _, t, _ = out.shape
        return out.transpose(1, 2).reshape(b, t, -1)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The output projection of :meth:`core`."""
        merged: torch.Tensor = self.o_proj(self.core(q, k, v, mask))
        return merged

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        return self.attend(*self.project(hidden, cos, sin), mask)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, ``width`` wide (default the config's
    ``intermediate_size``). When ``remote`` is set (``remote(x)`` over tokens ``[n, hidden]``)
    the product runs there instead: on expert hosts, in slices of the width
    (``orchestr.roles.experts``)."""

    remote: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, cfg: ModelConfig, width: int | None = None) -> None:
        super().__init__()
        width = width or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.remote is not None:
            return self.remote(x.reshape(-1, x.shape[-1])).reshape(x.shape)
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out

    @staticmethod
    def activate(gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate(x)) * up(x)`` from the two products side by side ``[.., 2 * width]``
        (one fused product, as an inference engine makes it): the down projection's input."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class SparseMoE(nn.Module):
    """Qwen2-MoE's feed-forward part: a router (``gate``) sends each token to its top-k of
    ``experts`` (SwiGLU MLPs), whose outputs are summed with the router's softmax weights;
    a ``shared_expert`` every token passes through is added, scaled by
    ``sigmoid(shared_expert_gate(x))``. :meth:`route`, :meth:`run_experts` and
    :meth:`shared` are the three parts, each over tokens ``[n, hidden]``. When ``remote`` is
    set (``remote(x, experts, weights)``, :meth:`run_experts`'s signature), the routed experts
    run there instead: on expert hosts (``orchestr.roles.experts``)."""

    remote: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    #: added to the router's logits when it picks the top k (not to the weights it gives
    #: them), one value per expert: to steer load, as DeepSeek-V3's balancing bias does
    bias: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        if moe is None:
            raise ValueError(f"a {cfg.model_type} config has no experts")
        self.top_k, self.normalise = moe.num_experts_per_tok, moe.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        width = moe.moe_intermediate_size
        self.experts = nn.ModuleList(MLP(cfg, width) for _ in range(moe.num_experts))
        self.shared_expert = MLP(cfg, moe.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts ``[n, k]`` (int64) and their weights ``[n, k]`` (x's dtype;
        softmax over all experts in float32, then the top k, renormalised if configured)."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if self.bias is None:
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
        else:
            experts = torch.topk(logits.float() + self.bias, self.top_k, dim=-1).indices
            weights = probs.gather(-1, experts)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def run_experts(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The weighted sum of each token's routed experts' outputs, ``[n, hidden]``; experts
        run in ascending order, each over the tokens routed to it."""
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            rows, slot = (experts == e).nonzero(as_tuple=True)
            y = self.experts[e](x[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output, gated: ``[n, hidden]``."""
        out: torch.Tensor = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = self.route(flat)
        run = self.remote or self.run_experts
        return (run(flat, experts, weights) + self.shared(flat)).reshape(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = cfg.moe is not None and cfg.moe.sparse(index)
        self.mlp: MLP | SparseMoE = SparseMoE(cfg) if sparse else MLP(cfg)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, mask)
        out: torch.Tensor = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return out


class _Embedding(nn.Embedding):
    """``nn.Embedding`` that draws no initial weights on the meta device: the checkpoint's are
    loaded in their place, and drawing them there (``normal_`` on a meta tensor) imports
    ``torch._dynamo``, about a second and a half of CPU in every process that loads a model."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Decoder(nn.Module):
    """The body without a head: ``forward(tokens, lengths=None, positions=None)`` gives the
    final hidden states ``[batch, seq, hidden]`` (after the last norm), as
    :class:`CausalLM` does before its head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = _Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)

    def forward(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, t = tokens.shape
        if lengths is None:
            lengths = torch.full((b,), t, device=tokens.device)
        if positions is None:
            positions = torch.arange(t, device=tokens.device).expand(b, t)
        cos, sin = self.rotary(positions)
        mask = causal_mask(lengths, t)
        hidden = self.embed_tokens(tokens)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, mask)
        out: torch.Tensor = self.norm(hidden)
        return out


class CausalLM(nn.Module):
    """A decoder and its head: ``forward(tokens, lengths=None, positions=None)`` gives
    logits ``[batch, seq, vocab]`` for right-padded ``tokens`` (``lengths`` per row; default
    every row full). Positions default to ``0 .. seq-1``."""

    #: a tensor-parallel rank's share of a model (:func:`~._tp.build_shard`), else ``None``
    shard: TPShard | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.model(tokens, lengths, positions))
        return logits
