"""One GRPO update on a batch of completions: what the reference loop and the trainer both run.

The single-process reference (:mod:`orchestr.roles.rl._reference`) and the :class:`~._actor.Trainer` call the
same :func:`grpo_update` on the same :class:`~orchestr.roles._common._rollout.Generation` layout, so a trainer fed
the samples the reference drew takes bitwise the same steps. In data parallel each member
holds whole groups; every mean is divided by the token (or sequence) count of the *whole*
batch and the gradients are summed over the group, so the shards' sum is the whole batch's
gradient (equal to one process's up to float rounding in the sum's order).

:class:`UpdateConfig` holds the algorithm's options, each off by default (the defaults are
GRPO as the reference runs it): the advantage estimator (:mod:`._advantages`), clip-higher,
the loss's aggregation and a KL penalty against a reference policy (:mod:`._grpo`), DAPO's
overlong filter (samples cut off at their length limit leave the loss; Yu et al. 2025,
arXiv:2503.14476) and micro-batches with gradient accumulation (:mod:`._micro`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from orchestr.roles._common._rollout import Generation, completion_logprobs, forward_groups

from ._advantages import ADVANTAGE_ESTIMATORS
from ._grpo import KL_ESTIMATORS, LOSS_AGGREGATIONS, aggregate, grpo_loss, kl_penalty
from ._micro import Part, split
from ._sharding import is_sharded, plan_passes, summed, to_float

__all__ = ["UpdateConfig", "autocast", "grpo_update", "rank_and_world", "sum_gradients"]


_STAT_KEYS = (
    "loss",
    "ratio_mean",
    "clip_frac",
    "approx_kl",
    "entropy",
    "behaviour_weight",
    "logprob_gap",
)
_OPTIONAL_STAT_KEYS = ("kl", "overlong_filtered")


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """How a batch is trained on: ``updates`` optimizer steps of the clipped surrogate
    (ratio clipped to ``[1 - clip_eps, 1 + clip_eps_high]``, decoupled from the behaviour
    policy unless ``decoupled`` is False) minus ``entropy_coef`` times the mean next-token
    entropy, plus ``kl_coef`` times the KL to a reference policy, gradients clipped to
    ``max_grad_norm``; log-probs at ``temperature``. Raises ``ValueError`` naming the field
    for a value out of range."""

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
    #: The advantage estimator (:data:`~._advantages.ADVANTAGE_ESTIMATORS`): ``grpo``,
    #: ``dr_grpo``, ``rloo`` or ``reinforce_pp`` (:func:`~._advantages.group_advantages`).
    advantage: str = "grpo"
    #: The ratio's upper clip, ``1 + clip_eps_high`` (DAPO's clip-higher); None: ``clip_eps``.
    clip_eps_high: float | None = None
    #: ``token_mean``, ``seq_mean_token_mean`` or ``seq_mean_token_sum``
    #: (:func:`~._grpo.aggregate`); the entropy bonus and the KL penalty aggregate alike.
    loss_agg: str = "token_mean"
    #: The weight of the KL penalty against the reference policy's log-probs (0: none).
    kl_coef: float = 0.0
    #: ``k1``, ``k2`` or ``k3`` (:func:`~._grpo.kl_penalty`).
    kl_estimator: str = "k3"
    #: Leave samples that hit their length limit (``finish_reason == "length"``) out of the
    #: loss (DAPO's overlong filtering); they still count in their group's advantages.
    overlong_filter: bool = False
    #: Run each update in micro-batches of whole samples of at most this many padded tokens
    #: (rows times the widest row), summing gradients; None: the whole batch in one pass.
    micro_batch_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.updates < 1:
            raise ValueError(f"updates must be >= 1, got {self.updates}")
        if not (self.clip_eps > 0 and self.max_grad_norm > 0 and self.temperature > 0):
            raise ValueError("clip_eps, max_grad_norm and temperature must be positive")
        if self.behaviour_weight_cap is not None and not self.behaviour_weight_cap >= 1:
            raise ValueError(f"behaviour_weight_cap must be >= 1, got {self.behaviour_weight_cap}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")
        _one_of("advantage", self.advantage, ADVANTAGE_ESTIMATORS)
        _one_of("loss_agg", self.loss_agg, LOSS_AGGREGATIONS)
        _one_of("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if self.clip_eps_high is not None and not self.clip_eps_high > 0:
            raise ValueError(
                f"clip_eps_high must be positive, or None for clip_eps, got {self.clip_eps_high}"
            )
        if not self.kl_coef >= 0:
            raise ValueError(
                f"kl_coef must be >= 0 (0 turns the KL penalty off), got {self.kl_coef}"
            )
        if not isinstance(self.overlong_filter, bool):
            raise ValueError(f"overlong_filter must be True or False, got {self.overlong_filter!r}")
        mbt = self.micro_batch_tokens
        if mbt is not None and (isinstance(mbt, bool) or not isinstance(mbt, int) or mbt < 1):
            raise ValueError(
                f"micro_batch_tokens must be an int >= 1, or None for the whole batch, got {mbt!r}"
            )


def _one_of(field: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{field} must be one of {', '.join(allowed)}, got {value!r}")


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the size of its ``torch.distributed`` group; ``(0, 1)``
    without one."""
    from torch import distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def autocast(
    device: torch.device, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager[object]:
    """``torch.autocast`` to ``dtype`` on ``device``'s kind for a training forward pass; a
    context that does nothing for ``dtype`` None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grpo_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    gen: Generation,
    advantages: torch.Tensor,
    config: UpdateConfig,
    *,
    ref_logprobs: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """``config.updates`` optimizer steps on ``gen`` with per-sample ``advantages``; returns
    the last step's statistics over the whole batch (``loss``, ``ratio_mean``, ``clip_frac``,
    ``approx_kl``, ``entropy``, ``behaviour_weight``, ``grad_norm``, ``tokens``; ``kl`` with
    a KL penalty, ``overlong_filtered`` (samples left out) with the overlong filter) and
    ``logprob_gap``: the mean absolute difference per token between the behaviour log-probs
    and this model's before the first step (on-policy, what separates the sampling engine's
    numbers from the trainer's). Every statistic but ``loss`` is a mean over tokens.

    ``ref_logprobs`` (``[N, L]`` like ``gen.logprobs``, 0 past each row's end): the frozen
    reference policy's log-probs, needed when ``config.kl_coef > 0``. ``truncated`` (``[N]``
    bool): which samples hit their length limit, left out of the loss when
    ``config.overlong_filter``. ``autocast_dtype`` (say ``torch.bfloat16``) runs the forward
    passes under ``torch.autocast`` on the model's device; the weights, the gradients and the
    loss's arithmetic stay in their own dtype.

    With an initialised ``torch.distributed`` group every member must call this together
    with its shard (collectives inside). Raises ``ValueError`` when no member has a token in
    the loss, or for a missing or misshapen ``ref_logprobs`` or ``truncated``.
    """
    _, world = rank_and_world()
    device = next(iter(model.parameters()), torch.empty(0)).device
    gen = gen.to(device)
    advantages = advantages.to(device)
    mask = gen.mask
    n = mask.shape[0]
    filtered = 0.0
    if config.overlong_filter and truncated is not None:
        if truncated.shape != (n,):
            raise ValueError(f"truncated must be [N] = [{n}], got {tuple(truncated.shape)}")
        cut = truncated.to(device=device, dtype=torch.bool)
        mask = mask & ~cut[:, None]
        filtered = float(cut.sum())
    if config.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError(
                "kl_coef > 0 needs ref_logprobs: the reference policy's log-prob of each "
                "completion token"
            )
        if ref_logprobs.shape != gen.logprobs.shape:
            raise ValueError(
                f"ref_logprobs {tuple(ref_logprobs.shape)} must have the shape of the "
                f"behaviour log-probs {tuple(gen.logprobs.shape)}"
            )
        ref_logprobs = ref_logprobs.to(device=device, dtype=torch.float32)
    else:
        ref_logprobs = None
    # the whole batch's tokens and sequences in the loss: every mean's divisor
    counts = torch.stack([mask.sum(), mask.any(-1).sum()]).to(torch.float64)
    if world > 1:
        from torch import distributed as dist

        dist.all_reduce(counts)
    total, seqs = counts[0], float(counts[1])
    if float(total) == 0:
        raise ValueError("the batch has no completion tokens; there is nothing to train on")
    params = [p for p in model.parameters() if p.requires_grad]
    parts = split(gen, advantages, mask, ref_logprobs, config.micro_batch_tokens)

    def forward() -> contextlib.AbstractContextManager[object]:
        return autocast(device, autocast_dtype)

    model.train()
    # a sharded model's ranks call it as often as each other: the extra calls count nothing
    passes = plan_passes(parts, model, lambda p: forward_groups(p.gen))
    proximal: list[torch.Tensor | None] = [None] * len(parts)
    if config.decoupled:
        with torch.no_grad():
            for j, (maybe, calls) in enumerate(passes):
                with forward():
                    logp, _ = completion_logprobs(
                        model, (maybe or parts[0]).gen, config.temperature, calls=calls
                    )
                if maybe is not None:
                    proximal[j] = logp
    gap = 0.0
    stats: dict[str, float] = {}
    for i in range(config.updates):
        optimizer.zero_grad(set_to_none=True)
        for j, (maybe, calls) in enumerate(passes):
            if maybe is None:
                with forward():
                    logp, _ = completion_logprobs(
                        model, parts[0].gen, config.temperature, calls=calls
                    )
                (logp.sum() * 0).backward()  # type: ignore[no-untyped-call]
                continue
            part = maybe
            with forward():
                logp, entropy = completion_logprobs(
                    model, part.gen, config.temperature, calls=calls
                )
            if i == 0:
                diff = torch.where(part.mask > 0, (logp.detach() - part.gen.logprobs).abs(), 0.0)
                g = float(diff.sum() / total)
                gap = g if j == 0 else gap + g
            loss, part_stats = _part_loss(
                config, part, logp, entropy, proximal[j], float(total), seqs
            )
            loss.backward()  # type: ignore[no-untyped-call]
            # one part: its stats as they are (adding them to 0.0 could flip a zero's sign)
            stats = part_stats if j == 0 else {k: stats[k] + v for k, v in part_stats.items()}
        if world > 1 and not is_sharded(model):
            sum_gradients(params)
        elif world > 1:
            summed(params, world)  # a sharded model's backward reduced them, to a mean
        grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        optimizer.step()
    stats["logprob_gap"] = gap
    stats["grad_norm"] = to_float(grad_norm)
    stats["tokens"] = float(total)
    if config.overlong_filter:
        stats["overlong_filtered"] = filtered
    if world > 1:
        _sum_stats(stats, mask.device)
    return stats


def _part_loss(
    config: UpdateConfig,
    part: Part,
    logp: torch.Tensor,
    entropy: torch.Tensor,
    proximal: torch.Tensor | None,
    total: float,
    seqs: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch (its share of the whole batch's) and its statistics."""
    loss, stats = grpo_loss(
        logp,
        part.gen.logprobs,
        part.advantages,
        part.mask,
        config.clip_eps,
        total_tokens=total,
        logp_proximal=proximal,
        behaviour_weight_cap=config.behaviour_weight_cap,
        clip_eps_high=config.clip_eps_high,
        loss_agg=config.loss_agg,
        total_seqs=seqs,
    )
    m = part.mask.to(logp.dtype)
    # entropy is 0 outside the completions already: the mask only drops filtered samples
    mean_entropy = aggregate(entropy, m, config.loss_agg, total, seqs)
    if config.entropy_coef:
        loss = loss - config.entropy_coef * mean_entropy
    if config.loss_agg != "token_mean":
        mean_entropy = aggregate(entropy.detach(), m, "token_mean", total, seqs)
    stats["entropy"] = float(mean_entropy.detach())
    if part.ref is not None:
        # 0 outside the loss's tokens, before exp: no inf there to poison the gradient
        ref = torch.where(part.mask, part.ref, logp.detach())
        kl = kl_penalty(logp, ref, config.kl_estimator)
        loss = loss + config.kl_coef * aggregate(kl, m, config.loss_agg, total, seqs)
        stats["kl"] = float(aggregate(kl.detach(), m, "token_mean", total, seqs))
    return loss, stats


def sum_gradients(params: list[nn.Parameter]) -> None:
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
    """Sum the shards' additive statistics (each already divided by the whole batch's count);
    every member has the same keys, as they share one config."""
    from torch import distributed as dist

    keys = [k for k in (*_STAT_KEYS, *_OPTIONAL_STAT_KEYS) if k in stats]
    vec = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(vec)
    stats.update(zip(keys, vec.tolist(), strict=True))
