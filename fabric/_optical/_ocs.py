"""The optical-circuit-switch seam: one :class:`OcsDriver` contract for every switch.

An OCS has ``radix`` ports numbered ``0 .. radix-1``. A circuit joins two of them (an unordered
pair, stored as ``(low, high)``); a port is in at most one circuit. A driver changes circuits
only through :meth:`OcsDriver.program`, which carries a **generation**: a switch applies a program
only if its generation is newer than the last one it applied, so a command or acknowledgement
that arrives late, after a newer program, changes nothing. Drivers: ``sim`` (in-process, see
``_ocs_sim``); a driver that moves links between Linux network namespaces fits the same shape
(ports are interfaces, a circuit is a link between two of them). Every driver passes
:func:`orchestr.fabric._optical._conformance.check_ocs_driver`.

Its errors are :class:`OcsError` and its subclasses (drawn in :mod:`orchestr.errors` with the
rest of the tree); a closed driver raises :class:`~orchestr.errors.ClosedResourceError`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Protocol, runtime_checkable

from orchestr.errors import OrchestrError

__all__ = [
    "Circuit",
    "InvalidProgramError",
    "OcsDriver",
    "OcsError",
    "PortFailedError",
    "StaleGenerationError",
    "VerifyError",
    "apply_program",
    "check_generation",
    "check_program",
    "circuit",
]

Circuit = tuple[int, int]
"""Two ports of one switch, ``low < high``."""


class OcsError(OrchestrError):
    """An optical circuit switch refused or failed a request."""


class InvalidProgramError(OcsError, ValueError):
    """A program names a port out of range or twice, connects a busy port, or disconnects a
    circuit that is not live. The switch is unchanged."""


class PortFailedError(OcsError):
    """A port the program touches has failed; the switch is unchanged. ``ports`` names them."""

    def __init__(self, message: str, ports: Iterable[int]) -> None:
        super().__init__(message)
        self.ports = frozenset(ports)


class StaleGenerationError(OcsError):
    """A program's generation is not newer than the last one the switch applied."""

    def __init__(self, generation: int, current: int) -> None:
        super().__init__(
            f"generation {generation} is not newer than the switch's generation {current}; "
            f"a newer plan has been applied since: read circuits() and plan again"
        )
        self.generation = generation
        self.current = current


class VerifyError(OcsError):
    """The switch's state differs from what the caller expected."""

    def __init__(
        self,
        *,
        generation: int,
        found_generation: int,
        missing: Iterable[Circuit] = (),
        extra: Iterable[Circuit] = (),
    ) -> None:
        self.generation = generation
        self.found_generation = found_generation
        self.missing = frozenset(missing)
        self.extra = frozenset(extra)
        parts = []
        if found_generation != generation:
            parts.append(f"the switch is at generation {found_generation}")
        if self.missing:
            parts.append(f"circuits {sorted(self.missing)} are not live")
        if self.extra:
            parts.append(f"circuits {sorted(self.extra)} are live but not expected")
        super().__init__(f"verify of generation {generation} failed: " + "; ".join(parts))


@runtime_checkable
class OcsDriver(Protocol):
    """What every optical circuit switch driver provides.

    A driver serves one caller at a time: programs on one driver do not overlap, except that a
    program the caller gave up on (cancelled at its deadline) may still reach the switch later;
    the generation fence then decides whether it applies.
    """

    @property
    def radix(self) -> int:
        """The number of ports."""
        ...

    async def program(
        self, generation: int, connect: Sequence[Circuit], disconnect: Sequence[Circuit]
    ) -> None:
        """Disconnect then connect circuits, all at once or not at all, and return once the
        switch acknowledges ``generation``.

        Blocks on the switch (milliseconds for MEMS). Raises :class:`InvalidProgramError` (see
        :func:`check_program`), :class:`StaleGenerationError` when ``generation`` is not newer
        than the switch's, :class:`PortFailedError`, or another :class:`OcsError`; in each case
        nothing was applied. An empty program is valid: it advances the generation (a fence
        against late commands of older generations). Not idempotent (the generation is
        consumed). Cancelling it leaves the outcome unknown until :meth:`circuits` is read.
        """
        ...

    async def circuits(self) -> tuple[int, frozenset[Circuit]]:
        """The generation last applied and the live circuits, read from the switch.

        A circuit through a failed port is not live. Cancel-safe and idempotent.
        Blocks on reading the switch; raises :class:`OcsError` when it cannot be read.
        """
        ...

    async def verify(self, generation: int, expected: Collection[Circuit]) -> None:
        """Check that the switch is at ``generation`` with exactly the circuits ``expected``
        live (a hardware driver may also check optical power); raises :class:`VerifyError`.
        Cancel-safe and idempotent.

        Blocks on reading the switch."""
        ...

    async def aclose(self) -> None:
        """Release the driver; later calls raise ``ClosedResourceError``. Idempotent. The
        switch keeps its circuits.

        Blocks on the switch's connection closing; cancel-safe."""
        ...


def circuit(a: int, b: int) -> Circuit:
    """The circuit joining ports ``a`` and ``b`` in its stored order."""
    return (a, b) if a <= b else (b, a)


def _normal(c: object, radix: int, what: str) -> Circuit:
    if not isinstance(c, tuple | list) or len(c) != 2:
        raise InvalidProgramError(f"{what} {c!r} is not a pair of ports")
    a, b = c
    for p in (a, b):
        if not isinstance(p, int) or isinstance(p, bool):
            raise InvalidProgramError(f"{what} {c!r}: port {p!r} is not an integer")
        if not 0 <= p < radix:
            raise InvalidProgramError(
                f"{what} {c!r}: port {p} is out of range; this switch has ports 0..{radix - 1}"
            )
    if a == b:
        raise InvalidProgramError(f"{what} {c!r} joins port {a} to itself")
    return circuit(a, b)


def check_program(
    radix: int,
    live: Collection[Circuit],
    connect: Iterable[object],
    disconnect: Iterable[object],
) -> tuple[frozenset[Circuit], frozenset[Circuit]]:
    """Validate a program against a switch's live circuits; returns ``(connect, disconnect)``
    normalized. Raises :class:`InvalidProgramError` when a port is out of range, a port appears
    twice among the connects (or among the disconnects), a disconnect is not live, or a connect
    uses a port that stays in a live circuit."""
    live = frozenset(live)
    cut: set[Circuit] = set()
    used: dict[int, Circuit] = {}
    for raw in disconnect:
        c = _normal(raw, radix, "disconnect")
        if c not in live:
            raise InvalidProgramError(f"disconnect {c}: no such live circuit; read circuits()")
        for p in c:
            if p in used:
                raise InvalidProgramError(f"disconnect {c}: port {p} is also in {used[p]}")
            used[p] = c
        cut.add(c)
    busy = {p: c for c in live - cut for p in c}
    made: set[Circuit] = set()
    used = {}
    for raw in connect:
        c = _normal(raw, radix, "connect")
        for p in c:
            if p in used:
                raise InvalidProgramError(
                    f"connect {c}: port {p} is also in {used[p]}; a port joins one circuit"
                )
            if p in busy:
                raise InvalidProgramError(
                    f"connect {c}: port {p} is in live circuit {busy[p]}; disconnect it in the "
                    f"same program"
                )
            used[p] = c
        made.add(c)
    return frozenset(made), frozenset(cut)


def check_generation(generation: object, current: int) -> int:
    """Raise unless ``generation`` is an integer newer than ``current``."""
    if not isinstance(generation, int) or isinstance(generation, bool):
        raise InvalidProgramError(f"generation {generation!r} is not an integer")
    if generation <= current:
        raise StaleGenerationError(generation, current)
    return generation


def apply_program(
    live: Collection[Circuit], connect: Collection[Circuit], disconnect: Collection[Circuit]
) -> frozenset[Circuit]:
    """The live set after a validated program."""
    return (frozenset(live) - frozenset(disconnect)) | frozenset(connect)
