"""The elements of a cabling plan, frozen: hosts and their NICs, switches by tier, links, OCS and
their wires, port references, and the paths and circuit candidates :class:`~._topology.Topology`
answers with."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Literal

from orchestr.errors import ConfigError

__all__ = [
    "TIERS",
    "CircuitCandidate",
    "ElectricalPath",
    "Element",
    "Host",
    "Link",
    "Nic",
    "OcsSwitch",
    "OcsWire",
    "PortRef",
    "ReconfigLatency",
    "Switch",
    "Tier",
    "TopologyError",
]

if TYPE_CHECKING:
    pass


Tier = Literal["tor", "agg", "core"]


TIERS: tuple[Tier, ...] = ("tor", "agg", "core")


class TopologyError(ConfigError):
    """A cabling plan is invalid, or a query names something the plan lacks.

    The message names the element (and port); ``element`` and ``port`` carry them for programs.
    """

    def __init__(self, message: str, *, element: str | None = None, port: int | None = None):
        super().__init__(message)
        self.element = element
        self.port = port


@dataclasses.dataclass(frozen=True, order=True)
class PortRef:
    """Port ``port`` (0-based) of the element named ``element``; written ``element:port``."""

    element: str
    port: int

    def __str__(self) -> str:
        return f"{self.element}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> PortRef:
        """``"tor0:3"`` -> ``PortRef("tor0", 3)``; raises :class:`TopologyError` otherwise."""
        name, sep, index = text.rpartition(":")
        if not sep or not name or not (index.isascii() and index.isdigit()):
            raise TopologyError(f"port reference {text!r} is not of the form 'element:index'")
        return cls(name, int(index))


@dataclasses.dataclass(frozen=True)
class Nic:
    """A host NIC: its name on the host, line rate, and the ToR port it is cabled to."""

    name: str
    gbps: float
    port: PortRef


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    accelerators: int
    nics: tuple[Nic, ...]

    def __post_init__(self) -> None:
        if isinstance(self.nics, list):
            object.__setattr__(self, "nics", tuple(self.nics))


@dataclasses.dataclass(frozen=True)
class Switch:
    """An electrical switch with ``ports`` ports (0..ports-1)."""

    name: str
    tier: Tier
    ports: int


@dataclasses.dataclass(frozen=True)
class Link:
    """An electrical cable between two switch ports."""

    a: PortRef
    b: PortRef
    gbps: float


@dataclasses.dataclass(frozen=True)
class ReconfigLatency:
    """How long reprogramming an OCS takes.

    A change of ``k`` OCS ports costs ``control_ms`` (control plane: compute, RPCs, driver
    commit), then ``ceil(k / concurrency)`` rounds of ``switch_ms`` (mirror moves; concurrency 0
    moves all ports at once, as MEMS switches do), then ``settle_ms`` (optics settle, links
    train and are verified). The defaults are orders of magnitude for a MEMS OCS (ms to switch,
    about a second end to end), not a measurement.
    """

    switch_ms: float = 25.0
    settle_ms: float = 100.0
    control_ms: float = 500.0
    concurrency: int = 0

    def expected_ms(self, ports: int) -> float:
        """Expected milliseconds to change the cross-connects of ``ports`` OCS ports."""
        if ports <= 0:
            return 0.0
        rounds = 1 if self.concurrency == 0 else -(-ports // self.concurrency)
        return self.control_ms + rounds * self.switch_ms + self.settle_ms


@dataclasses.dataclass(frozen=True)
class OcsSwitch:
    """An optical circuit switch: ``radix`` ports (0..radix-1), any two of which it can join."""

    name: str
    radix: int
    latency: ReconfigLatency = dataclasses.field(default_factory=ReconfigLatency)


@dataclasses.dataclass(frozen=True)
class OcsWire:
    """A fibre from an OCS port to a ToR or aggregation uplink port, at ``gbps``."""

    ocs_port: PortRef
    switch_port: PortRef
    gbps: float


@dataclasses.dataclass(frozen=True)
class ElectricalPath:
    """Nodes from source to destination (hosts at the ends) and each hop's capacity.

    Parallel cables between the same two nodes count as one hop of their summed capacity.
    """

    nodes: tuple[str, ...]
    hop_gbps: tuple[float, ...]

    @property
    def hops(self) -> int:
        return len(self.hop_gbps)

    @property
    def bottleneck_gbps(self) -> float:
        """The smallest hop capacity; ``inf`` for a path of no hops (a host to itself)."""
        return min(self.hop_gbps, default=math.inf)


@dataclasses.dataclass(frozen=True)
class CircuitCandidate:
    """Two switches one OCS can join, and the free OCS ports wired to each (their budget)."""

    ocs: str
    a: str
    b: str
    a_ports: tuple[int, ...]
    b_ports: tuple[int, ...]

    @property
    def max_circuits(self) -> int:
        return min(len(self.a_ports), len(self.b_ports))


Element = Host | Switch | OcsSwitch


_KINDS: dict[type, str] = {Host: "host", Switch: "switch", OcsSwitch: "OCS"}
