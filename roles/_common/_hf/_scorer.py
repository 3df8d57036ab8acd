"""Reward models: a Hugging Face ``...ForSequenceClassification`` checkpoint with one label,
in orchestr's own decoder (:class:`~._layers.Decoder`) plus its linear score head.

The layout is transformers': the decoder's tensors as a causal LM names them
(``model.layers.0.self_attn.q_proj.weight``...) and ``score.weight`` ``[num_labels, hidden]``
without a bias, no ``lm_head``. A sequence's score is the head applied to the final hidden
state (after the last norm) of its last token. transformers finds that token as the rightmost
one that is not ``pad_token_id``; here it is the last of each sequence's own length, which is
the same token unless a sequence ends in the padding id (a checkpoint whose pad token is its
EOS, scoring text that ends in EOS): transformers would then score an earlier token.

Supported: :data:`ARCHITECTURES` (the families orchestr runs whose transformers class exists).
Nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import orchestr as oc

from ._config import ModelConfig, read_raw_config
from ._layers import Decoder
from ._load import read_weights

__all__ = ["ARCHITECTURES", "HEAD", "RewardModel", "load_reward_model", "num_labels"]

#: ``architectures`` entry -> the ``model_type`` it must have.
ARCHITECTURES = {
    "LlamaForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "qwen2",
}
#: The score head's tensor in the checkpoint (the module names it ``head``: ``score`` is the
#: method).
HEAD = "score.weight"


class RewardModel(nn.Module):
    """A decoder and a one-output linear head: :meth:`score` gives one float per token
    sequence. Built by :func:`load_reward_model`, in eval mode."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.head = nn.Linear(cfg.hidden_size, 1, bias=False)

    @property
    def max_length(self) -> int:
        """The longest sequence it scores: the config's ``max_position_embeddings``."""
        return self.config.max_position_embeddings

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Scores ``[batch]`` of right-padded ``tokens`` ``[batch, seq]``, each row read at
        position ``lengths[row] - 1``."""
        hidden = self.model(tokens, lengths)
        last = hidden[torch.arange(tokens.shape[0], device=tokens.device), lengths - 1]
        out: torch.Tensor = self.head(last)[:, 0]
        return out

    def check(self, ids: Sequence[int]) -> None:
        """Raises ``ValueError`` when ``ids`` cannot be scored: empty, longer than
        :attr:`max_length`, or an id outside the model's vocabulary."""
        if not ids:
            raise ValueError("nothing to score: the sequence has no tokens")
        if len(ids) > self.max_length:
            raise ValueError(
                f"{len(ids)} tokens, over the model's {self.max_length} positions "
                f"(max_position_embeddings): cut the sequence first"
            )
        vocab = self.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(
                f"token id {bad} is outside the model's vocabulary of {vocab}; is the "
                f"tokenizer this checkpoint's own?"
            )

    def score(self, token_id_lists: Sequence[Sequence[int]]) -> list[float]:
        """One score per sequence, in order, as float32 values, computed in one right-padded
        batch without gradients (batching is the caller's: the memory is one batch's).
        Raises ``ValueError`` naming the first sequence :meth:`check` refuses (nothing runs
        then). Blocks the calling thread for the forward pass; not cancel-safe (a thread)."""
        if not token_id_lists:
            return []
        for i, ids in enumerate(token_id_lists):
            try:
                self.check(ids)
            except ValueError as exc:
                raise ValueError(f"sequence {i}: {exc}") from None
        device = self.head.weight.device
        width = max(len(ids) for ids in token_id_lists)
        rows = [list(ids) + [0] * (width - len(ids)) for ids in token_id_lists]
        tokens = torch.tensor(rows, dtype=torch.long, device=device)
        lengths = torch.tensor([len(ids) for ids in token_id_lists], device=device)
        with torch.inference_mode():
            scores = self(tokens, lengths).float().cpu()
        return [float(x) for x in scores.tolist()]


def num_labels(raw: dict[str, Any]) -> int | None:
    """How many outputs the head of this config has, as transformers reads it: ``num_labels``
    when given, else the size of ``id2label``; None when neither is there (transformers then
    takes 2)."""
    given = raw.get("num_labels")
    if isinstance(given, int) and not isinstance(given, bool):
        return given
    labels = raw.get("id2label")
    return len(labels) if isinstance(labels, dict) else None


def load_reward_model(
    folder: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> RewardModel:
    """The reward model in ``folder`` (``config.json`` and safetensors weights, one file or
    sharded) in ``dtype`` on ``device``, in eval mode. Raises :class:`orchestr.ConfigError`
    naming the file and what is wrong for: an ``architectures`` other than one of
    :data:`ARCHITECTURES` (a causal LM included), a ``model_type`` that does not match it, a
    head of other than one label, a config orchestr cannot run, or weights that do not match
    it. Blocks while it reads the weights."""
    folder = os.fspath(folder)
    raw, path = read_raw_config(folder)
    archs = raw.get("architectures")
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else archs
    supported = ", ".join(ARCHITECTURES)
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        what = (
            "a causal LM (its head predicts tokens), not a reward model"
            if isinstance(arch, str) and arch.endswith("ForCausalLM")
            else "not a reward model orchestr loads"
        )
        raise oc.ConfigError(
            f"{path}: architectures is {archs!r:.120}: {what}; a reward model is a one-label "
            f"sequence classifier, one of {supported}"
        )
    if raw.get("model_type") != ARCHITECTURES[arch]:
        raise oc.ConfigError(
            f"{path}: architectures is {arch} but model_type is {raw.get('model_type')!r}; "
            f"{arch} has model_type {ARCHITECTURES[arch]!r}"
        )
    labels = num_labels(raw)
    if labels != 1:
        got = "no num_labels or id2label (transformers takes 2)" if labels is None else labels
        raise oc.ConfigError(
            f"{path}: a reward model has one label (num_labels 1: one score per sequence), "
            f"got {got}; a classifier of several labels is not a reward model"
        )
    cfg = ModelConfig.from_dict(raw, path)
    with torch.device("meta"):
        model = RewardModel(cfg)
    names = {_checkpoint_name(k): tuple(v.shape) for k, v in model.state_dict().items()}
    state = read_weights(folder, names, f"{arch} ({cfg.model_type})", dtype=dtype, device=device)
    model.load_state_dict({_module_name(k): v for k, v in state.items()}, assign=True)
    return model.eval()


def _checkpoint_name(key: str) -> str:
    return HEAD if key == "head.weight" else key


def _module_name(name: str) -> str:
    return "head.weight" if name == HEAD else name
