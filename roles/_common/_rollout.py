"""Sampling and greedy generation over any causal LM, and the per-token log-probs GRPO needs.

The model is anything with ``forward(tokens[B, T]) -> logits[B, T, V]`` that ignores its padding
token ``pad_id`` (masks it as a key and does not count it in positions, as :class:`._model.TinyLM` does).
Generation here is the simple reference: the whole sequence is recomputed for every new
token. The continuous-batching engine builds on the same interface and keys and must give the
same tokens.

Layout: prompts are left-padded to the longest in the batch, so completions start at one
column, ``prompt_width``; a row holds ``pad_id`` after its stop token (``eos_id``) or its
limit. Both ids are the caller's: they belong to the model's vocabulary, not to this module. Since the model
ignores padding, a row's tokens do not depend on what else is in the batch.

Randomness: each sample owns a ``torch.Generator`` seeded by :func:`sample_key`, from which
it draws Gumbel noise for its own ``max_new_tokens`` steps up front. A sample's tokens are a
function of the model, its prompt and its key alone — batch composition and order do not
matter (up to float rounding in batched matmuls, which can only flip an exact near-tie).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from ._seeding import derive_seed

__all__ = [
    "Generation",
    "completion_logprobs",
    "generate",
    "pack",
    "sample_key",
    "token_logprobs",
]


def sample_key(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """The RNG seed of one sample: the same in every process that generates it."""
    return derive_seed("sample", seed, step, prompt_index, sample_index)


@dataclasses.dataclass(frozen=True)
class Generation:
    """A batch of completions.

    ``tokens[N, prompt_width + L]``: prompts left-padded, completions from column
    ``prompt_width``, padding after each row's end. ``prompt_lengths[N]``: tokens per prompt.
    ``lengths[N]``: generated tokens per row, the stop token included. ``logprobs[N, L]``: the
    behaviour log-prob of each generated token under the sampling distribution (temperature
    applied; 0 past a row's length; for greedy rows, the log-prob at temperature 1).
    """

    tokens: torch.Tensor
    prompt_width: int
    prompt_lengths: torch.Tensor
    lengths: torch.Tensor
    logprobs: torch.Tensor

    @property
    def mask(self) -> torch.Tensor:
        """``[N, L]`` bool: which completion columns were generated."""
        cols = torch.arange(self.logprobs.shape[1], device=self.lengths.device)
        return cols[None, :] < self.lengths[:, None]

    def to(self, device: torch.device | str) -> Generation:
        """The same batch with its tensors on ``device``."""
        return dataclasses.replace(
            self,
            tokens=self.tokens.to(device),
            prompt_lengths=self.prompt_lengths.to(device),
            lengths=self.lengths.to(device),
            logprobs=self.logprobs.to(device),
        )

    def completion(self, i: int) -> list[int]:
        """Row ``i``'s generated tokens, the stop token included when it was said."""
        start = self.prompt_width
        return [int(t) for t in self.tokens[i, start : start + int(self.lengths[i])]]


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    *,
    pad_id: int,
    eos_id: int | None,
    keys: Sequence[int] | None = None,
    temperature: float = 1.0,
) -> Generation:
    """Complete each encoded prompt, sampling with its key, or greedily when ``keys`` is None.

    A row stops at ``eos_id`` (None: never) or after its own ``max_new_tokens``; ``pad_id``
    fills the rest. Blocks on the computation;
    raises ``ValueError`` for mismatched lengths, an empty prompt or a non-positive temperature.
    """
    n = len(prompts)
    if len(max_new_tokens) != n or (keys is not None and len(keys) != n):
        raise ValueError(
            f"{n} prompts need {n} max_new_tokens and keys, got {len(max_new_tokens)} and "
            f"{'none' if keys is None else len(keys)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be positive (keys=None is greedy), got {temperature}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token to condition on")
    width = max((len(p) for p in prompts), default=0)
    limit = max(max_new_tokens, default=0)
    device = next(iter(model.parameters()), torch.empty(0)).device
    tokens = torch.full((n, width + limit), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p) : width] = torch.tensor(list(p), dtype=torch.long)
    tokens = tokens.to(device)
    caps = torch.tensor(list(max_new_tokens), dtype=torch.long, device=device)
    lengths = torch.zeros(n, dtype=torch.long, device=device)
    logprobs = torch.zeros(n, limit, device=device)
    noise: torch.Tensor | None = None
    done = caps <= 0
    for k in range(limit):
        active = (~done).nonzero().squeeze(1)
        if active.numel() == 0:
            break
        logits = model(tokens[active, : width + k])[:, -1].float()
        if keys is None:
            logp = torch.log_softmax(logits, dim=-1)
            tok = logits.argmax(-1)
        else:
            if noise is None:  # the vocabulary size is known from the first forward
                noise = _gumbel_noise(keys, list(max_new_tokens), limit, logits.shape[-1])
                noise = noise.to(device)
            logp = torch.log_softmax(logits / temperature, dim=-1)
            tok = (logp + noise[active, k]).argmax(-1)
        tokens[active, width + k] = tok
        logprobs[active, k] = logp.gather(1, tok[:, None]).squeeze(1)
        lengths[active] += 1
        stopped = lengths[active] >= caps[active]
        done[active] = stopped if eos_id is None else (tok == eos_id) | stopped
    return Generation(
        tokens=tokens.cpu(),
        prompt_width=width,
        prompt_lengths=torch.tensor([len(p) for p in prompts], dtype=torch.long),
        lengths=lengths.cpu(),
        logprobs=logprobs.cpu(),
    )


def pack(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    *,
    pad_id: int,
) -> Generation:
    """Lay out completions made elsewhere (a generator's, one by one) as a :class:`Generation`:
    prompts left-padded to the longest, completions from column ``prompt_width``, ``pad_id``
    after. ``logprobs[i]`` are the behaviour log-probs of ``completions[i]``, one per token.

    Raises ``ValueError`` for mismatched lengths, an empty prompt or completion, or a
    log-prob list whose length is not its completion's.
    """
    n = len(prompts)
    if len(completions) != n or len(logprobs) != n:
        raise ValueError(
            f"{n} prompts need {n} completions and log-prob lists, got "
            f"{len(completions)} and {len(logprobs)}"
        )
    for i, (p, c, lp) in enumerate(zip(prompts, completions, logprobs, strict=True)):
        if not p or not c:
            raise ValueError(f"sample {i} has an empty prompt or completion")
        if len(lp) != len(c):
            raise ValueError(f"sample {i} has {len(c)} tokens but {len(lp)} log-probs")
    width = max((len(p) for p in prompts), default=0)
    limit = max((len(c) for c in completions), default=0)
    tokens = torch.full((n, width + limit), pad_id, dtype=torch.long)
    behaviour = torch.zeros(n, limit)
    for i, (p, c, lp) in enumerate(zip(prompts, completions, logprobs, strict=True)):
        tokens[i, width - len(p) : width] = torch.tensor(list(p), dtype=torch.long)
        tokens[i, width : width + len(c)] = torch.tensor(list(c), dtype=torch.long)
        behaviour[i, : len(c)] = torch.tensor(list(lp), dtype=torch.float32)
    return Generation(
        tokens=tokens,
        prompt_width=width,
        prompt_lengths=torch.tensor([len(p) for p in prompts], dtype=torch.long),
        lengths=torch.tensor([len(c) for c in completions], dtype=torch.long),
        logprobs=behaviour,
    )


def _gumbel_noise(keys: Sequence[int], caps: list[int], limit: int, vocab: int) -> torch.Tensor:
    # Each sample draws exactly caps[i] rows from its own generator, so the noise it sees does
    # not depend on the longest prompt it happens to share a batch with.
    noise = torch.zeros(len(keys), limit, vocab)
    for i, (key, cap) in enumerate(zip(keys, caps, strict=True)):
        g = torch.Generator().manual_seed(key)
        u = torch.rand(cap, vocab, generator=g).clamp_(min=1e-20)
        noise[i, :cap] = -torch.log(-torch.log(u))
    return noise


def token_logprobs(
    model: nn.Module, tokens: torch.Tensor, start: int, temperature: float = 1.0
) -> torch.Tensor:
    """``[B, T - start]``: log p(tokens[:, t] | tokens[:, :t]) for every ``t >= start``.

    Differentiable; ``start >= 1`` since the first token has no prefix to condition on.
    """
    return _token_scores(model, tokens, start, temperature)[0]


def _token_scores(
    model: nn.Module, tokens: torch.Tensor, start: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if not 1 <= start <= tokens.shape[1]:
        raise ValueError(f"start must be in 1..{tokens.shape[1]}, got {start}")
    logits = model(tokens)[:, start - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, tokens[:, start:, None]).squeeze(-1), entropy


def forward_groups(gen: Generation) -> int:
    """How many forward passes :func:`completion_logprobs` makes for ``gen``: one per prompt
    length among its rows that completed a token."""
    if gen.logprobs.shape[0] == 0:
        return 0
    spans = [
        int(gen.lengths[gen.prompt_lengths == plen].max())
        for plen in torch.unique(gen.prompt_lengths).tolist()
    ]
    return sum(span > 0 for span in spans)


def completion_logprobs(
    model: nn.Module, gen: Generation, temperature: float = 1.0, *, calls: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N, L], [N, L])``: the current model's log-prob of each of ``gen``'s completion
    tokens and the entropy of its next-token distribution there (both 0 past a row's length),
    differentiable.

    Rows are grouped by prompt length and each group is cropped to its own prompt and longest
    completion, so the long tail's padding is not computed for the many short rows (about 3x
    less work for the task's length mix), and no row is padded on the left. ``calls``, when
    more than :func:`forward_groups` of ``gen``, adds forward passes whose outputs count zero
    times: a sharded model's ranks must call it equally often, whatever their prompts.
    """
    n, limit = gen.logprobs.shape
    width = gen.prompt_width
    logps = torch.zeros(n, limit, device=gen.tokens.device)
    entropies = torch.zeros(n, limit, device=gen.tokens.device)
    made = 0
    for plen in torch.unique(gen.prompt_lengths).tolist():
        rows = (gen.prompt_lengths == plen).nonzero().squeeze(1)
        span = int(gen.lengths[rows].max())
        if span == 0:
            continue
        window = gen.tokens[rows, width - plen : width + span]
        logp, entropy = _token_scores(model, window, plen, temperature)
        logps = logps.index_put((rows,), F.pad(logp, (0, limit - span)))
        entropies = entropies.index_put((rows,), F.pad(entropy, (0, limit - span)))
        made += 1
    for _ in range(max(0, (calls or 0) - made)):
        # the first row, whole: its scores are multiplied by zero, but the pass runs
        start = max(1, min(width, gen.tokens.shape[1] - 1))
        idle, _ = _token_scores(model, gen.tokens[:1], start, temperature)
        logps = logps + 0 * idle.sum()
    mask = gen.mask
    return logps * mask, entropies * mask
