"""Micro-batches for gradient accumulation, sans-IO: which samples run together, and the
batch cut down to them.

An update over a batch too large for one forward pass runs it in micro-batches of whole
samples, summing their gradients before the optimizer step. Every mean inside divides by the
whole batch's count (tokens, sequences), so the sum of the micro-batches' losses and
gradients is the whole batch's, equal to one pass up to float rounding in the sum's order.

A micro-batch's size is what its forward pass holds: rows times the width of its packed
tensor (the longest prompt plus the longest completion among its rows). Samples keep their
order and fill a micro-batch until the next one would take it past the bound; a sample wider
than the bound on its own runs alone. No I/O here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from orchestr.roles._common._rollout import Generation

__all__ = ["Part", "plan_micro_batches", "split"]


def plan_micro_batches(
    prompt_lengths: Sequence[int], lengths: Sequence[int], bound: int | None
) -> list[list[int]]:
    """The samples' indices, in order, cut into runs whose padded size (rows times the
    longest prompt plus the longest completion of the run) is at most ``bound``; one run of
    all when ``bound`` is None. Pure. Raises ``ValueError`` for mismatched lengths or a
    ``bound`` below 1."""
    if len(prompt_lengths) != len(lengths):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(lengths)} samples")
    if bound is None:
        return [list(range(len(lengths)))] if lengths else []
    if bound < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {bound}")
    runs: list[list[int]] = []
    run: list[int] = []
    prompt = completion = 0
    for i, (p, c) in enumerate(zip(prompt_lengths, lengths, strict=True)):
        wider_p, wider_c = max(prompt, p), max(completion, c)
        if run and (len(run) + 1) * (wider_p + wider_c) > bound:
            runs.append(run)
            run, wider_p, wider_c = [], p, c
        run.append(i)
        prompt, completion = wider_p, wider_c
    if run:
        runs.append(run)
    return runs


@dataclasses.dataclass(frozen=True)
class Part:
    """One micro-batch: its rows of the batch, cropped to their own widths. ``mask`` is the
    loss's (``[n, L]`` bool), ``ref`` the reference log-probs when given."""

    gen: Generation
    advantages: torch.Tensor
    mask: torch.Tensor
    ref: torch.Tensor | None


def split(
    gen: Generation,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref: torch.Tensor | None,
    bound: int | None,
) -> list[Part]:
    """``gen`` and its per-sample (``advantages[N]``) and per-token (``mask``, ``ref``:
    ``[N, L]``) tensors as the micro-batches :func:`plan_micro_batches` makes. With ``bound``
    None the one part holds the given tensors themselves (no copy). Pure."""
    if bound is None:
        return [Part(gen, advantages, mask, ref)]
    runs = plan_micro_batches(gen.prompt_lengths.tolist(), gen.lengths.tolist(), bound)
    parts = []
    for run in runs:
        rows = torch.tensor(run, dtype=torch.long, device=gen.tokens.device)
        prompt_lengths, lengths = gen.prompt_lengths[rows], gen.lengths[rows]
        width, span = int(prompt_lengths.max()), int(lengths.max())
        start = gen.prompt_width
        part = Generation(
            tokens=gen.tokens[rows, start - width : start + span],
            prompt_width=width,
            prompt_lengths=prompt_lengths,
            lengths=lengths,
            logprobs=gen.logprobs[rows, :span],
        )
        cut = None if ref is None else ref[rows, :span]
        parts.append(Part(part, advantages[rows], mask[rows, :span], cut))
    return parts
