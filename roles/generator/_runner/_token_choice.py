"""Choosing each next token from a model's logits, the same in both engines: temperature,
top-k and top-p, one uniform per token from the request's own generator, and the log-probs
the trainer needs (untempered, and under the distribution actually sampled from), with the
likeliest tokens' log-probs for a request that asks for them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .._core._types import MAX_TOP_LOGPROBS, Request

__all__ = ["MAX_TOP_LOGPROBS", "Chosen", "check_sampling", "choose_tokens"]


class Chosen(NamedTuple):
    """Per row: the token, its untempered log-prob, its log-prob under the distribution
    sampled from, and the likeliest tokens' untempered log-probs (``None`` unless asked)."""

    tokens: list[int]
    logprobs: list[float]
    sample_logprobs: list[float]
    top: list[dict[int, float] | None]


def choose_tokens(
    last: torch.Tensor,
    requests: Sequence[Request],
    generators: Sequence[torch.Generator],
) -> Chosen:
    """One token per row of ``last`` (float32 logits ``[rows, vocab]``) for its request:
    greedy at temperature 0, else drawn with one uniform from the row's own generator (so a
    request's tokens do not depend on its batch) from the tempered distribution narrowed by
    the request's ``top_k`` and ``top_p``; with each token's log-prob untempered and under
    the distribution sampled from (0.0 when greedy), and each row's ``top_logprobs``
    likeliest tokens, the likeliest first."""
    logp = torch.log_softmax(last, dim=-1)
    temps = torch.tensor([r.temperature for r in requests], device=last.device)
    greedy = temps == 0
    tempered = last / temps.clamp_min(1e-6)[:, None]
    if any(r.top_k or r.top_p < 1.0 for r in requests):
        tempered = _narrow(tempered, requests)
    scaled = torch.log_softmax(tempered, dim=-1)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators]).to(
        last.device
    )
    cdf = scaled.double().exp().cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]  # rounding must not leave the last bucket short of 1
    sampled = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1)
    chosen = torch.where(greedy, last.argmax(dim=-1), sampled.clamp_max(last.shape[-1] - 1))
    lp = logp.gather(1, chosen[:, None]).squeeze(1)
    slp = torch.where(greedy, torch.zeros_like(lp), scaled.gather(1, chosen[:, None]).squeeze(1))
    top: list[dict[int, float] | None] = [None] * len(requests)
    most = max(r.top_logprobs for r in requests)
    if most:
        values, ids = logp.topk(most, dim=-1)
        for i, r in enumerate(requests):
            if r.top_logprobs:
                n = r.top_logprobs
                top[i] = dict(zip(ids[i, :n].tolist(), values[i, :n].tolist(), strict=True))
    return Chosen(chosen.tolist(), lp.tolist(), slp.tolist(), top)


def check_sampling(r: Request, vocab: int | None = None) -> Request:
    """``r`` with its ``temperature``, ``top_k`` and ``top_p`` checked and normalised (floats
    as ``float``; ``top_k`` clamped to ``vocab``, where no narrowing is lost, so the step's
    tensors hold it); raises ``ValueError`` naming the field for a value the step cannot run:
    a NaN, an infinity, a number out of range, a bool, an integer past a 64-bit one."""
    t = r.temperature
    if not _number(t) or not 0 <= float(t) < math.inf:
        raise ValueError(f"request {r.id!r}: temperature must be >= 0 and finite, got {t!r:.40}")
    k = r.top_k
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < 2**63:
        raise ValueError(f"request {r.id!r}: top_k must be an int from 0 to 2**63-1, got {k!r:.40}")
    p = r.top_p
    if not _number(p) or not 0 < float(p) <= 1:
        raise ValueError(f"request {r.id!r}: top_p must be in (0, 1], got {p!r:.40}")
    if vocab is not None and k > vocab:
        k = vocab  # every token is among the top vocab: the same narrowing
    if (type(t), type(p), k) == (float, float, r.top_k):
        return r
    return dataclasses.replace(r, temperature=float(t), top_k=k, top_p=float(p))


def _number(x: object) -> bool:
    """Whether ``x`` is an int or float (not a bool) that converts to a float."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    try:
        float(x)
    except OverflowError:
        return False
    return True


def _narrow(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """``logits`` with every token outside each row's top-k, then outside its top-p nucleus
    (the likeliest tokens until their probability reaches ``top_p``; at least one), at -inf."""
    ordered, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.tensor([r.top_k or logits.shape[-1] for r in requests], device=logits.device)
    keep = rank < k[:, None]
    probs = torch.softmax(ordered.masked_fill(~keep, -math.inf), dim=-1)
    p = torch.tensor([r.top_p for r in requests], device=logits.device)
    keep &= (probs.cumsum(dim=-1) - probs) < p[:, None]  # the mass before it is short of p
    drop = torch.zeros_like(keep).scatter(1, order, ~keep)
    return logits.masked_fill(drop, -math.inf)
