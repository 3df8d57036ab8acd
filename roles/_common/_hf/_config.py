"""A Hugging Face format ``config.json``, read into one checked dataclass for the decoder
families orchestr runs (``llama``, ``qwen2``, and the mixture of experts ``qwen2_moe``). Both
spellings of the rotary settings are read: ``rope_theta`` + ``rope_scaling`` (transformers 4)
and ``rope_parameters`` (5). Every size has an upper bound (:data:`MAX_SIZES`) and token ids
must be integers, so a damaged or hostile config is refused before anything is built from it."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import orchestr as oc

__all__ = [
    "FAMILIES",
    "MAX_SIZES",
    "MoEConfig",
    "ModelConfig",
    "RopeScaling",
    "read_config",
    "read_raw_config",
]

#: ``model_type`` -> what the family fixes: bias on q/k/v, and the tied-embeddings default.
FAMILIES: dict[str, dict[str, bool]] = {
    "llama": {"qkv_bias": False, "tie": False},
    "qwen2": {"qkv_bias": True, "tie": False},
    "qwen2_moe": {"qkv_bias": True, "tie": False},
}
ROPE_TYPES = ("default", "linear", "llama3")
#: The largest value each size in a config may take. Each is far above any released model's
#: (the largest have 126 layers, hidden size 16,384, FFN width 53,248, 128 heads, head_dim
#: 256, vocabularies of 262,144, contexts of 10M tokens and 512 experts), and together they
#: keep a config from making orchestr build an absurd model (the module tree of
#: ``num_hidden_layers`` layers is made before any weight is read) or size a buffer from it.
MAX_SIZES: dict[str, int] = {
    "num_hidden_layers": 1024,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 20,
    "moe_intermediate_size": 1 << 20,
    "shared_expert_intermediate_size": 1 << 20,
    "vocab_size": 1 << 22,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "max_position_embeddings": 1 << 24,
    "original_max_position_embeddings": 1 << 24,
    "num_experts": 4096,
    "num_experts_per_tok": 4096,
    "decoder_sparse_step": 1024,
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies are scaled: ``default`` (none), ``linear`` (positions
    divided by ``factor``) or ``llama3`` (long wavelengths stretched by ``factor``, short
    ones kept, a smooth band between)."""

    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward part (Qwen2-MoE's): ``num_experts`` routed experts
    of width ``moe_intermediate_size``, ``num_experts_per_tok`` of them per token (their
    softmax weights renormalised to sum to 1 when ``norm_topk_prob``), plus a shared expert of
    width ``shared_expert_intermediate_size`` scaled by a sigmoid gate. Layer ``i``
    is sparse unless listed in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` (from 0) routes to experts (else it has a dense MLP)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What the model code needs of a checkpoint's ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    qkv_bias: bool
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    moe: MoEConfig | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
        """Check ``raw`` (a parsed ``config.json``); raises :class:`ConfigError` naming the
        file and the field for anything orchestr cannot run."""
        model_type = raw.get("model_type")
        if model_type not in FAMILIES:
            raise oc.ConfigError(
                f"{where}: model_type {model_type!r} is not supported; orchestr runs "
                f"{', '.join(sorted(FAMILIES))}"
            )
        family = FAMILIES[model_type]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise oc.ConfigError(f"{where}: hidden_act {act!r} is not supported (only silu)")
        if raw.get("use_sliding_window"):
            raise oc.ConfigError(f"{where}: sliding-window attention is not supported")
        if raw.get("mlp_bias") or (model_type == "llama" and raw.get("attention_bias")):
            raise oc.ConfigError(
                f"{where}: biases on the MLP or attention output are not supported"
            )
        ints = {}
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            ints[name] = _positive_int(raw, name, where)
        heads = ints["num_attention_heads"]
        kv_heads = _positive_int(raw, "num_key_value_heads", where, default=heads)
        if heads % kv_heads:
            raise oc.ConfigError(
                f"{where}: num_attention_heads ({heads}) is not a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        default_head = ints["hidden_size"] // heads
        head_dim = _positive_int(raw, "head_dim", where, default=default_head)
        if head_dim % 2:
            raise oc.ConfigError(
                f"{where}: head_dim must be even for rotary embeddings, got {head_dim}"
            )
        theta, scaling = _rope(raw, where)
        eos = raw.get("eos_token_id")
        eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        eos_ids = tuple(_token_id(i, "eos_token_id", where) for i in eos_list)
        bos, pad = raw.get("bos_token_id"), raw.get("pad_token_id")
        if isinstance(pad, int) and not isinstance(pad, bool) and pad < 0:
            pad = None  # older configs write -1 for "no padding token"
        return cls(
            model_type=model_type,
            **ints,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive_float(raw, "rms_norm_eps", where, default=1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=_positive_int(
                raw, "max_position_embeddings", where, default=2048
            ),
            qkv_bias=bool(raw.get("qkv_bias", family["qkv_bias"])),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", family["tie"])),
            bos_token_id=None if bos is None else _token_id(bos, "bos_token_id", where),
            eos_token_ids=eos_ids,
            pad_token_id=None if pad is None else _token_id(pad, "pad_token_id", where),
            moe=_moe(raw, where, ints["num_hidden_layers"]) if model_type == "qwen2_moe" else None,
        )


def read_config(folder: str | os.PathLike[str]) -> ModelConfig:
    """The checked config of the checkpoint in ``folder``."""
    raw, path = read_raw_config(folder)
    return ModelConfig.from_dict(raw, path)


def read_raw_config(folder: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """``config.json`` of ``folder`` parsed but unchecked (for what :class:`ModelConfig` does
    not hold, such as ``architectures``), and its path. Raises :class:`ConfigError` when it
    is missing or not a JSON object."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise oc.ConfigError(f"{folder}: no config.json; is this a model folder?") from None
    except (OSError, ValueError) as exc:
        raise oc.ConfigError(f"{path}: not readable JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise oc.ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw, path


def _moe(raw: dict[str, Any], where: str, layers: int) -> MoEConfig:
    experts = _positive_int(raw, "num_experts", where)
    top_k = _positive_int(raw, "num_experts_per_tok", where)
    if top_k > experts:
        raise oc.ConfigError(
            f"{where}: num_experts_per_tok ({top_k}) exceeds num_experts ({experts})"
        )
    shared = _positive_int(raw, "shared_expert_intermediate_size", where)
    only = raw.get("mlp_only_layers") or []
    if not (isinstance(only, list) and all(isinstance(i, int) and 0 <= i < layers for i in only)):
        raise oc.ConfigError(
            f"{where}: mlp_only_layers must list layer numbers in [0, {layers}), got {only!r}"
        )
    return MoEConfig(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=_positive_int(raw, "moe_intermediate_size", where),
        shared_expert_intermediate_size=shared,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        decoder_sparse_step=_positive_int(raw, "decoder_sparse_step", where, default=1),
        mlp_only_layers=tuple(only),
    )


def _rope(raw: dict[str, Any], where: str) -> tuple[float, RopeScaling]:
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(params, dict):
        raise oc.ConfigError(f"{where}: rope_parameters must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise oc.ConfigError(
            f"{where}: rope scaling {kind!r} is not supported; orchestr runs "
            f"{', '.join(ROPE_TYPES)}"
        )
    theta = _positive_float(params, "rope_theta", where, default=10000.0)
    if kind == "default":
        return theta, RopeScaling()
    factor = _positive_float(params, "factor", where)
    if kind == "linear":
        return theta, RopeScaling("linear", factor)
    return theta, RopeScaling(
        "llama3",
        factor,
        _positive_float(params, "low_freq_factor", where),
        _positive_float(params, "high_freq_factor", where),
        _positive_int(params, "original_max_position_embeddings", where),
    )


def _positive_int(raw: dict[str, Any], name: str, where: str, default: int | None = None) -> int:
    value = raw.get(name, default)
    if value is None:
        raise oc.ConfigError(f"{where}: {name} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise oc.ConfigError(f"{where}: {name} must be a positive integer, got {value!r:.80}")
    most = MAX_SIZES.get(name)
    if most is not None and value > most:
        raise oc.ConfigError(
            f"{where}: {name} is {value:,}, over orchestr's limit of {most:,} (far above any "
            f"released model's); this config is damaged or not meant for a model orchestr runs"
        )
    return value


def _token_id(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise oc.ConfigError(
            f"{where}: {name} must be a token id (an integer of at least 0), got {value!r:.80}"
        )
    most = MAX_SIZES["vocab_size"]
    if value >= most:
        raise oc.ConfigError(
            f"{where}: {name} is {value:,}, past the largest vocabulary orchestr takes ({most:,})"
        )
    return value


def _positive_float(
    raw: dict[str, Any], name: str, where: str, default: float | None = None
) -> float:
    value = raw.get(name, default)
    if value is None:
        raise oc.ConfigError(f"{where}: {name} is missing")
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise oc.ConfigError(f"{where}: {name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise oc.ConfigError(f"{where}: {name} must be finite, got {value!r}")
    return float(value)
