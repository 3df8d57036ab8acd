"""One GRPO update on a batch of completions: what the reference loop and the trainer both run.

The single-process reference (:mod:`orchestr.roles.rl._reference`) and the :class:`~._actor.Trainer` call the
same :func:`grpo_update` on the same :class:`~orchestr.roles._common._sampling.Generation` layout, so a trainer fed
the samples the reference drew takes bitwise the same steps. In data parallel each member
holds whole groups; every mean is divided by the token count of the *whole* batch and the
gradients are summed over the group, so the shards' sum is the whole batch's gradient (equal
to one process's up to float rounding in the sum's order).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from orchestr.roles._common._sampling import Generation, completion_logprobs

from ._grpo import grpo_loss

__all__ = ["LR_SCHEDULES", "UpdateConfig", "grpo_update", "rank_and_world", "scheduled_lr"]

#: ``constant``, or ``cosine``: from the base rate down to ``min_ratio`` of it over ``steps``.
LR_SCHEDULES = ("constant", "cosine")


def scheduled_lr(lr: float, version: int, schedule: str, steps: int, min_ratio: float) -> float:
    """The learning rate of the batch trained at ``version`` (0 for the first). Raises
    ``ValueError`` for an unknown schedule or bad bounds."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {schedule!r}")
    if steps < 1 or not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"lr steps must be >= 1 and min_ratio in [0, 1], got {steps}, {min_ratio}")
    if schedule == "constant":
        return lr
    done = min(max(version, 0), steps) / steps
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * done)))


_STAT_KEYS = (
    "loss", "ratio_mean", "clip_frac", "approx_kl", "entropy", "behaviour_weight", "logprob_gap"
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """How a batch is trained on: ``updates`` optimizer steps of the clipped surrogate
    (ratio clipped to ``1 ± clip_eps``, decoupled from the behaviour policy unless
    ``decoupled`` is False) minus ``entropy_coef`` times the mean next-token
    entropy, gradients clipped to ``max_grad_norm``; log-probs at ``temperature``."""

    updates: int = 4
    clip_eps: float = 0.2
    entropy_coef: float = 0.003
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    #: Clip against the weights before the batch's first update and weight each token by
    #: their ratio to the behaviour policy (AReaL's decoupled objective; :func:`~._grpo.grpo_loss`).
    decoupled: bool = True
    #: The most a token's behaviour weight (proximal / behaviour probability) may be.
    behaviour_weight_cap: float | None = 2.0

    def __post_init__(self) -> None:
        if self.updates < 1:
            raise ValueError(f"updates must be >= 1, got {self.updates}")
        if not (self.clip_eps > 0 and self.max_grad_norm > 0 and self.temperature > 0):
            raise ValueError("clip_eps, max_grad_norm and temperature must be positive")
        if self.behaviour_weight_cap is not None and not self.behaviour_weight_cap >= 1:
            raise ValueError(f"behaviour_weight_cap must be >= 1, got {self.behaviour_weight_cap}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the size of its ``torch.distributed`` group; ``(0, 1)``
    without one."""
    from torch import distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def grpo_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    gen: Generation,
    advantages: torch.Tensor,
    config: UpdateConfig,
) -> dict[str, float]:
    """``config.updates`` optimizer steps on ``gen`` with per-sample ``advantages``; returns
    the last step's statistics over the whole batch (``loss``, ``ratio_mean``, ``clip_frac``,
    ``approx_kl``, ``entropy``, ``grad_norm``, ``tokens``) and ``logprob_gap``: the mean
    absolute difference per token between the behaviour log-probs and this model's before the
    first step (on-policy, what separates the sampling engine's numbers from the trainer's).

    With an initialised ``torch.distributed`` group every member must call this together
    with its shard (collectives inside). Raises ``ValueError`` when no member has a token.
    """
    _, world = rank_and_world()
    device = next(iter(model.parameters()), torch.empty(0)).device
    gen = gen.to(device)
    advantages = advantages.to(device)
    mask = gen.mask
    total = mask.sum().to(torch.float64)
    if world > 1:
        from torch import distributed as dist

        dist.all_reduce(total)
    if float(total) == 0:
        raise ValueError("the batch has no completion tokens; there is nothing to train on")
    params = [p for p in model.parameters() if p.requires_grad]
    stats: dict[str, float] = {}
    model.train()
    proximal = None
    if config.decoupled:
        with torch.no_grad():
            proximal, _ = completion_logprobs(model, gen, config.temperature)
    gap = 0.0
    for i in range(config.updates):
        logp, entropy = completion_logprobs(model, gen, config.temperature)
        if i == 0:
            diff = torch.where(mask > 0, (logp.detach() - gen.logprobs).abs(), 0.0)
            gap = float(diff.sum() / total)
        loss, stats = grpo_loss(
            logp,
            gen.logprobs,
            advantages,
            mask,
            config.clip_eps,
            total_tokens=float(total),
            logp_proximal=proximal,
            behaviour_weight_cap=config.behaviour_weight_cap,
        )
        mean_entropy = entropy.sum() / float(total)
        if config.entropy_coef:
            loss = loss - config.entropy_coef * mean_entropy
        stats["entropy"] = float(mean_entropy.detach())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        if world > 1:
            _sum_gradients(params)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        optimizer.step()
    stats["logprob_gap"] = gap
    stats["grad_norm"] = float(grad_norm)
    stats["tokens"] = float(total)
    if world > 1:
        _sum_stats(stats, mask.device)
    return stats


def _sum_gradients(params: list[nn.Parameter]) -> None:
    """All-reduce (sum) every gradient as one flat bucket; a parameter this shard did not
    reach counts as zeros."""
    from torch import distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def _sum_stats(stats: dict[str, float], device: torch.device) -> None:
    from torch import distributed as dist

    vec = torch.tensor([stats[k] for k in _STAT_KEYS], dtype=torch.float64, device=device)
    dist.all_reduce(vec)
    stats.update(zip(_STAT_KEYS, vec.tolist(), strict=True))
