"""GRPO's math, sans-IO: group-normalised advantages and the clipped surrogate loss.

Nothing here knows about models, processes or versions; the trainer feeds it tensors. The
loss is PPO's clipped objective with the behaviour log-probs the generator recorded as the
old policy, and one advantage per sample shared by all of its completion tokens.
"""

from __future__ import annotations

import torch

__all__ = ["group_advantages", "grpo_loss"]


def group_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-4, scale: float = 1.0
) -> torch.Tensor:
    """``scale * (r - mean(group)) / (std(group) + eps)`` for consecutive groups of samples.

    ``rewards[N]`` holds ``N / group_size`` groups, each the samples of one prompt, in order.
    The standard deviation is the population one (``correction=0``); a group whose samples all
    scored the same gets advantage 0. ``scale`` is 1 for training and 0 or -1 for the
    controls. Raises ``ValueError`` when ``N`` is not a multiple of ``group_size``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be one-dimensional, got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size}; "
            "pass every sample of every prompt, grouped by prompt"
        )
    groups = rewards.float().view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True, correction=0)
    return (scale * (groups - mean) / (std + eps)).view(-1)


def grpo_loss(
    logp_new: torch.Tensor,
    logp_behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    total_tokens: float | None = None,
    logp_proximal: torch.Tensor | None = None,
    behaviour_weight_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped-ratio policy loss, averaged over every completion token in the batch.

    ``logp_new``/``logp_behaviour``/``mask``: ``[N, L]``; ``advantages``: ``[N]``. Per token,
    ``ratio = exp(logp_new - logp_behaviour)`` and the objective is
    ``min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)``; the loss is minus its mean over the
    tokens ``mask`` selects (a token-level mean, so long answers weigh more than short ones,
    as their tokens are more). Gradients flow through ``logp_new`` only.

    Stats (floats): ``loss``, ``ratio_mean``, ``clip_frac`` (tokens whose ratio left the clip
    range), ``approx_kl`` (mean of ``logp_behaviour - logp_new``), ``tokens``.

    ``logp_proximal`` (``[N, L]``) turns on AReaL's decoupled objective for off-policy
    samples: the ratio and its clip are taken against the proximal policy (the trainer's
    weights before this batch's first update) and each token is weighted by the detached
    ``exp(logp_proximal - logp_behaviour)``, so a stale behaviour policy corrects the estimate
    without using up the trust region. With on-policy samples the two coincide.
    ``behaviour_weight_cap`` truncates that weight: a token the policy has come to like far
    more than when it was sampled counts at most that many times (less variance from very
    stale samples).

    ``total_tokens`` (default: this batch's) is the divisor of every mean. A data-parallel
    shard passes the whole batch's count, so summing the shards' losses, gradients and stats
    gives the whole batch's.
    Raises ``ValueError`` on mismatched shapes or an empty mask.
    """
    if logp_new.shape != logp_behaviour.shape or logp_new.shape != mask.shape:
        raise ValueError(
            f"logp_new {tuple(logp_new.shape)}, logp_behaviour {tuple(logp_behaviour.shape)} "
            f"and mask {tuple(mask.shape)} must have one shape [N, L]"
        )
    if advantages.shape != logp_new.shape[:1]:
        raise ValueError(
            f"advantages must be [N] = [{logp_new.shape[0]}], got {tuple(advantages.shape)}"
        )
    m = mask.to(logp_new.dtype)
    local = m.sum()
    if float(local) == 0 and total_tokens is None:
        raise ValueError("the mask selects no completion tokens; there is nothing to train on")
    if total_tokens is not None and not total_tokens >= float(local):
        raise ValueError(
            f"total_tokens ({total_tokens}) is less than this batch's ({float(local)})"
        )
    tokens = (
        local
        if total_tokens is None
        else torch.tensor(float(total_tokens), dtype=m.dtype, device=m.device)
    )
    behaviour = logp_behaviour.detach()
    if logp_proximal is None:
        anchor, weight = behaviour, None
    else:
        if logp_proximal.shape != logp_new.shape:
            raise ValueError(
                f"logp_proximal {tuple(logp_proximal.shape)} must have shape {tuple(logp_new.shape)}"
            )
        anchor = logp_proximal.detach()
        weight = torch.exp((anchor - behaviour) * m)  # 1 where masked out
        if behaviour_weight_cap is not None:
            weight = weight.clamp(max=behaviour_weight_cap)
    ratio = torch.exp(logp_new - anchor)
    adv = advantages.detach().to(logp_new.dtype)[:, None]
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    objective = torch.minimum(ratio * adv, clipped * adv)
    if weight is not None:
        objective = objective * weight
    loss = -(objective * m).sum() / tokens
    with torch.no_grad():
        outside = ((ratio < 1.0 - clip_eps) | (ratio > 1.0 + clip_eps)).to(m.dtype)
        stats = {
            "loss": float(loss.detach()),
            "ratio_mean": float((ratio.detach() * m).sum() / tokens),
            "clip_frac": float((outside * m).sum() / tokens),
            "approx_kl": float(((behaviour - logp_new.detach()) * m).sum() / tokens),
            "behaviour_weight": 1.0 if weight is None else float((weight * m).sum() / tokens),
            "tokens": float(local),
        }
    return loss, stats
