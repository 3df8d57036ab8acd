"""The stream modes' two sans-IO-ish pieces: the output-length ranker that routes predicted-long
prompts (StreamRL's skewness-aware dispatch) and the channel of scored groups that enforces the
staleness bound."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence

from orchestr.roles.generator import Completion, Request

__all__ = ["LengthRanker", "SampleChannel"]


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


class SampleChannel:
    """Complete, scored groups waiting for the trainer, oldest first, under the staleness
    bound: :meth:`take` drops every group older than ``min_version`` as it meets it."""

    def __init__(self) -> None:
        self._groups: collections.deque[tuple[int, list[tuple[Completion, float]]]] = (
            collections.deque()
        )
        self._ready = asyncio.Condition()
        self.dropped = 0

    async def put(self, group: list[tuple[Completion, float]]) -> None:
        async with self._ready:
            self._groups.append((min(c.version for c, _ in group), group))
            self._ready.notify_all()

    def drain(self) -> list[list[tuple[Completion, float]]]:
        """Take every group out, oldest first (none is counted as dropped)."""
        groups = [g for _, g in self._groups]
        self._groups.clear()
        return groups

    async def take(
        self, n: int, min_version: int, on_drop: Callable[[list[tuple[Completion, float]]], None]
    ) -> list[list[tuple[Completion, float]]]:
        out: list[list[tuple[Completion, float]]] = []
        async with self._ready:
            while len(out) < n:
                while self._groups and len(out) < n:
                    version, group = self._groups.popleft()
                    if version < min_version:
                        self.dropped += 1
                        on_drop(group)
                    else:
                        out.append(group)
                if len(out) < n:
                    await self._ready.wait()
        return out
