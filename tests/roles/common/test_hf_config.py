"""A checkpoint's ``config.json`` with absurd sizes or token ids that are not integers is
refused by ``read_config`` with a :class:`ConfigError` naming the field, before any model is
built; the configs of the largest real models still read."""

from __future__ import annotations

import copy
import json
import pathlib
from typing import Any

import pytest

import orchestr as oc
from orchestr.roles import models
from orchestr.roles._common._hf._config import MAX_SIZES

#: Llama 3.1 405B's sizes, about the largest dense model released.
LLAMA_405B: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_hidden_layers": 126,
    "num_attention_heads": 128,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}
MOE: dict[str, Any] = {
    **LLAMA_405B,
    "model_type": "qwen2_moe",
    "rope_scaling": None,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "max_position_embeddings": 10_000_000,
}


def read(tmp_path: pathlib.Path, raw: dict[str, Any]) -> models.ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return models.read_config(tmp_path)


def test_the_largest_real_configs_read(tmp_path: pathlib.Path) -> None:
    cfg = read(tmp_path, LLAMA_405B)
    assert (cfg.num_hidden_layers, cfg.eos_token_ids) == (126, (128001, 128008, 128009))
    moe = read(tmp_path, MOE)
    assert moe.moe is not None and moe.moe.num_experts == 512
    # older configs write -1 for "no padding token"
    assert read(tmp_path, {**LLAMA_405B, "pad_token_id": -1}).pad_token_id is None


@pytest.mark.parametrize("name", sorted(MAX_SIZES))
def test_a_size_over_its_limit_is_refused(tmp_path: pathlib.Path, name: str) -> None:
    raw = copy.deepcopy({**MOE, "rope_scaling": LLAMA_405B["rope_scaling"]})
    big = MAX_SIZES[name] + 1
    if name == "original_max_position_embeddings":
        raw["rope_scaling"][name] = big
    else:
        raw[name] = big
    if name == "num_key_value_heads":
        raw["num_attention_heads"] = MAX_SIZES["num_attention_heads"]
    limit = f"{MAX_SIZES[name]:,}"
    with pytest.raises(oc.ConfigError, match=f"config.json: {name} is {big:,}, over .* {limit}"):
        read(tmp_path, raw)


def test_absurd_layer_counts_are_refused_before_a_model_is_built(tmp_path: pathlib.Path) -> None:
    with pytest.raises(oc.ConfigError, match="num_hidden_layers is 1,000,000,000,000, over"):
        read(tmp_path, {**LLAMA_405B, "num_hidden_layers": 10**12})
    with pytest.raises(oc.ConfigError, match="vocab_size must be a positive integer, got 1e"):
        read(tmp_path, {**LLAMA_405B, "vocab_size": 1e30})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("eos_token_id", "</s>"),
        ("eos_token_id", [2, "3"]),
        ("eos_token_id", 2.5),
        ("eos_token_id", True),
        ("eos_token_id", -5),
        ("eos_token_id", {"id": 2}),
        ("bos_token_id", "1"),
        ("pad_token_id", [0]),
    ],
)
def test_a_token_id_that_is_not_an_integer_is_a_config_error(
    tmp_path: pathlib.Path, name: str, value: Any
) -> None:
    with pytest.raises(oc.ConfigError, match=f"{name} must be a token id"):
        read(tmp_path, {**LLAMA_405B, name: value})


def test_a_token_id_past_any_vocabulary_is_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(oc.ConfigError, match="eos_token_id is 10,000,000,000, past the largest"):
        read(tmp_path, {**LLAMA_405B, "eos_token_id": [2, 10**10]})
