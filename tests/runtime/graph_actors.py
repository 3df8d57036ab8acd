"""Actor classes the graph tests spawn; workers import them by path."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import orchestr as oc


class Stage(oc.Actor):
    """Endpoints that take one graph item (or a batch) and say who handled it."""

    def __init__(self) -> None:
        self.calls = 0

    @oc.endpoint
    def double(self, x: int) -> int:
        return 2 * x

    @oc.endpoint
    async def work(self, item: list[Any]) -> list[Any]:
        """``[value, delay]`` -> ``[value, rank]`` after ``delay`` seconds."""
        value, delay = item
        await asyncio.sleep(delay)
        return [value, self.rank]

    @oc.endpoint
    def total(self, batch: list[int]) -> list[int]:
        """A batch's size and sum."""
        return [len(batch), sum(batch)]

    @oc.endpoint
    def step(self, x: int) -> list[int]:
        return [self.rank, x]

    @oc.endpoint
    def fail_on(self, x: int) -> int:
        if x == 3:
            raise ValueError(f"item {x} is bad")
        return x

    @oc.endpoint
    def pid(self) -> int:
        return os.getpid()

    @oc.endpoint
    def reset(self) -> None:
        self.calls = 0

    @oc.endpoint
    async def generate(self, x: int) -> oc.Versioned:
        """Made with the actor's "policy version", which goes up by one with every call."""
        await asyncio.sleep(0.005)
        self.calls += 1
        return oc.Versioned(x, self.calls - 1)


class Ordered(oc.Actor):
    """Remembers the values its steps brought, in the order they ran."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    @oc.endpoint
    def take(self, x: Any) -> list[Any]:
        self.seen.append(x)
        return [self.rank, x]

    @oc.endpoint
    def plus_one(self, x: int) -> int:
        if x < 0:
            raise ValueError(f"negative step value {x}")
        return x + 1

    @oc.endpoint
    def size(self, array: Any) -> int:
        return int(array.nbytes)

    @oc.endpoint
    def history(self) -> list[Any]:
        return self.seen

    @oc.endpoint
    def pid(self) -> int:
        return os.getpid()
