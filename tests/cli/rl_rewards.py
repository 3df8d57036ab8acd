"""Reward functions for ``orchestr rl train``'s tests, imported by the reward workers."""

from __future__ import annotations


def first_digit(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion starts with the answer's digit, 0.2 for another digit."""
    text = completion.strip()
    if not text or not text[0].isdigit():
        return 0.0
    return 1.0 if text[0] == answer else 0.2


def flaky(prompt: str, completion: str, id: int) -> float:
    """Raises on odd rows: the run counts the errors and goes on."""
    if id % 2:
        raise RuntimeError("a reward that fails on odd rows")
    return 0.5


def digit_match(completion: str, answer: str) -> float:
    """The share of the answer's digits the completion has in place (its extra characters
    count against it): partial credit, so a sample that is half right is told so."""
    text = completion.strip()
    hits = sum(a == b for a, b in zip(text, answer, strict=False))
    return hits / max(len(answer), len(text), 1)
