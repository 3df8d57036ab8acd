"""User scorers the reward tests plug in by path."""

from __future__ import annotations

from typing import Any


def length_ratio(prompt: Any, completion: Any) -> float:
    return len(completion) / max(1, len(prompt))


def not_a_number(prompt: Any, completion: Any) -> Any:
    return "high"


NOT_CALLABLE = 3
