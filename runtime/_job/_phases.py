"""Job phases and the traffic each one expects: what the controller tells the fabric manager
ahead of time (issue: fabric manager). Here, the declarations, their validation and the seam.

A phase is named (``generation``, ``training``, ``weight_sync``, ``idle``, or the job's own
name) and may declare its traffic: bytes between meshes (``{("trainer", "generator"): n}``)
or one collective over a mesh (:class:`Collective`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal, Protocol

from orchestr import clock
from orchestr.errors import ConfigError

__all__ = ["Collective", "FabricHints", "Phase", "RecordingHints", "make_phase"]

COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "all_to_all", "reduce_scatter")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """A collective of ``nbytes`` per member over the mesh named ``mesh``."""

    kind: Literal["all_reduce", "all_gather", "broadcast", "all_to_all", "reduce_scatter"]
    mesh: str
    nbytes: int

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVES:
            raise ConfigError(f"collective kind must be one of {', '.join(COLLECTIVES)}")
        if not isinstance(self.mesh, str) or not self.mesh:
            raise ConfigError(f"a collective names its mesh, got {self.mesh!r}")
        _check_bytes(self.nbytes, f"collective over {self.mesh}")


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    #: Bytes between meshes, ``{(source mesh, destination mesh): bytes}``, or a collective.
    traffic: dict[tuple[str, str], int] | Collective | None
    #: How long the job expects the phase to last, in seconds, if it says.
    expected_s: float | None
    started: float = dataclasses.field(default_factory=clock.time)

    def describe(self) -> dict[str, Any]:
        """A JSON-able form, for the event log."""
        traffic: Any = None
        if isinstance(self.traffic, Collective):
            traffic = dataclasses.asdict(self.traffic)
        elif self.traffic is not None:
            traffic = [[src, dst, n] for (src, dst), n in self.traffic.items()]
        return {"phase": self.name, "traffic": traffic, "expected_s": self.expected_s}


def _check_bytes(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{what}: bytes must be a non-negative integer, got {value!r}")


def make_phase(name: str, traffic: Any = None, expected_s: float | None = None) -> Phase:
    """A validated :class:`Phase`; raises ConfigError saying what is wrong."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(
            f"a phase name is a word such as 'generation' or 'weight_sync', got {name!r}"
        )
    if expected_s is not None and (
        isinstance(expected_s, bool)
        or not isinstance(expected_s, int | float)
        or not expected_s > 0
    ):
        raise ConfigError(f"expected_s must be a positive number of seconds, got {expected_s!r}")
    if traffic is None or isinstance(traffic, Collective):
        return Phase(name, traffic, expected_s)
    if not isinstance(traffic, dict):
        raise ConfigError(
            "traffic is {(source mesh, destination mesh): bytes} or a Collective, got "
            f"{type(traffic).__name__}"
        )
    matrix: dict[tuple[str, str], int] = {}
    for pair, nbytes in traffic.items():
        if not (
            isinstance(pair, tuple)
            and len(pair) == 2
            and all(isinstance(m, str) and m for m in pair)
        ):
            raise ConfigError(f"traffic keys are (source mesh, destination mesh), got {pair!r}")
        _check_bytes(nbytes, f"traffic {pair[0]} -> {pair[1]}")
        matrix[pair] = nbytes
    return Phase(name, matrix, expected_s)


class FabricHints(Protocol):
    """What the controller tells the network about phases (the fabric manager implements it)."""

    def upcoming(self, phase: Phase) -> None:
        """``phase`` is about to start: its traffic is coming."""
        ...

    def ended(self, phase: Phase) -> None: ...


class RecordingHints:
    """A fabric-manager seam that only records what it was told, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Phase]] = []

    def upcoming(self, phase: Phase) -> None:
        self.seen.append(("upcoming", phase))

    def ended(self, phase: Phase) -> None:
        self.seen.append(("ended", phase))
