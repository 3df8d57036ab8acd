"""Scored samples as the trainer takes them, laid out as tensors, sans-IO.

A sample is a :class:`~orchestr.roles.Completion` (or a dict of its fields) with a reward: a
``(completion, reward)`` pair, a dict with a ``reward`` key, or an object with a ``reward``
attribute. Beside ``prompt``, ``tokens``, ``sample_logprobs`` and ``version`` it may carry
``ref_logprobs`` (the frozen reference policy's log-prob of each completion token, for the KL
penalty) and ``finish_reason`` (``"length"``: cut off at its limit, for the overlong filter).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from orchestr.roles._common._rollout import Generation, pack

__all__ = ["Batch", "Row", "build_batch", "sample_row"]


@dataclasses.dataclass(frozen=True)
class Row:
    """One sample's fields, checked."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    version: int
    reward: float
    ref_logprobs: list[float] | None = None
    finish_reason: str | None = None


def sample_row(s: Any, need_reward: bool = True) -> Row:
    """The :class:`Row` of one sample. Raises ``ValueError`` for a sample without
    ``prompt``, ``tokens``, ``sample_logprobs`` or ``version``, without a numeric reward
    (when ``need_reward``), or whose ``ref_logprobs`` are not one per token."""
    reward: Any
    if isinstance(s, tuple | list) and len(s) == 2:
        s, reward = s
    elif isinstance(s, dict):
        reward = s.get("reward")
    else:
        reward = getattr(s, "reward", None)

    def get(key: str) -> Any:
        return s.get(key) if isinstance(s, dict) else getattr(s, key, None)

    prompt, tokens, logprobs, version = (
        get("prompt"),
        get("tokens"),
        get("sample_logprobs"),
        get("version"),
    )
    if prompt is None or tokens is None or logprobs is None or version is None:
        raise ValueError(
            "a sample needs prompt, tokens, sample_logprobs and version (a Completion does); "
            f"got {type(s).__name__}"
        )
    if not need_reward:
        reward = 0.0
    elif not isinstance(reward, int | float) or isinstance(reward, bool):
        raise ValueError(f"a sample needs a numeric reward, got {reward!r}")
    ref = get("ref_logprobs")
    if ref is not None:
        ref = [float(x) for x in ref]
        if len(ref) != len(tokens):
            raise ValueError(
                f"a sample has {len(tokens)} tokens but {len(ref)} ref_logprobs; give one "
                "reference log-prob per completion token"
            )
    finish = get("finish_reason")
    return Row(
        prompt=list(prompt),
        tokens=list(tokens),
        logprobs=[float(x) for x in logprobs],
        version=int(version),
        reward=float(reward),
        ref_logprobs=ref,
        finish_reason=None if finish is None else str(finish),
    )


@dataclasses.dataclass(frozen=True)
class Batch:
    """Rows as tensors: ``gen`` (:func:`~orchestr.roles._common._rollout.pack`'s layout),
    ``rewards[N]``, ``truncated[N]`` (finish reason ``"length"``) and ``ref_logprobs``
    (``[N, L]``, 0 past each row's end; None unless asked for)."""

    gen: Generation
    rewards: torch.Tensor
    truncated: torch.Tensor
    ref_logprobs: torch.Tensor | None


def build_batch(rows: Sequence[Row], pad_id: int, *, need_ref: bool = False) -> Batch:
    """Lay ``rows`` out as a :class:`Batch`. With ``need_ref`` every row must carry
    ``ref_logprobs``. Raises ``ValueError`` for a row without them then (naming the field
    and the sample), and what :func:`~orchestr.roles._common._rollout.pack` raises."""
    gen = pack(
        [r.prompt for r in rows],
        [r.tokens for r in rows],
        [r.logprobs for r in rows],
        pad_id=pad_id,
    )
    ref = None
    if need_ref:
        ref = torch.zeros_like(gen.logprobs)
        for i, r in enumerate(rows):
            if r.ref_logprobs is None:
                raise ValueError(
                    f"kl_coef > 0 needs ref_logprobs on every sample (the reference policy's "
                    f"log-prob of each completion token, like sample_logprobs); sample {i} has none"
                )
            ref[i, : len(r.ref_logprobs)] = torch.tensor(r.ref_logprobs, dtype=torch.float32)
    return Batch(
        gen=gen,
        rewards=torch.tensor([r.reward for r in rows], dtype=torch.float32),
        truncated=torch.tensor([r.finish_reason == "length" for r in rows], dtype=torch.bool),
        ref_logprobs=ref,
    )
