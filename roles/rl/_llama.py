"""The main job's model: a Llama-family checkpoint for the digit tasks, made from a seed."""

from __future__ import annotations

import dataclasses

import torch

from orchestr.roles._common._hf._tiny import make_tiny

__all__ = ["Checkpoint", "LlamaModel"]


@dataclasses.dataclass(frozen=True)
class LlamaModel:
    """A Llama-family checkpoint for the digit tasks, made locally from the run's seed
    (:func:`~orchestr.roles.models.make_tiny` with the ``digits`` tokenizer, whose ids are the
    task's): generators run it on the paged engine, the trainer trains the same modules."""

    hidden: int = 64
    layers: int = 2
    heads: int = 2  # head_dim 32: the least vLLM's CPU attention takes
    kv_heads: int = 2
    intermediate: int = 160
    init_std: float = 0.02
    max_positions: int = 64

    def make(self, folder: str, seed: int) -> str:
        """Write the checkpoint to ``folder`` (new or empty) and return its path; the global
        random state is left as it was."""
        with torch.random.fork_rng():
            return make_tiny(
                "llama",
                folder,
                layers=self.layers,
                hidden=self.hidden,
                heads=self.heads,
                kv_heads=self.kv_heads,
                intermediate=self.intermediate,
                seed=seed,
                tokenizer="digits",
                init_std=self.init_std,
                max_positions=self.max_positions,
            )


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A user's Hugging Face checkpoint folder (any family orchestr loads), trained as it is:
    generators serve it on ``paged`` or ``vllm``, the trainer loads the same modules."""

    path: str

    def make(self, folder: str, seed: int) -> str:
        """The checkpoint's own folder: nothing is made."""
        return self.path
