"""Ping-pong micro-batches: one engine step's sequences run as several micro-batches at once,
each in its own thread, so that while one waits on its MoE layer's experts on other hosts
(attention/FFN disaggregation: ``Generator(experts=...)``) another computes its
attention here. MegaScale-Infer and Step-3 pipeline micro-batches between attention and
expert nodes this way; here the pipelining falls out of the threads: a thread blocked on the
hosts releases the GIL, and torch's kernels release it too.

Each micro-batch is a :class:`~.._core._scheduler.Step` of its own over disjoint sequences, whose
KV blocks are disjoint (a shared cached prefix is only read), so the runner's writes do not
meet. Its rotary table is grown on the calling thread first. The split needs the paged
attention kernel: torch's attention path keeps a decode mirror that one step at a time
rearranges, so without the kernel the micro-batches run one after another (the same
results, no overlap). The sequences are dealt by tokens, longest first, to the micro-batch
with the fewest, so each has about the same work.
"""

from __future__ import annotations

import concurrent.futures
import weakref

import torch

from .._core._scheduler import Seq, Step
from ._paged import PagedRunner

__all__ = ["MicroBatches", "split"]


def split(scheduled: list[tuple[Seq, int]], parts: int) -> list[list[tuple[Seq, int]]]:
    """``scheduled`` in at most ``parts`` non-empty groups of about equal tokens (each
    group in the step's order)."""
    groups: list[list[int]] = [[] for _ in range(min(parts, len(scheduled)))]
    tokens = [0] * len(groups)
    for i in sorted(range(len(scheduled)), key=lambda i: -scheduled[i][1]):
        g = min(range(len(groups)), key=tokens.__getitem__)
        groups[g].append(i)
        tokens[g] += scheduled[i][1]
    return [[scheduled[i] for i in sorted(g)] for g in groups if g]


class MicroBatches:
    """Runs each step through ``runner`` as ``parts`` micro-batches at once (``1``: as one
    batch, on the calling thread)."""

    def __init__(self, runner: PagedRunner, parts: int) -> None:
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise ValueError(f"micro_batches is a whole number >= 1, got {parts!r}")
        self.runner, self.parts = runner, parts
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def run(self, step: Step) -> dict[str, torch.Tensor]:
        if self.parts == 1 or len(step.scheduled) < 2:
            return self.runner.run(step)
        groups = split(step.scheduled, self.parts)
        if self.runner.ops is None:  # no kernel: one after another
            out: dict[str, torch.Tensor] = {}
            for group in groups:
                out |= self.runner.run(Step(group, []))
            return out
        top = max(seq.num_computed + n for seq, n in step.scheduled)
        self.runner._rotations(torch.tensor([top]))
        pool = self._threads()
        threads = torch.get_num_threads()
        futures = [pool.submit(_run, self.runner, Step(g, []), threads) for g in groups[1:]]
        try:
            out = self.runner.run(Step(groups[0], []))
        finally:
            concurrent.futures.wait(futures)  # nothing may touch the engine after the step
        for f in futures:
            out |= f.result()
        return out

    def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.parts - 1, thread_name_prefix="micro-batch"
            )
            weakref.finalize(self, self._pool.shutdown, wait=False)
        return self._pool


def _run(runner: PagedRunner, step: Step, threads: int) -> dict[str, torch.Tensor]:
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return runner.run(step)
