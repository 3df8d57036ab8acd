"""Stage factories for the pipeline actors' tests: workers import them by name."""

from __future__ import annotations

import torch
from torch import nn

WIDTH = 8


class Residual(nn.Module):
    """A block whose output is its input plus a function of it, with a parameter of its own
    used before a child module (the case a split backward must get right)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.inner = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.inner(x * self.scale))


def make_stage(stage: int, stages: int, width: int = WIDTH) -> nn.Module:
    """Stage ``stage`` of ``stages``: a linear layer, a norm and a residual block; the last
    stage ends with a head to one output."""
    layers: list[nn.Module] = [nn.Linear(width, width), nn.LayerNorm(width), Residual(width)]
    if stage == stages - 1:
        layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def not_a_module(stage: int, stages: int) -> object:
    return "a string"


def make_pair(stage: int, stages: int, width: int = WIDTH) -> nn.Module:
    """A stage whose parametrised module returns a tuple (a split backward's fallback)."""

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.randn(width) * 0.1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * self.a, x + self.a

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pair = Pair()
            self.head = nn.Linear(width, 1 if stage == stages - 1 else width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            left, right = self.pair(x)
            return self.head(left * right)

    return Stage()


class _Guard(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bool(torch.isfinite(x).all()):
            raise ValueError("a non-finite activation reached the last stage")
        return x


def make_guarded(stage: int, stages: int, width: int = WIDTH) -> nn.Module:
    """:func:`make_stage`, the last stage refusing a non-finite input (a rank that fails)."""
    inner = make_stage(stage, stages, width)
    return nn.Sequential(_Guard(), inner) if stage == stages - 1 else inner
