"""The controller's side of a pipeline: spawning its :class:`~._stage.PipelineStage` mesh,
running a batch through it and reading the step's timing back."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

import orchestr as oc

from ._builders import build
from ._ops import Schedule
from ._stage import PipelineStage

__all__ = ["Pipeline", "StepResult"]


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One step of a pipeline: each micro-batch's loss, the wall time from the first pass's
    start to the last one's end, each rank's time computing, and the bubble, the share of
    ``ranks * makespan_s`` spent not computing (what
    :func:`~orchestr.roles.pipeline.bubble_theory` gives in closed form)."""

    losses: list[float]
    makespan_s: float
    busy_s: list[float]
    bubble: float
    timelines: list[list[list[Any]]]


class Pipeline:
    """A pipeline-parallel model on a mesh of :class:`PipelineStage` actors, driven from the
    controller: :meth:`spawn` starts it, :meth:`step` runs one batch through the schedule."""

    def __init__(self, mesh: oc.Mesh, schedule: Schedule) -> None:
        self.mesh = mesh
        self.schedule = schedule
        self._step = 0

    @classmethod
    async def spawn(
        cls,
        ctx: oc.JobContext,
        model: str,
        *,
        schedule: str = "1f1b",
        ranks: int = 2,
        microbatches: int = 4,
        chunks: int = 1,
        resources: dict[str, float] | None = None,
        **options: Any,
    ) -> Pipeline:
        """Spawn one :class:`PipelineStage` per rank (a process each) and connect them.
        ``options`` are :class:`PipelineStage`'s keywords. Raises
        :class:`~orchestr.ConfigError` for a schedule :func:`build` refuses, before anything
        is spawned."""
        try:
            plan = build(schedule, ranks, microbatches, chunks)
        except ValueError as exc:
            raise oc.ConfigError(f"pipeline schedule: {exc}") from exc
        mesh = await ctx.spawn(
            PipelineStage,
            model,
            schedule,
            ranks,
            microbatches,
            chunks,
            n=ranks,
            resources=resources or {"cpu": 0.5},
            **options,
        )
        await mesh.connect.call(mesh)
        return cls(mesh, plan)

    def _split(self, what: str, batch: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
        m = self.schedule.microbatches
        if isinstance(batch, torch.Tensor):
            if batch.shape[0] % m:
                raise ValueError(
                    f"{what}: a batch of {batch.shape[0]} does not split into {m} equal "
                    f"micro-batches"
                )
            return list(batch.chunk(m))
        parts = list(batch)
        if len(parts) != m or not all(isinstance(t, torch.Tensor) for t in parts):
            raise ValueError(f"{what}: expected a tensor or {m} micro-batch tensors")
        return parts

    async def step(
        self,
        inputs: torch.Tensor | Sequence[torch.Tensor],
        targets: torch.Tensor | Sequence[torch.Tensor],
        *,
        update: bool = True,
    ) -> StepResult:
        """Run one batch (a tensor split into the micro-batches along its first dimension,
        or the micro-batches) through the schedule; with ``update``, each rank then takes an
        optimizer step. Raises ``ValueError`` for a batch that does not split, and
        :class:`~orchestr.ActorError` for a failure on a rank."""
        xs, ys = self._split("inputs", inputs), self._split("targets", targets)
        last = self.schedule.ranks - 1
        step, self._step = self._step, self._step + 1
        calls = [
            self.mesh[r].step.call_one(
                step, xs if r == 0 else None, ys if r == last else None, update
            )
            for r in range(self.schedule.ranks)
        ]
        # a rank that fails tells the others to give the step up, so every call returns
        done = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in done if isinstance(r, BaseException)]
        if errors:  # the failure itself rather than the others' abandoning of the step
            raise next((e for e in errors if "was abandoned" not in str(e)), errors[0])
        results: list[dict[str, Any]] = list(done)  # type: ignore[arg-type]
        timelines = [r["timeline"] for r in results]
        starts = [t[3] for tl in timelines for t in tl]
        ends = [t[4] for tl in timelines for t in tl]
        makespan = max(ends) - min(starts)
        busy = [sum(t[4] - t[3] for t in tl) for tl in timelines]
        bubble = 1 - sum(busy) / (len(busy) * makespan) if makespan > 0 else 0.0
        return StepResult(results[last]["losses"], makespan, busy, bubble, timelines)

    async def grads(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every stage's gradients from the last step, by stage."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for per_rank in await self.mesh.grads.call():
            out.update({int(k): v for k, v in per_rank.items()})
        return dict(sorted(out.items()))

    async def state_dict(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every stage's state dict, by stage."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for per_rank in await self.mesh.state_dict.call():
            out.update({int(k): v for k, v in per_rank.items()})
        return dict(sorted(out.items()))
