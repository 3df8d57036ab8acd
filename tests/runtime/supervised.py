"""Actors the supervision tests kill, restart and restore; workers import them by path."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
from typing import Any

import orchestr as oc


class Keeper(oc.Actor):
    """Remembers its constructor arguments and a running total it can save and restore."""

    def __init__(self, seed: int, tag: str = "") -> None:
        self.seed = seed
        self.tag = tag
        self.total = 0
        self.restored: Any = None

    @oc.endpoint
    def whoami(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "seed": self.seed, "tag": self.tag, "rank": self.rank}

    @oc.endpoint
    def add(self, n: int) -> int:
        self.total += n
        return self.total

    @oc.endpoint
    def square(self, x: int) -> int:
        return x * x

    @oc.endpoint
    async def slow_square(self, x: int, seconds: float) -> int:
        await asyncio.sleep(seconds)
        return x * x

    @oc.endpoint
    def restored_from(self) -> Any:
        return self.restored

    @oc.endpoint
    def crash(self) -> None:
        """A segmentation fault in native code, as a buggy extension would cause."""
        ctypes.string_at(0)

    @oc.endpoint
    def exit_hard(self, code: int) -> None:
        os._exit(code)

    def save_state(self) -> dict[str, int]:
        return {"total": self.total}

    def load_state(self, state: dict[str, int]) -> None:
        self.restored = state
        self.total = state["total"]


class Caller(oc.Actor):
    """Calls another mesh it was handed, from its own worker."""

    def __init__(self) -> None:
        pass

    @oc.endpoint
    async def call_square(self, target: oc.Mesh, x: int) -> int:
        result: int = await target.square.call_one(x)
        return result


class BadRestore(oc.Actor):
    def __init__(self) -> None:
        pass

    @oc.endpoint
    def pid(self) -> int:
        return os.getpid()

    def save_state(self) -> int:
        return 1

    def load_state(self, state: int) -> None:
        raise RuntimeError("cannot restore from this checkpoint")


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)


class Ranked(oc.Actor):
    """A member of a torch.distributed group set up by the runtime."""

    def __init__(self) -> None:
        pass

    @oc.endpoint
    def all_reduce(self, value: float) -> list[float]:
        import torch
        from torch import distributed as dist

        t = torch.tensor([value, float(dist.get_rank())])
        dist.all_reduce(t)
        return [float(x) for x in t]
