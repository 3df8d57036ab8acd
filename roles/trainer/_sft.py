"""Supervised fine-tuning: the negative log-likelihood of given responses, and one optimizer
step on it, on the layout GRPO's update uses.

A sample is a prompt and a response (token ids). The loss is the mean negative log-likelihood
of the response's tokens alone: the prompt conditions them and is not learnt (its tokens are no
targets). The mean is over every response token of the batch (token-mean), so a long response
weighs as many short ones together. Samples are laid out as a generator's completions are
(:func:`~orchestr.roles._common._rollout.pack`: prompts left-padded, responses from one
column) and scored by the same :func:`~orchestr.roles._common._rollout.completion_logprobs`
GRPO's update runs, micro-batched alike (:mod:`._micro`).

In data parallel each member holds a share of the batch; the loss divides by the token count
of the *whole* batch and the gradients are summed over the group (:func:`~._update.grpo_update`
does the same), so the shards' sum is the whole batch's step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from orchestr.roles._common._rollout import Generation, completion_logprobs, forward_groups, pack

from ._micro import split
from ._sharding import is_sharded, plan_passes, summed, to_float
from ._update import UpdateConfig, autocast, rank_and_world, sum_gradients

__all__ = ["sft_batch", "sft_evaluate", "sft_loss", "sft_update"]


def sft_loss(
    logprobs: torch.Tensor, mask: torch.Tensor, total_tokens: float | None = None
) -> torch.Tensor:
    """The token-mean negative log-likelihood: minus the sum of ``logprobs`` (``[N, L]``, each
    target token's log-prob) where ``mask`` (``[N, L]`` bool: the response tokens) is set,
    divided by ``total_tokens`` (default: the mask's count; in data parallel or over
    micro-batches, the whole batch's). Differentiable; nothing outside the mask reaches the
    value or the gradient (not even an infinite log-prob). Pure. Raises ``ValueError`` for
    mismatched shapes or a total that is not positive."""
    if logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and mask {tuple(mask.shape)} differ in shape"
        )
    total = float(mask.sum()) if total_tokens is None else float(total_tokens)
    if not total > 0:
        raise ValueError(f"the loss needs at least one response token, got a total of {total}")
    # where, not a product: 0 * -inf outside the mask would be nan
    picked = torch.where(mask.to(torch.bool), logprobs, torch.zeros_like(logprobs))
    return -picked.sum() / total


def sft_batch(samples: Sequence[Any], pad_id: int) -> Generation:
    """``samples`` (each a dict with ``prompt`` and ``tokens``: the response's ids, both
    non-empty lists of ints) laid out as a :class:`Generation` (prompts left-padded with
    ``pad_id``, responses from one column; the behaviour log-probs are zeros: unused). Pure.
    Raises ``ValueError`` naming the sample for an empty batch or a malformed sample."""
    if not samples:
        raise ValueError("an empty batch; give at least one sample")
    prompts, responses = [], []
    for i, s in enumerate(samples):
        if not isinstance(s, dict) or "prompt" not in s or "tokens" not in s:
            raise ValueError(f"sample {i} must be a dict with 'prompt' and 'tokens', got {s!r:.80}")
        prompt, tokens = list(s["prompt"]), list(s["tokens"])
        for name, ids in (("prompt", prompt), ("tokens", tokens)):
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"sample {i}'s {name} must be a non-empty list of token ids")
        prompts.append(prompt)
        responses.append(tokens)
    zeros = [[0.0] * len(r) for r in responses]
    return pack(prompts, responses, zeros, pad_id=pad_id)


def _count(mask: torch.Tensor, world: int) -> float:
    """The whole batch's response tokens (every member's, summed over the group)."""
    count = mask.sum().to(torch.float64).reshape(1)
    if world > 1:
        from torch import distributed as dist

        dist.all_reduce(count)
    return float(count[0])


def sft_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    gen: Generation,
    config: UpdateConfig,
    *,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """One optimizer step on the token-mean NLL (:func:`sft_loss`) of ``gen``'s completions,
    gradients clipped to ``config.max_grad_norm``, the forward passes in micro-batches of
    ``config.micro_batch_tokens`` (gradients summed) under ``autocast_dtype`` when given; the
    log-probs at temperature 1 (``config``'s other fields are GRPO's and unused). Returns the
    whole batch's ``loss`` (under the weights before the step), ``tokens`` and ``grad_norm``.

    With an initialised ``torch.distributed`` group every member must call this together with
    its share (collectives inside). Raises ``ValueError`` when the batch has no response
    token. Blocks on the computation."""
    _, world = rank_and_world()
    device = next(iter(model.parameters()), torch.empty(0)).device
    gen = gen.to(device)
    mask = gen.mask
    total = _count(mask, world)
    if total == 0:
        raise ValueError("the batch has no response tokens; there is nothing to train on")
    params = [p for p in model.parameters() if p.requires_grad]
    no_advantages = torch.zeros(mask.shape[0], device=device)
    parts = split(gen, no_advantages, mask, None, config.micro_batch_tokens)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    # a sharded model's ranks call it as often as each other: the extra calls count nothing
    for maybe, calls in plan_passes(parts, model, lambda p: forward_groups(p.gen)):
        part = maybe or parts[0]
        with autocast(device, autocast_dtype):
            logp, _ = completion_logprobs(model, part.gen, calls=calls)
        loss = sft_loss(logp, part.mask, total) * (maybe is not None)
        loss.backward()  # type: ignore[no-untyped-call]
        loss_sum += loss.detach().to(torch.float64)
    if world > 1:
        from torch import distributed as dist

        if not is_sharded(model):
            sum_gradients(params)
        else:
            summed(params, world)  # a sharded model's backward reduced them, to a mean
        dist.all_reduce(loss_sum)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
    optimizer.step()
    return {"loss": float(loss_sum), "tokens": total, "grad_norm": to_float(grad_norm)}


@torch.no_grad()
def sft_evaluate(
    model: nn.Module, gen: Generation, micro_batch_tokens: int | None = None
) -> dict[str, float]:
    """The token-mean NLL of ``gen``'s completions under ``model`` as it is (no gradient, no
    collective: one process's batch), in micro-batches of at most ``micro_batch_tokens``.
    Returns ``loss`` and ``tokens``. Raises ``ValueError`` when there is no response token."""
    device = next(iter(model.parameters()), torch.empty(0)).device
    gen = gen.to(device)
    mask = gen.mask
    total = float(mask.sum())
    if total == 0:
        raise ValueError("the batch has no response tokens to score")
    no_advantages = torch.zeros(mask.shape[0], device=device)
    loss = 0.0
    for part in split(gen, no_advantages, mask, None, micro_batch_tokens):
        logp, _ = completion_logprobs(model, part.gen)
        loss += float(sft_loss(logp, part.mask, total))
    return {"loss": loss, "tokens": total}
