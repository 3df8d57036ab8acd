"""A step's inputs as :class:`~._paged.PagedRunner`'s layers read them: the packed row's
positions and slots, the decodes' block tables (or mask), each prefill chunk's place, and
which rows sample."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._core._scheduler import Seq

__all__ = ["Batch", "causal", "tables_of"]


@dataclass
class Batch:
    """A step's inputs as the layers read them."""

    decodes: int  # the first ``decodes`` tokens are one-token decodes, in this order
    positions: torch.Tensor
    slots: torch.Tensor  # each token's slot in the pool
    decode_meta: torch.Tensor  # the decodes' block tables (kernel) or additive mask
    lengths: torch.Tensor  # each decode's positions, its new one included
    chunks: list[tuple[int, int, int, torch.Tensor]]  # (offset, start, n, table) per prefill
    masks: list[torch.Tensor | None]
    written: Callable[[int], None] | None  # a layer's keys and values are in the pool
    keep: list[int]  # the rows that sample, in order: the only ones the last layer finishes
    longest: int = 0


def tables_of(seqs: list[Seq], size: int, longest: int, device: torch.device) -> torch.Tensor:
    """The block tables of ``seqs`` as the kernel reads them: ``[len(seqs), width]`` int32,
    each row its first blocks (as many as cover ``longest`` positions), padded with 0."""
    width = -(-longest // size)
    rows = [s.blocks[:width] + [0] * (width - len(s.blocks[:width])) for s in seqs]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(seqs), width)


def causal(start: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The additive mask of a chunk of queries at positions ``start .. start + n - 1`` over
    keys ``0 .. start + n - 1``: each sees itself and what precedes it (``None``, plain
    causal attention, for a chunk from position 0)."""
    if start == 0:
        return None
    ahead = (
        torch.arange(start + n, device=device)[None, :]
        > torch.arange(start, start + n, device=device)[:, None]
    )
    return torch.zeros(ahead.shape, dtype=dtype, device=device).masked_fill(ahead, float("-inf"))
