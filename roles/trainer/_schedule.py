"""Learning-rate schedules, pure: the rate of the batch trained at each policy version.

A schedule is a function of the version alone (the number of batches trained on), so a
trainer restored from a checkpoint goes on at the rate it had. ``warmup`` versions first
climb linearly to the base rate (``lr * (v + 1) / warmup``: the first batch already moves,
as in Goyal et al. 2017, "Accurate, Large Minibatch SGD", arXiv:1706.02677); then
``constant`` keeps it, ``cosine`` (Loshchilov & Hutter 2017, "SGDR", arXiv:1608.03983) and
``linear`` lower it to ``min_ratio`` of it over the remaining ``steps - warmup`` versions, and
hold it there.
"""

from __future__ import annotations

import math

__all__ = ["LR_SCHEDULES", "scheduled_lr"]

#: ``constant``; ``cosine`` or ``linear``: from the base rate down to ``min_ratio`` of it.
LR_SCHEDULES = ("constant", "cosine", "linear")


def scheduled_lr(
    lr: float, version: int, schedule: str, steps: int, min_ratio: float, *, warmup: int = 0
) -> float:
    """The learning rate of the batch trained at ``version`` (0 for the first): ``warmup``
    versions of linear warm-up, then ``schedule`` (one of :data:`LR_SCHEDULES`) over the
    ``steps`` versions counted from 0 (a decay spans ``steps - warmup`` of them). Pure.

    Raises ``ValueError`` for an unknown schedule, ``steps < 1``, ``min_ratio`` outside
    ``[0, 1]``, a negative ``warmup``, or a decaying schedule whose ``warmup`` leaves it no
    step (``warmup >= steps``)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {schedule!r}")
    if steps < 1 or not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"lr steps must be >= 1 and min_ratio in [0, 1], got {steps}, {min_ratio}")
    if warmup < 0 or (schedule != "constant" and warmup >= steps):
        raise ValueError(
            f"warmup must be >= 0 and, for a decaying schedule, less than steps ({steps}); "
            f"got {warmup}"
        )
    if warmup and version < warmup:
        return lr * (max(version, 0) + 1) / warmup
    if schedule == "constant":
        return lr
    span = steps - warmup
    done = min(max(version - warmup, 0), span) / span
    if schedule == "linear":
        return lr * (min_ratio + (1.0 - min_ratio) * (1.0 - done))
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * done)))
