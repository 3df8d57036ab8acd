"""Routing between a pair's circuits and its electrical path: the :class:`Router` seam the
reconfiguration drains and undrains through, and :class:`RecordingRouter` for fabrics whose
routes follow the circuits by themselves."""

from __future__ import annotations

from typing import Protocol

from ._reconfig_model import Pair

__all__ = ["RecordingRouter", "Router"]


class Router(Protocol):
    """Moves a pair's traffic between its circuits and the electrical path (which always
    exists). Both calls block until the routes are in place and raise when they are not."""

    async def drain(self, pairs: frozenset[Pair]) -> None:
        """Route the pairs over the electrical path only.

        Blocks until the routes are in place; raises (the router's error) when they are not.
        Repeating a drain is harmless, so a cancelled one is retried."""
        ...

    async def undrain(self, pairs: frozenset[Pair]) -> None:
        """Route the pairs over their live circuits (and the electrical path).

        Blocks, raises and may be cancelled as :meth:`drain`."""
        ...


class RecordingRouter:
    """A router for a fabric whose routes follow the circuits by themselves (a simulated one):
    it records what it was asked, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, frozenset[tuple[str, str]]]] = []

    async def drain(self, pairs: frozenset[tuple[str, str]]) -> None:
        """Record the drain; blocks on nothing, raises nothing, cancel-safe."""
        self.calls.append(("drain", pairs))

    async def undrain(self, pairs: frozenset[tuple[str, str]]) -> None:
        """Record the undrain; blocks on nothing, raises nothing, cancel-safe."""
        self.calls.append(("undrain", pairs))
