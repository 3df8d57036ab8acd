"""A circuit plan: what the planner is asked (:class:`PlanRequest`), what it answers
(:class:`Plan`), the planner's contract, and when a plan is worth committing
(:class:`CommitPolicy`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol

from orchestr.errors import ConfigError

from ._circuits import CircuitSet, Installed
from ._costmodel import ReconfigCost

__all__ = ["CommitPolicy", "Plan", "PlanRequest", "Planner"]


@dataclasses.dataclass(frozen=True)
class CommitPolicy:
    """When a plan is worth committing.

    Commit only if ``saving_s > reconfig_cost_s * (1 + hysteresis) + margin_s``, and never take
    down a circuit set up less than ``min_dwell_s`` ago: its two ports are frozen until then.
    """

    hysteresis: float = 0.5
    margin_s: float = 0.0
    min_dwell_s: float = 30.0

    def __post_init__(self) -> None:
        if not (self.hysteresis >= 0 and self.margin_s >= 0 and self.min_dwell_s >= 0):
            raise ConfigError(f"commit policy values must be >= 0, got {self!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """Everything a planner needs; rates in Gbit/s, bytes in bytes, times in seconds."""

    #: Bytes from switch to switch in the coming phase, ``{(src, dst): bytes}``.
    demand: Mapping[tuple[str, str], float]
    #: OCS ports per switch; a switch not named has none.
    budgets: Mapping[str, int]
    #: Rate of one circuit, each way.
    circuit_gbps: float
    #: The share of the electrical path a pair gets (its bottleneck), each way; or one rate.
    electrical_gbps: Callable[[str, str], float] | float
    #: Now, on the clock of :attr:`Installed.since`.
    now: float
    #: Which pairs one OCS reaches: a predicate, a collection of pairs, or None for any pair.
    allowed: Callable[[str, str], bool] | Collection[tuple[str, str]] | None = None
    current: Sequence[Installed] = ()
    reconfig_cost: Callable[[int], float] = dataclasses.field(default_factory=ReconfigCost)
    policy: CommitPolicy = dataclasses.field(default_factory=CommitPolicy)
    #: How often the phase's traffic recurs before the next plan (the saving counts each).
    repeats: float = 1.0
    #: Idle ports per switch that changed within the dwell and may not be used yet.
    frozen_ports: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A target circuit set as a diff from the circuits in place, and whether to commit it."""

    add: CircuitSet
    remove: CircuitSet
    keep: CircuitSet
    #: Predicted phase seconds with the circuits in place.
    predicted_s_static: float
    #: Predicted phase seconds with the planned circuits.
    predicted_s_with: float
    #: ``(static - with) * repeats``.
    saving_s: float
    reconfig_cost_s: float
    #: Switch ports whose circuit changes (a port moved from one circuit to another counts once).
    port_changes: int
    commit: bool
    reason: str

    @property
    def target(self) -> CircuitSet:
        return self.keep + self.add


class Planner(Protocol):
    """The planner seam: pure, no I/O; raises ConfigError on inconsistent input."""

    def plan(self, request: PlanRequest) -> Plan: ...
