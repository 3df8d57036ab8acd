"""``sim``: an in-process optical circuit switch with a latency model and faults on demand.

A program travels to the switch (an optional command delay), takes a latency drawn from the
model (MEMS-like 10-25 ms by default; pass microseconds for tests), is applied at once if it is
still valid then, and is acknowledged (an optional ack delay, or no ack at all). The switch side
runs on the event loop's timers, so a caller that gives up on a program does not stop the switch
from applying it; the generation fence does: a command that arrives after a newer generation is
ignored. Every step goes to :attr:`SimOcs.events` and to the ``on_event`` callback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable, Collection, Sequence

from orchestr import clock
from orchestr.errors import ClosedResourceError

from ._ocs import (
    Circuit,
    OcsError,
    PortFailedError,
    StaleGenerationError,
    VerifyError,
    apply_program,
    check_generation,
    check_program,
    circuit,
)

__all__ = ["MEMS_LATENCY_S", "LatencyModel", "SimEvent", "SimOcs"]

MEMS_LATENCY_S = (0.010, 0.025)
"""The default per-program latency range in seconds: a MEMS mirror switch."""

LatencyModel = float | tuple[float, float] | Callable[[random.Random], float]
"""Fixed seconds, a uniform ``(low, high)`` range, or a function of the switch's RNG."""


@dataclasses.dataclass(frozen=True)
class SimEvent:
    """One thing the simulated switch did.

    ``kind``: ``program`` (command sent), ``applied``, ``rejected``, ``stale-ignored``,
    ``ack``, ``ack-dropped``, ``port-failed``, ``circuit-dropped``, ``port-repaired``,
    ``port-slow``, ``closed``.
    """

    at: float
    kind: str
    generation: int
    connect: frozenset[Circuit] = frozenset()
    disconnect: frozenset[Circuit] = frozenset()
    detail: str = ""


class SimOcs:
    """A simulated OCS satisfying :class:`~orchestr.fabric._optical._ocs.OcsDriver`.

    ``latency``: what a program takes; ``read_s``: what a read of the switch's state
    (:meth:`circuits`, :meth:`verify`) takes, a query's round trip (none by default)."""

    def __init__(
        self,
        radix: int,
        *,
        latency: LatencyModel = MEMS_LATENCY_S,
        rng: int | random.Random | None = None,
        circuits: Collection[tuple[int, int]] = (),
        on_event: Callable[[SimEvent], None] | None = None,
        read_s: float = 0.0,
    ) -> None:
        if radix < 2:
            raise ValueError(f"an OCS needs at least 2 ports, not {radix}")
        if not read_s >= 0:
            raise ValueError(
                f"read_s is the seconds a read of the switch takes, >= 0, not {read_s}"
            )
        self._radix = radix
        self._latency = latency
        self._read_s = float(read_s)
        self._rng = rng if isinstance(rng, random.Random) else random.Random(rng)
        self._on_event = on_event
        made, _ = check_program(radix, (), circuits, ())
        self._live = made
        self._generation = 0
        self._failed: set[int] = set()
        self._slow: dict[int, float] = {}
        self._timers: set[asyncio.TimerHandle] = set()
        self._pending: set[asyncio.Future[None]] = set()
        self._drop_acks = 0
        self._ack_delays: list[float] = []
        self._command_delays: list[float] = []
        self._fail_programs: list[str] = []
        self._closed = False
        self.events: list[SimEvent] = []

    # -- state, read without the switch's latency ------------------------------------------

    @property
    def radix(self) -> int:
        return self._radix

    @property
    def live(self) -> frozenset[Circuit]:
        return self._live

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def failed_ports(self) -> frozenset[int]:
        return frozenset(self._failed)

    # -- the driver contract ---------------------------------------------------------------

    async def program(
        self, generation: int, connect: Sequence[Circuit], disconnect: Sequence[Circuit]
    ) -> None:
        """Apply a program (see :meth:`OcsDriver.program`). Blocks on the modelled latency and
        acknowledgement; raises as the contract says. Not cancel-safe: the switch applies a
        program it received even when the caller gave up waiting (the generation fences it)."""
        self._check_open()
        made, cut = check_program(self._radix, self._live, connect, disconnect)
        check_generation(generation, self._generation)
        ports = {p for c in made | cut for p in c}
        self._refuse_failed(generation, ports)
        loop = asyncio.get_running_loop()
        ack: asyncio.Future[None] = loop.create_future()
        self._pending.add(ack)
        delay = self._command_delays.pop(0) if self._command_delays else 0.0
        factor = max([self._slow.get(p, 1.0) for p in ports], default=1.0)
        self._log("program", generation, made, cut, f"latency x{factor:g}, delay {delay:g} s")
        self._later(delay + self._draw() * factor, self._apply, generation, made, cut, ack)
        try:
            await ack
        finally:
            self._pending.discard(ack)

    async def circuits(self) -> tuple[int, frozenset[Circuit]]:
        """The generation and live circuits (see :meth:`OcsDriver.circuits`), as they are when
        the read reaches the switch. Blocks on the modelled read (``read_s``); raises
        :class:`ClosedResourceError` once closed; cancel-safe."""
        self._check_open()
        await asyncio.sleep(self._read_s)
        self._check_open()
        return self._generation, self._live

    async def verify(self, generation: int, expected: Collection[Circuit]) -> None:
        """See :meth:`OcsDriver.verify`: blocks on the modelled read (``read_s``); raises
        :class:`VerifyError`; cancel-safe."""
        self._check_open()
        await asyncio.sleep(self._read_s)
        self._check_open()
        want = frozenset(circuit(a, b) for a, b in expected)
        if self._generation != generation or self._live != want:
            raise VerifyError(
                generation=generation,
                found_generation=self._generation,
                missing=want - self._live,
                extra=self._live - want,
            )

    async def aclose(self) -> None:
        """Stop the simulated switch's timers; later calls raise :class:`ClosedResourceError`.
        Blocks on nothing; idempotent and cancel-safe."""
        if self._closed:
            return
        self._closed = True
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        for ack in self._pending:
            if not ack.done():
                ack.set_exception(ClosedResourceError("the simulated OCS was closed"))
        self._log("closed", self._generation)

    # -- faults on demand ------------------------------------------------------------------

    def fail_port(self, port: int, *, after_s: float | None = None) -> None:
        """Fail ``port`` now (or ``after_s`` seconds from now): its circuit drops and programs
        touching it fail with :class:`PortFailedError` until :meth:`repair_port`."""
        self._port(port)
        if after_s is not None:
            self._later(after_s, self.fail_port, port)
            return
        self._failed.add(port)
        self._log("port-failed", self._generation, detail=f"port {port}")
        dropped = {c for c in self._live if port in c}
        if dropped:
            self._live -= dropped
            self._log("circuit-dropped", self._generation, disconnect=frozenset(dropped))

    def repair_port(self, port: int) -> None:
        self._failed.discard(self._port(port))
        self._log("port-repaired", self._generation, detail=f"port {port}")

    def slow_port(self, port: int, factor: float) -> None:
        """Programs touching ``port`` take ``factor`` times the drawn latency (1 resets)."""
        if factor <= 0:
            raise ValueError(f"a slow-down factor must be positive, not {factor}")
        self._slow[self._port(port)] = factor
        self._log("port-slow", self._generation, detail=f"port {port} x{factor:g}")

    def drop_next_ack(self) -> None:
        """The next program is applied but never acknowledged (the caller's deadline ends it)."""
        self._drop_acks += 1

    def delay_next_ack(self, seconds: float) -> None:
        """The next program is applied on time but acknowledged ``seconds`` later."""
        self._ack_delays.append(seconds)

    def delay_next_command(self, seconds: float) -> None:
        """The next program reaches the switch ``seconds`` late (a newer one may overtake it)."""
        self._command_delays.append(seconds)

    def fail_next_program(self, reason: str = "injected fault") -> None:
        """The next program that reaches the switch is rejected with :class:`OcsError`."""
        self._fail_programs.append(reason)

    # -- the switch side -------------------------------------------------------------------

    def _apply(
        self,
        generation: int,
        made: frozenset[Circuit],
        cut: frozenset[Circuit],
        ack: asyncio.Future[None],
    ) -> None:
        result: BaseException | None = None
        try:
            if self._fail_programs:
                raise OcsError(f"the switch rejected the program: {self._fail_programs.pop(0)}")
            try:
                check_generation(generation, self._generation)
            except StaleGenerationError:
                self._log("stale-ignored", generation, made, cut)
                raise
            ports = {p for c in made | cut for p in c}
            self._refuse_failed(generation, ports)
            check_program(self._radix, self._live, made, cut)
        except OcsError as exc:
            result = exc
            if not isinstance(exc, StaleGenerationError):
                self._log("rejected", generation, made, cut, str(exc))
        else:
            self._live = apply_program(self._live, made, cut)
            self._generation = generation
            self._log("applied", generation, made, cut)
        if self._drop_acks:
            self._drop_acks -= 1
            self._log("ack-dropped", generation)
            return
        delay = self._ack_delays.pop(0) if self._ack_delays else 0.0
        self._later(delay, self._acknowledge, generation, ack, result)

    def _acknowledge(
        self, generation: int, ack: asyncio.Future[None], result: BaseException | None
    ) -> None:
        self._log("ack", generation, detail="" if result is None else type(result).__name__)
        if ack.done():  # the caller gave up: a late acknowledgement reaches no one
            return
        if result is None:
            ack.set_result(None)
        else:
            ack.set_exception(result)

    def _refuse_failed(self, generation: int, ports: set[int]) -> None:
        bad = ports & self._failed
        if bad:
            raise PortFailedError(
                f"generation {generation}: ports {sorted(bad)} have failed; plan around them",
                bad,
            )

    def _later(self, delay: float, fn: Callable[..., None], *args: object) -> None:
        def fire() -> None:
            self._timers.discard(timer)
            fn(*args)

        timer = asyncio.get_running_loop().call_later(delay, fire)
        self._timers.add(timer)

    def _draw(self) -> float:
        model = self._latency
        if callable(model):
            return max(0.0, model(self._rng))
        if isinstance(model, tuple):
            return self._rng.uniform(*model)
        return model

    def _port(self, port: int) -> int:
        if not 0 <= port < self._radix:
            raise ValueError(f"port {port} is out of range 0..{self._radix - 1}")
        return port

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError("the simulated OCS was closed; open a new one")

    def _log(
        self,
        kind: str,
        generation: int,
        connect: frozenset[Circuit] = frozenset(),
        disconnect: frozenset[Circuit] = frozenset(),
        detail: str = "",
    ) -> None:
        event = SimEvent(clock.monotonic(), kind, generation, connect, disconnect, detail)
        self.events.append(event)
        if self._on_event is not None:
            self._on_event(event)
