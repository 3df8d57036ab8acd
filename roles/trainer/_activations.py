"""Activation checkpointing for the trainer: each decoder layer keeps only its inputs for the
backward pass and recomputes the rest then, trading one more forward per layer for the
memory of its activations (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost", arXiv:1604.06174).

A layer's ``forward`` is wrapped in ``torch.utils.checkpoint.checkpoint`` (non-reentrant, so
autocast, keyword arguments and parameters that need no gradient all work) whenever
gradients are being recorded; under ``torch.no_grad`` (the proximal pass, evaluation,
generation) it runs as it was. The gradients are the same as without it, up to the float
rounding of a recomputation (none on the CPU, where kernels are deterministic).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from orchestr.roles._common._hf._layers import CausalLM
from orchestr.roles._common._model import TinyLM

__all__ = ["checkpoint_layers", "decoder_layers"]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The layers of a model :func:`~orchestr.roles.models.load_model` builds
    (``model.layers``) or of a :class:`~orchestr.roles.TinyLM` (``blocks``). Raises
    ``ValueError`` for another kind of model, whose layers this does not know."""
    if isinstance(model, CausalLM):
        return model.model.layers
    if isinstance(model, TinyLM):
        return model.blocks
    raise ValueError(
        f"activation_checkpointing knows the layers of CausalLM and TinyLM models, not of "
        f"{type(model).__name__}"
    )


def checkpoint_layers(model: nn.Module) -> int:
    """Wrap the forward of each of ``model``'s decoder layers (:func:`decoder_layers`) in
    activation checkpointing, in place; returns how many layers. Idempotent: a layer already
    wrapped is left as it is. Raises ``ValueError`` as :func:`decoder_layers` does."""
    layers = decoder_layers(model)
    for layer in layers:
        if not getattr(layer.forward, "_orchestr_checkpointed", False):
            layer.forward = _checkpointed(layer.forward)
    return len(layers)


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    run._orchestr_checkpointed = True  # type: ignore[attr-defined]
    return run
