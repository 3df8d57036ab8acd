"""The vocabulary of pipeline schedules: the passes, one operation of a rank, a schedule.

A model cut for pipeline parallelism has ``ranks * chunks`` stages. Stage ``s`` sits on rank
``s % ranks`` as its model chunk ``s // ranks`` (Megatron's placement for virtual stages: rank
``r`` holds stages ``r, r + ranks, r + 2 * ranks, ...``), so with one chunk stage and rank are
the same number. A micro-batch's forward pass runs through the stages in order and its backward
pass in reverse; a schedule says, for each rank, the order in which it runs its passes.

These are plain frozen values and never travel on the wire: a schedule is a pure function of
its name and three integers (:func:`orchestr.roles.pipeline.build`), so a stage that needs its
rank's list builds it where it runs rather than receiving it. No I/O here.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["Op", "Pass", "Schedule"]


class Pass(enum.StrEnum):
    """What an operation computes for one micro-batch on one stage."""

    F = "F"
    """The forward pass: keeps the stage's activations until the backward has used them."""
    B = "B"
    """The whole backward pass: the gradient of the stage's input and of its weights."""
    BI = "BI"
    """The input-gradient half of a split backward: what the previous stage waits for."""
    BW = "BW"
    """The weight-gradient half of a split backward: nothing waits for it but the optimizer
    step, which is what lets zero-bubble schedules move it into the bubbles."""


@dataclasses.dataclass(frozen=True, slots=True)
class Op:
    """One pass of micro-batch ``microbatch`` through model chunk ``chunk`` of rank ``rank``:
    that is stage ``chunk * ranks + rank`` of the pipeline."""

    kind: Pass
    rank: int
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        # F3 for chunk 0, F3.1 for micro-batch 3 on chunk 1: the short form schedules print in
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Each rank's passes in the order it runs them: ``ops[r]`` is rank ``r``'s list.

    ``name`` is the builder that made it (``"1f1b"``, or the caller's own name for a
    hand-written one). Construction checks only the shape (counts at least 1, one list per
    rank); :func:`orchestr.roles.pipeline.check` checks that the lists make a pipeline.
    Raises ``ValueError``."""

    name: str
    ranks: int
    microbatches: int
    chunks: int
    ops: tuple[tuple[Op, ...], ...]

    def __post_init__(self) -> None:
        for field in ("ranks", "microbatches", "chunks"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"a schedule needs {field} >= 1, got {value!r:.40}")
        if len(self.ops) != self.ranks:
            raise ValueError(
                f"a schedule has one list of operations per rank: {self.ranks} ranks, "
                f"{len(self.ops)} lists"
            )

    @property
    def stages(self) -> int:
        """How many stages the model is cut into: ``ranks * chunks``."""
        return self.ranks * self.chunks

    def stage(self, op: Op) -> int:
        """The stage ``op`` runs on."""
        return op.chunk * self.ranks + op.rank

    def placement(self, stage: int) -> tuple[int, int]:
        """The ``(rank, chunk)`` holding ``stage``."""
        return stage % self.ranks, stage // self.ranks

    def __str__(self) -> str:
        width = len(str(self.ranks - 1))
        return "\n".join(
            f"rank {r:>{width}}: " + " ".join(str(op) for op in ops)
            for r, ops in enumerate(self.ops)
        )
