"""The model ``bench/pipeline.py`` cuts into stages: workers import it by name."""

from __future__ import annotations

from torch import nn


def mlp_stage(stage: int, stages: int, width: int = 512, depth: int = 4) -> nn.Module:
    """Stage ``stage`` of ``stages``: ``depth`` linear layers with GELUs; every stage alike
    (the last one's loss is the benchmark's only extra work)."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)
