"""The reward role: a stateless mesh that scores samples.

Two ways to score, chosen at spawn:

- ``Reward(scorer)``: a scorer is any function ``(prompt, completion) -> float`` importable by
  path (``"package.module:function"``), called in the worker on :meth:`Reward.score`'s pairs;
  the rule-based scorer of the example task (``orchestr.roles:reverse_task.reward``: the
  fraction of positions equal to the reversed prompt) is the default.
- ``Reward(functions=[...])``: weighted reward functions on a dataset's rows
  (:meth:`Reward.score_rows`), run in a process of the worker's own under time limits, so no
  function, however it fails, stalls the worker or fails a batch (:mod:`._runner`).

Stateless but for counters: any member scores any sample, so the mesh is scaled by its size and
called with ``choose`` or from a graph stage, and a restarted member needs nothing back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orchestr as oc

from .._common._factory import import_object
from .._common._hf._tokenizer import Tokenizer
from ._batch import CAUSES
from ._rows import parse_rows
from ._runner import FunctionRunner
from ._spec import resolve

__all__ = ["DEFAULT_SCORER", "Reward", "load_scorer"]

DEFAULT_SCORER = "orchestr.roles:reverse_task.reward"

Scorer = Callable[[Any, Any], float]


def load_scorer(path: str) -> Scorer:
    """Import ``module:function``; raises :class:`orchestr.ConfigError` saying what is wrong."""
    scorer: Scorer = import_object(path, "scorer")
    return scorer


def _number(name: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise oc.ConfigError(f"Reward's {name} is a finite number, got {value!r}")
    if positive and value <= 0:
        raise oc.ConfigError(f"Reward's {name} is above 0, got {value!r}")
    return float(value)


class Reward(oc.Actor):
    """Scores ``(prompt, completion)`` pairs with the scorer named at spawn, or a dataset's
    rows with weighted reward functions.

    ``Reward(scorer)`` (the default scorer when nothing is given) serves :meth:`score`.
    ``Reward(functions=[{"path": "module:function", "weight": 1.0, "name": ..., "args":
    {...}}, ...], tokenizer=None, timeout_s=5.0, default=0.0)`` serves :meth:`score_rows`:
    each function is ``fn(prompt, completion, **fields)`` (see :mod:`._spec` for which fields
    it receives), ``tokenizer`` a checkpoint folder whose tokenizer decodes rows given as
    token ids, ``timeout_s`` each call's limit, ``default`` the value of a call that failed.
    Raises :class:`orchestr.ConfigError` (a ``SpawnError`` at spawn) for both a scorer and
    functions, a function that does not import or whose signature cannot take rows, or a
    folder without a tokenizer."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    def __init__(
        self,
        scorer: str | None = None,
        *,
        functions: Sequence[Mapping[str, Any]] | None = None,
        tokenizer: str | None = None,
        timeout_s: float = 5.0,
        default: float = 0.0,
    ) -> None:
        self.scored = 0
        self.runner: FunctionRunner | None = None
        if functions is None:
            if tokenizer is not None:
                raise oc.ConfigError("Reward's tokenizer decodes rows for functions=[...]")
            self.scorer_path: str | None = scorer or DEFAULT_SCORER
            self.scorer: Scorer | None = load_scorer(self.scorer_path)
            return
        if scorer is not None:
            raise oc.ConfigError(
                f"Reward takes a scorer or functions, not both: got scorer {scorer!r} and "
                f"functions; put the scorer among the functions"
            )
        self.scorer_path = self.scorer = None
        self.specs = resolve(functions)
        self.timeout_s = _number("timeout_s", timeout_s, positive=True)
        self.default = _number("default", default)
        self.tokenizer = None if tokenizer is None else Tokenizer(tokenizer)
        self.runner = FunctionRunner(self.specs, self.timeout_s, self.default)
        self.failures = {spec.name: dict.fromkeys(CAUSES, 0) for spec in self.specs}
        self.last_error: dict[str, str] = {}

    @oc.endpoint
    def score(self, samples: Sequence[Sequence[Any]]) -> list[float]:
        """One reward per ``[prompt, completion]`` pair, in order. Raises ValueError for a
        malformed pair or a scorer result that is not a finite number."""
        if self.scorer is None:
            raise ValueError("this Reward scores rows with functions: call score_rows")
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
    async def score_rows(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Score dataset rows with the weighted functions. Each row is ``{"prompt": str,
        "completion": str, "completion_ids": [int], "fields": {...}}`` (``completion`` or
        ``completion_ids``, decoded with the tokenizer skipping special tokens; ``fields``
        optional). Returns ``{"rewards": [per row: the functions' values weighted and
        summed], "per_function": {name: [value per row]}, "failures": {name: {"error": n,
        "timeout": n}}}``; a call that raised, returned no finite number (a bool counts 1.0 or
        0.0), ran past ``timeout_s`` or killed its process scores ``default`` for its
        function and is counted by cause, and never fails the batch.

        Raises ``ValueError`` for malformed rows (naming the first) or on an actor spawned
        with a scorer. Blocks on the reward process (started on first use: seconds for heavy
        imports), at most ``timeout_s`` plus slack per call, without blocking the worker's
        event loop; batches run one at a time. Cancelled, it kills that process."""
        if self.runner is None:
            raise ValueError(
                "this Reward was spawned with a scorer: call score, or spawn "
                "Reward(functions=[...]) to score rows"
            )
        decode = None if self.tokenizer is None else self.tokenizer.decode
        batch = await self.runner.run(parse_rows(rows, decode))
        self.scored += batch.rows
        for name, counts, text in zip(batch.names, batch.failures, batch.last_error, strict=True):
            for cause, n in counts.items():
                self.failures[name][cause] += n
            if text is not None:
                self.last_error[name] = text
        return batch.result()

    @oc.endpoint
    def stats(self) -> dict[str, Any]:
        """Counters since this member started: with a scorer ``{"scorer", "scored"}``; with
        functions ``{"functions", "scored", "failures", "last_error", "starts", "losses"}``
        (reward processes started; killed at a deadline or found dead)."""
        if self.runner is None:
            return {"scorer": self.scorer_path, "scored": self.scored}
        return {
            "functions": [spec.name for spec in self.specs],
            "scored": self.scored,
            "failures": {name: dict(c) for name, c in self.failures.items()},
            "last_error": dict(self.last_error),
            "starts": self.runner.starts,
            "losses": self.runner.losses,
        }

    async def aclose(self) -> None:
        """Stop the reward process, for a Reward used in this process (a worker's dies with
        the worker). Blocks until the process is killed and reaped; raises nothing of its
        own; idempotent and cancel-safe (the process is killed before the first wait)."""
        if self.runner is not None:
            await self.runner.aclose()
