"""Advantage estimators, sans-IO but for one optional all-reduce: one advantage per sample.

Every estimator takes consecutive groups of ``group_size`` samples of one prompt (in order)
and their scalar rewards, and gives each sample one advantage that all of its completion
tokens share. ``scale`` multiplies the result: 1 to train, 0 or -1 for the controls.

- ``grpo``: ``(r - mean(group)) / (std(group) + eps)``, the population std (GRPO, Shao et
  al. 2024, "DeepSeekMath", arXiv:2402.03300).
- ``dr_grpo``: ``r - mean(group)``, no division by the std, which weighs groups whose rewards
  barely differ as much as clear ones (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like
  Training", arXiv:2503.20783).
- ``rloo``: ``r_i - mean(r_j, j != i)``, the leave-one-out baseline, unbiased since a sample
  does not take part in its own baseline (RLOO, Ahmadian et al. 2024, "Back to Basics",
  arXiv:2402.14740); needs groups of at least two.
- ``reinforce_pp``: ``r - mean(group)`` (0 for a group of one), then whitened over the whole
  batch's *tokens*: each sample's value counts once per completion token, and the result is
  ``(a - mean) / sqrt(var + 1e-8)`` with the unbiased variance, as verl's
  ``reinforce_plus_plus_baseline`` does (REINFORCE++, Hu 2025, arXiv:2501.03262). The mean
  and variance are the whole batch's: with an initialised ``torch.distributed`` group the
  shards' sums (of weights, of weighted values, of weighted squares) are all-reduced, so every
  member of a data-parallel mesh must call this together.
"""

from __future__ import annotations

import torch

__all__ = ["ADVANTAGE_ESTIMATORS", "batch_moments", "group_advantages", "whiten"]

#: The names :func:`group_advantages` (and ``UpdateConfig.advantage``) take.
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp")

#: Inside the square root of the whitening, as verl's ``masked_whiten`` has it.
WHITEN_EPS = 1e-8


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    eps: float = 1e-4,
    scale: float = 1.0,
    *,
    estimator: str = "grpo",
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[N]`` advantages of ``rewards[N]`` (``N / group_size`` groups, each the samples of one
    prompt, in order) by ``estimator`` (one of :data:`ADVANTAGE_ESTIMATORS`; the module
    docstring gives each one's formula), times ``scale``.

    ``grpo``: a group whose samples all scored the same gets advantage 0; ``eps`` keeps the
    division finite. ``weights[N]`` (``reinforce_pp`` only; default all 1) is the number of
    completion tokens each sample has in the loss, what the batch whitening counts it by.

    Blocks on one all-reduce for ``reinforce_pp`` in a ``torch.distributed`` group (every
    member calls it together); the other estimators are pure. Raises ``ValueError`` when ``N``
    is not a multiple of ``group_size``, for an unknown estimator, for ``rloo`` with groups of
    one, or for ``weights`` of the wrong shape.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be one-dimensional, got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size}; "
            "pass every sample of every prompt, grouped by prompt"
        )
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"advantage must be one of {', '.join(ADVANTAGE_ESTIMATORS)}, got {estimator!r}"
        )
    groups = rewards.float().view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        std = groups.std(dim=1, keepdim=True, correction=0)
        return (scale * (groups - mean) / (std + eps)).view(-1)
    if estimator == "dr_grpo":
        return (scale * (groups - mean)).view(-1)
    if estimator == "rloo":
        if group_size < 2:
            raise ValueError("advantage 'rloo' needs groups of at least 2 (a leave-one-out mean)")
        others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
        return (scale * (groups - others)).view(-1)
    # reinforce_pp: a lone sample has no group to compare with; verl gives it baseline 0
    centred = (groups - mean if group_size > 1 else groups).reshape(-1)
    if weights is None:
        weights = torch.ones_like(centred)
    if weights.shape != centred.shape:
        raise ValueError(f"weights must be [N] = [{centred.numel()}], got {tuple(weights.shape)}")
    return scale * whiten(centred, weights, batch_moments(centred, weights))


def batch_moments(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[3]`` float64: ``(sum w, sum w*v, sum w*v**2)`` of this shard, summed over the
    ``torch.distributed`` group when one is initialised (an all-reduce every member joins)."""
    w = weights.to(torch.float64)
    v = values.detach().to(torch.float64)
    moments = torch.stack([w.sum(), (w * v).sum(), (w * v * v).sum()])
    from torch import distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(moments)
    return moments


def whiten(values: torch.Tensor, weights: torch.Tensor, moments: torch.Tensor) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with the weighted mean and unbiased variance
    that ``moments`` (:func:`batch_moments`) hold; 0 where ``weights`` is 0, and all 0 when the
    batch counts at most one token (no spread to measure). Pure."""
    count, total, squares = (float(x) for x in moments)
    if count <= 1:
        return torch.zeros_like(values, dtype=torch.float32)
    mean = total / count
    # the unbiased (Bessel-corrected) variance over tokens, as verl's masked_var
    var = max(squares / count - mean * mean, 0.0) * count / (count - 1)
    out = (values.float() - mean) / (var + WHITEN_EPS) ** 0.5
    return torch.where(weights > 0, out, 0.0)
