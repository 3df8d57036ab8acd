"""Actors the security suite attacks."""

from __future__ import annotations

import os
import sys

import orchestr as oc


class Target(oc.Actor):
    def __init__(self) -> None:
        self.total = 0

    @oc.endpoint
    def add(self, n: int) -> int:
        self.total += n
        return self.total

    @oc.endpoint
    def pid(self) -> int:
        return os.getpid()

    @oc.endpoint
    def imported(self, module: str) -> bool:
        return module in sys.modules


class Member(oc.Actor):
    """A member of a torch.distributed group."""

    @oc.endpoint
    def pid(self) -> int:
        return os.getpid()

    @oc.endpoint
    def all_reduce(self, value: float) -> float:
        import torch
        from torch import distributed as dist

        t = torch.tensor([value])
        dist.all_reduce(t)
        return float(t[0])
