"""GRPO's math, sans-IO: the clipped surrogate loss, its aggregation and the KL penalty.

Nothing here knows about models, processes or versions; the trainer feeds it tensors. The
loss is PPO's clipped objective with the behaviour log-probs the generator recorded as the
old policy, and one advantage per sample shared by all of its completion tokens (the
estimators are in :mod:`._advantages`). The options, each off by default:

- ``clip_eps_high``: clip-higher, the ratio clipped to ``[1 - clip_eps, 1 + clip_eps_high]``
  so unlikely tokens with a positive advantage can gain more before the clip (DAPO, Yu et al.
  2025, arXiv:2503.14476).
- ``loss_agg`` (:data:`LOSS_AGGREGATIONS`): ``token_mean`` averages over every token of the
  batch, so long answers weigh by their length (DAPO's token-level loss);
  ``seq_mean_token_mean`` averages within each sequence, then over sequences (the original
  GRPO's); ``seq_mean_token_sum`` sums within each sequence, then averages over sequences
  (Dr. GRPO's length-unbiased sum, Liu et al. 2025, arXiv:2503.20783, without its constant).
- :func:`kl_penalty` against a frozen reference policy, by Schulman's estimators
  (:data:`KL_ESTIMATORS`; "Approximating KL Divergence", 2020): ``k1 = logp - ref``,
  ``k2 = (logp - ref)**2 / 2``, ``k3 = exp(ref - logp) - (ref - logp) - 1``, the unbiased,
  always positive, low-variance one GRPO uses.

Every mean divides by a count the caller may give (``total_tokens``, ``total_seqs``): a
data-parallel shard or a micro-batch passes the whole batch's, so the parts' losses,
gradients and statistics sum to the whole batch's.
"""

from __future__ import annotations

import torch

# group_advantages lived here before the estimators had a module of their own; tests of
# other packages' private modules still import it from here
from ._advantages import group_advantages

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "aggregate",
    "group_advantages",
    "grpo_loss",
    "kl_penalty",
]

#: How per-token values become one loss (``UpdateConfig.loss_agg``).
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")

#: Estimators of KL(policy || reference) per token (``UpdateConfig.kl_estimator``).
KL_ESTIMATORS = ("k1", "k2", "k3")


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    tokens: torch.Tensor | float,
    seqs: torch.Tensor | float,
) -> torch.Tensor:
    """``values[N, L]`` over the tokens ``mask`` (float, 0 or 1) selects, as one scalar by
    ``mode`` (one of :data:`LOSS_AGGREGATIONS`): ``token_mean`` is their sum over ``tokens``;
    ``seq_mean_token_mean`` is the sum of each row's mean over ``seqs``;
    ``seq_mean_token_sum`` is the sum of each row's sum over ``seqs``. A row without a token
    adds nothing. Differentiable; raises ``ValueError`` for an unknown mode."""
    if mode == "token_mean":
        return (values * mask).sum() / tokens
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_agg must be one of {', '.join(LOSS_AGGREGATIONS)}, got {mode!r}")
    per_seq = (values * mask).sum(-1)
    if mode == "seq_mean_token_mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / seqs


def kl_penalty(logp: torch.Tensor, ref: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per token, an estimate of KL(policy || reference) from the policy's log-probs ``logp``
    of sampled tokens and the reference's ``ref`` (same shape), by ``estimator`` (one of
    :data:`KL_ESTIMATORS`; the module docstring gives each one). Gradients flow through
    ``logp`` only. Raises ``ValueError`` for mismatched shapes or an unknown estimator."""
    if logp.shape != ref.shape:
        raise ValueError(
            f"ref_logprobs {tuple(ref.shape)} must have the log-probs' shape {tuple(logp.shape)}"
        )
    diff = ref.detach().to(logp.dtype) - logp
    if estimator == "k1":
        return -diff
    if estimator == "k2":
        return 0.5 * diff * diff
    if estimator == "k3":
        return torch.exp(diff) - diff - 1.0
    raise ValueError(f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")


def grpo_loss(
    logp_new: torch.Tensor,
    logp_behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    total_tokens: float | None = None,
    logp_proximal: torch.Tensor | None = None,
    behaviour_weight_cap: float | None = None,
    *,
    clip_eps_high: float | None = None,
    loss_agg: str = "token_mean",
    total_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped-ratio policy loss over the completion tokens ``mask`` selects.

    ``logp_new``/``logp_behaviour``/``mask``: ``[N, L]``; ``advantages``: ``[N]``. Per token,
    ``ratio = exp(logp_new - logp_behaviour)`` and the objective is
    ``min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A)`` (``clip_eps_high``
    defaults to ``clip_eps``); the loss is minus its aggregate by ``loss_agg``
    (:func:`aggregate`; by default the mean over every token, so long answers weigh more than
    short ones, as their tokens are more). Gradients flow through ``logp_new`` only.

    Stats (floats; means over tokens whatever ``loss_agg``): ``loss``, ``ratio_mean``,
    ``clip_frac`` (tokens whose ratio left the clip range), ``approx_kl`` (mean of
    ``logp_behaviour - logp_new``), ``behaviour_weight``, ``tokens`` (this batch's).

    ``logp_proximal`` (``[N, L]``) turns on AReaL's decoupled objective for off-policy
    samples: the ratio and its clip are taken against the proximal policy (the trainer's
    weights before this batch's first update) and each token is weighted by the detached
    ``exp(logp_proximal - logp_behaviour)``, so a stale behaviour policy corrects the estimate
    without using up the trust region. With on-policy samples the two coincide.
    ``behaviour_weight_cap`` truncates that weight: a token the policy has come to like far
    more than when it was sampled counts at most that many times (less variance from very
    stale samples).

    ``total_tokens`` and ``total_seqs`` (default: this batch's tokens, and rows with a token)
    are the divisors of the means over tokens and over sequences. A data-parallel shard or a
    micro-batch passes the whole batch's, so summing the parts' losses, gradients and stats
    gives the whole batch's.
    Raises ``ValueError`` on mismatched shapes, an empty mask, or a total below this batch's.
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
    seqs: torch.Tensor | float = 1.0
    if loss_agg != "token_mean":
        local_seqs = (m.sum(-1) > 0).sum().to(m.dtype)
        if total_seqs is not None and not total_seqs >= float(local_seqs):
            raise ValueError(
                f"total_seqs ({total_seqs}) is less than this batch's ({float(local_seqs)})"
            )
        seqs = local_seqs if total_seqs is None else float(total_seqs)
    high = clip_eps if clip_eps_high is None else clip_eps_high
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
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + high)
    objective = torch.minimum(ratio * adv, clipped * adv)
    if weight is not None:
        objective = objective * weight
    loss = -aggregate(objective, m, loss_agg, tokens, seqs)
    with torch.no_grad():
        outside = ((ratio < 1.0 - clip_eps) | (ratio > 1.0 + high)).to(m.dtype)
        stats = {
            "loss": float(loss.detach()),
            "ratio_mean": float((ratio.detach() * m).sum() / tokens),
            "clip_frac": float((outside * m).sum() / tokens),
            "approx_kl": float(((behaviour - logp_new.detach()) * m).sum() / tokens),
            # without weights, this part's share of the tokens: the parts' sum is 1
            "behaviour_weight": float((m if weight is None else weight * m).sum() / tokens),
            "tokens": float(local),
        }
    return loss, stats
