"""Reward models for tests: one-label sequence classifiers made with ``transformers``."""

from __future__ import annotations

import pathlib
import shutil
from typing import Any

import torch
from transformers import (
    AutoConfig,
    LlamaForSequenceClassification,
    Qwen2ForSequenceClassification,
)

CLASSES: dict[str, Any] = {
    "llama": LlamaForSequenceClassification,
    "qwen2": Qwen2ForSequenceClassification,
}


def classifier(lm: pathlib.Path, out: pathlib.Path, arch: str, seed: int = 0) -> pathlib.Path:
    """A one-label ``arch`` sequence classifier made with transformers from the config of the
    tiny causal LM ``lm`` (random weights; the head's large enough that scores differ well
    beyond rounding), saved with ``lm``'s tokenizer."""
    config = AutoConfig.from_pretrained(lm)
    config.num_labels = 1
    config.architectures = [CLASSES[arch].__name__]
    assert config.pad_token_id is not None
    torch.manual_seed(seed)
    model = CLASSES[arch](config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(lm / name, out / name)
    return out
