"""Reward shaping the controller applies before the trainer sees a reward; pure functions.

:func:`overlong_penalty` is DAPO's soft overlong punishment (Yu et al. 2025, "DAPO",
arXiv:2503.14476, eq. 13): nothing for a completion that ends well before its limit, a
penalty growing linearly over the last ``buffer`` tokens, and the whole ``factor`` at the
limit and past it. Added to the task's reward, it teaches the policy to finish in time
rather than to be cut off, with a gentler signal than a hard penalty at the limit. (The
trainer's ``UpdateConfig.overlong_filter`` is the other half: it leaves completions that
were cut off out of the loss.)
"""

from __future__ import annotations

__all__ = ["overlong_penalty"]


def overlong_penalty(length: int, max_len: int, buffer: int, factor: float = 1.0) -> float:
    """The reward to add for a completion of ``length`` tokens whose limit is ``max_len``:
    0 up to ``max_len - buffer`` tokens, then linearly down to ``-factor`` at ``max_len``,
    and ``-factor`` beyond. With ``buffer`` 0 only a completion longer than ``max_len`` is
    penalised. Pure; raises ``ValueError`` for a negative ``length``, ``max_len < 1``,
    ``buffer`` outside ``[0, max_len]`` or a negative ``factor``."""
    if length < 0 or max_len < 1:
        raise ValueError(f"length must be >= 0 and max_len >= 1, got {length} and {max_len}")
    if not 0 <= buffer <= max_len:
        raise ValueError(f"buffer must be in [0, max_len={max_len}], got {buffer}")
    if not factor >= 0:
        raise ValueError(f"factor must be >= 0, got {factor}")
    start = max_len - buffer
    if length <= start:
        return 0.0
    if length >= max_len:
        return -float(factor)
    return -factor * (length - start) / buffer
