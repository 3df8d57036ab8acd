"""User scorers the reward tests plug in by path."""

from __future__ import annotations

import time
from typing import Any

from orchestr.roles.rl import _task


def length_ratio(prompt: Any, completion: Any) -> float:
    return len(completion) / max(1, len(prompt))


def not_a_number(prompt: Any, completion: Any) -> Any:
    return "high"


NOT_CALLABLE = 3


def slow_reverse(prompt: Any, completion: Any) -> float:
    """The task's reward, 3 ms per sample: scoring a batch (0.4 s for 128) takes long enough
    for a test to kill the reward worker while it scores, however loaded the machine."""
    time.sleep(0.003)
    return _task.reward(prompt, completion)
