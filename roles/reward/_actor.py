"""The reward role: a stateless mesh that scores samples.

A scorer is any function ``(prompt, completion) -> float`` importable by path
(``"package.module:function"``), so user scorers plug in without code in the runtime; the
rule-based scorer of the example task (``orchestr.roles:reverse_task.reward``: the fraction of positions
equal to the reversed prompt) is the default. Stateless: any member scores any sample, so the
mesh is scaled by its size and called with ``choose`` or from a graph stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import orchestr as oc
from orchestr.roles._common._factory import import_object

__all__ = ["DEFAULT_SCORER", "Reward", "load_scorer"]

DEFAULT_SCORER = "orchestr.roles:reverse_task.reward"

Scorer = Callable[[Any, Any], float]


def load_scorer(path: str) -> Scorer:
    """Import ``module:function``; raises :class:`orchestr.ConfigError` saying what is wrong."""
    scorer: Scorer = import_object(path, "scorer")
    return scorer


class Reward(oc.Actor):
    """Scores ``(prompt, completion)`` pairs with the scorer named at spawn."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    def __init__(self, scorer: str = DEFAULT_SCORER) -> None:
        self.scorer_path = scorer
        self.scorer = load_scorer(scorer)
        self.scored = 0

    @oc.endpoint
    def score(self, samples: Sequence[Sequence[Any]]) -> list[float]:
        """One reward per ``[prompt, completion]`` pair, in order. Raises ValueError for a
        malformed pair or a scorer result that is not a finite number."""
        if not isinstance(samples, list | tuple):
            raise ValueError(f"score takes a list of [prompt, completion] pairs, got {samples!r}")
        rewards = []
        for i, pair in enumerate(samples):
            if not isinstance(pair, list | tuple) or len(pair) != 2:
                raise ValueError(f"sample {i} is not a [prompt, completion] pair: {pair!r}")
            value = self.scorer(pair[0], pair[1])
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{self.scorer_path} returned {value!r} for sample {i}")
            if not math.isfinite(value):
                raise ValueError(f"{self.scorer_path} returned {value!r} for sample {i}")
            rewards.append(float(value))
        self.scored += len(rewards)
        return rewards

    @oc.endpoint
    def stats(self) -> dict[str, Any]:
        return {"scorer": self.scorer_path, "scored": self.scored}
