"""What a :class:`~._actor.Generator` runs: a model and the engine around it, from a factory
(the recompute :class:`~._engine.Engine`, for any causal LM) or from a Hugging Face format
checkpoint folder (the :class:`~._paged_engine.PagedEngine` over a paged KV cache)."""

from __future__ import annotations

import os
from typing import Any

import torch

import orchestr as oc
from orchestr.roles._common._backend import Backend
from orchestr.roles._common._factory import build_model
from orchestr.roles._common._hf._load import load_model
from orchestr.roles._common._hf._tokenizer import Tokenizer
from orchestr.roles._common._model import TinyLM

from ._engine import Engine
from ._paged_engine import PagedEngine

__all__ = ["KV_OPTIONS", "build_engine"]

#: The paged engine's options a Generator passes on (``kv={...}``).
KV_OPTIONS = ("num_blocks", "block_size", "token_budget", "on_new_weights")


def build_engine(
    backend: Backend,
    model_factory: str,
    seed: int,
    max_batch: int,
    *,
    checkpoint: str | None,
    kv: dict[str, Any] | None,
    model_kwargs: dict[str, Any] | None,
    version: int,
    eos_id: int | None,
    pad_id: int | None,
    max_seq_len: int | None,
    vocab_size: int | None,
) -> tuple[torch.nn.Module, Engine | PagedEngine]:
    """The model (its named weights, what weight syncs write into) and its engine. Raises
    :class:`ConfigError` for options that do not fit the model's kind."""
    if checkpoint is not None:
        unknown = sorted(set(kv or {}) - set(KV_OPTIONS))
        if unknown:
            raise oc.ConfigError(f"unknown kv option(s) {unknown}; known: {', '.join(KV_OPTIONS)}")
        lm = load_model(checkpoint, dtype=backend.dtype or torch.float32, device=backend.device)
        has_tokenizer = os.path.exists(os.path.join(checkpoint, "tokenizer.json"))
        engine = PagedEngine(
            lm,
            max_batch=max_batch,
            version=version,
            seed=seed,
            model_id=os.path.abspath(checkpoint),
            detokenize=Tokenizer(checkpoint).decode if has_tokenizer else None,
            **(kv or {}),
        )
        return lm, engine
    if kv:
        raise oc.ConfigError("kv options apply to a checkpoint's paged engine; give checkpoint=")
    model = build_model(model_factory, model_kwargs, seed)
    runner = backend.prepare(model)
    if isinstance(model, TinyLM):  # its own sizes and padding unless told otherwise
        vocab_size = vocab_size or model.cfg.vocab_size
        pad_id = model.cfg.pad_id if pad_id is None else pad_id
    return model, Engine(
        model,
        runner=runner,
        max_batch=max_batch,
        version=version,
        seed=seed,
        pad_id=0 if pad_id is None else pad_id,
        eos_id=eos_id,
        max_seq_len=max_seq_len,
        vocab_size=vocab_size,
    )
