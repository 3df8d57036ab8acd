"""The stream+skew mode's output-length ranker, which routes predicted-long prompts to their own
generators (StreamRL's skewness-aware dispatch); sans-IO."""

from __future__ import annotations

import collections
from collections.abc import Sequence

from orchestr.roles.generator import Request

__all__ = ["LengthRanker"]


class LengthRanker:
    """Predicts a prompt's output length from what was seen of prompts of its length (the
    mean of their completions' lengths), before any seen from its ``max_new_tokens``; sans-IO.

    :meth:`split` orders prompts by predicted cost and gives the most expensive to the long
    pool until it holds its share of the total, so the pools finish together."""

    def __init__(self) -> None:
        self._sum: dict[int, float] = collections.defaultdict(float)
        self._count: dict[int, int] = collections.defaultdict(int)

    def predict(self, prompt: Sequence[int], max_new_tokens: int) -> float:
        n = self._count.get(len(prompt), 0)
        return self._sum[len(prompt)] / n if n else float(max_new_tokens)

    def observe(self, prompt: Sequence[int], generated: int) -> None:
        self._sum[len(prompt)] += generated
        self._count[len(prompt)] += 1

    def split(self, requests: Sequence[Request], long_share: float) -> list[bool]:
        """Which requests go to the long pool. The cost of a request is its predicted length
        times the width it decodes at (prompt plus half its output), the work of a
        full-recompute step; the long pool takes the costliest up to ``long_share`` of the
        total (at least one when there is any)."""
        costs = []
        for r in requests:
            out = self.predict(r.prompt, r.max_new_tokens)
            costs.append(out * (len(r.prompt) + out / 2))
        total = sum(costs)
        order = sorted(range(len(requests)), key=lambda i: -costs[i])
        long = [False] * len(requests)
        taken = 0.0
        for i in order:
            if taken >= long_share * total and any(long):
                break
            long[i] = True
            taken += costs[i]
        return long
