"""The reward role: a stateless mesh that scores samples.

Two ways to score, chosen at spawn:

- ``Reward(scorer)``: a scorer is any function ``(prompt, completion) -> float`` importable by
  path (``"package.module:function"``), called in the worker on :meth:`Reward.score`'s pairs;
  the rule-based scorer of the example task (``orchestr.roles:reverse_task.reward``: the
  fraction of positions equal to the reversed prompt) is the default.
- ``Reward(functions=[...], model=folder)``: a dataset's rows (:meth:`Reward.score_rows`)
  scored by weighted reward functions, run in a process of the worker's own under time
  limits, so no function, however it fails, stalls the worker or fails a batch
  (:mod:`._runner`), and/or by a neural reward model (a one-label ``...ForSequenceClassification``
  checkpoint), loaded once at spawn and run in the worker's own process, in a thread, on the
  rows' text (:mod:`._model`). Both at once run side by side; a row's reward is the weighted
  sum of them all.

Stateless but for counters: any member scores any sample, so the mesh is scaled by its size and
called with ``choose`` or from a graph stage, and a restarted member needs nothing back.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

import orchestr as oc

from .._common._factory import import_object
from .._common._hf._tokenizer import Tokenizer
from ._batch import CAUSES, Batch
from ._model import ModelScorer, check_name, merge
from ._rows import parse_rows
from ._runner import FunctionRunner, Row
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
    rows with weighted reward functions and/or a reward model.

    ``Reward(scorer)`` (the default scorer when nothing is given) serves :meth:`score`.
    ``Reward(functions=[{"path": "module:function", "weight": 1.0, "name": ..., "args":
    {...}}, ...], tokenizer=None, timeout_s=5.0, default=0.0, model=None, model_weight=1.0,
    model_name="reward_model", torch_threads=None)`` serves :meth:`score_rows`: each function
    is ``fn(prompt, completion, **fields)`` (see :mod:`._spec` for which fields it receives),
    ``tokenizer`` a checkpoint folder whose tokenizer decodes rows given as token ids,
    ``timeout_s`` each call's limit, ``default`` the value of a call that failed. ``model`` is
    a reward model's checkpoint folder (``LlamaForSequenceClassification`` or
    ``Qwen2ForSequenceClassification``, one label, with its own tokenizer), loaded at spawn;
    it scores each row's text (:mod:`._model`), weighted by ``model_weight``, reported under
    ``model_name``; functions may then be left out. ``torch_threads`` sets the threads its
    forward passes use (set for the worker's process, as the other roles do). Raises :class:`orchestr.ConfigError` (a ``SpawnError`` at spawn) for
    a scorer with functions or a model, a function that does not import or whose signature
    cannot take rows, a folder without a tokenizer, or a model folder that does not load as a
    reward model."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    def __init__(
        self,
        scorer: str | None = None,
        *,
        functions: Sequence[Mapping[str, Any]] | None = None,
        tokenizer: str | None = None,
        timeout_s: float = 5.0,
        default: float = 0.0,
        model: str | os.PathLike[str] | None = None,
        model_weight: float = 1.0,
        model_name: str = "reward_model",
        torch_threads: int | None = None,
    ) -> None:
        self.scored = 0
        self.runner: FunctionRunner | None = None
        self.model: ModelScorer | None = None
        if torch_threads is not None:
            if isinstance(torch_threads, bool) or not isinstance(torch_threads, int):
                raise oc.ConfigError(f"Reward's torch_threads is an integer, got {torch_threads!r}")
            _number("torch_threads", torch_threads, positive=True)
            torch.set_num_threads(torch_threads)
        if functions is None and model is None:
            if tokenizer is not None:
                raise oc.ConfigError(
                    "Reward's tokenizer decodes rows for functions=[...] or model=..."
                )
            self.scorer_path: str | None = scorer or DEFAULT_SCORER
            self.scorer: Scorer | None = load_scorer(self.scorer_path)
            return
        if scorer is not None:
            given = "functions" if functions is not None else "a model"
            raise oc.ConfigError(
                f"Reward takes a scorer or {given}, not both: got scorer {scorer!r} and "
                f"{given}; put the scorer among the functions"
            )
        self.scorer_path = self.scorer = None
        self.specs = [] if functions is None else resolve(functions)
        self.timeout_s = _number("timeout_s", timeout_s, positive=True)
        self.default = _number("default", default)
        self.tokenizer = None if tokenizer is None else Tokenizer(tokenizer)
        if self.specs:
            self.runner = FunctionRunner(self.specs, self.timeout_s, self.default)
        names = [spec.name for spec in self.specs]
        if model is not None:
            if not isinstance(model, str | os.PathLike):
                raise oc.ConfigError(f"Reward's model is a checkpoint folder, got {model!r}")
            self.model_name = check_name(model_name, names)
            self.model_weight = _number("model_weight", model_weight)
            self.model = ModelScorer(os.fspath(model), threads=torch_threads)
            names.append(self.model_name)
        self.truncated = 0
        self.failures = {name: dict.fromkeys(CAUSES, 0) for name in names}
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
        """Score dataset rows with the weighted functions and the reward model. Each row is
        ``{"prompt": str, "completion": str, "completion_ids": [int], "fields": {...}}``
        (``completion`` or ``completion_ids``, decoded with the tokenizer skipping special
        tokens; ``fields`` optional). Returns ``{"rewards": [per row: the functions' and the
        model's values weighted and summed], "per_function": {name: [value per row]},
        "failures": {name: {"error": n, "timeout": n}}}``, the model under its
        ``model_name``; a call that raised, returned no finite number (a bool counts 1.0 or
        0.0), ran past ``timeout_s`` or killed its process, or a row the model could not
        score (:mod:`._model`), scores ``default`` for its function and is counted by cause,
        and never fails the batch.

        The model scores ``prompt + completion`` as text, in its own tokenizer (never the
        policy's ``completion_ids``), the start cut off past its ``max_position_embeddings``.

        Raises ``ValueError`` for malformed rows (naming the first) or on an actor spawned
        with a scorer. Blocks on the reward process (started on first use: seconds for heavy
        imports), at most ``timeout_s`` plus slack per call, and on the model's forward
        passes (in a thread, beside the functions), without blocking the worker's event
        loop; batches run one at a time. Cancelled, it kills that process and waits for the
        model's batch in progress."""
        if self.scorer is not None:
            raise ValueError(
                "this Reward was spawned with a scorer: call score, or spawn "
                "Reward(functions=[...]) to score rows"
            )
        decode = None if self.tokenizer is None else self.tokenizer.decode
        parsed = parse_rows(rows, decode)
        if self.model is None:
            batch = await self._functions(parsed)
            return self._tally(batch, batch.result())
        async with self.model.open_run(parsed, self.default) as run:
            batch = await self._functions(parsed)
            scores = await run.result()
        self.truncated += scores.truncated
        result = merge(batch.result(), self.model_name, self.model_weight, scores)
        self._count(self.model_name, scores.failures, scores.last_error)
        return self._tally(batch, result)

    async def _functions(self, parsed: list[Row]) -> Batch:
        if self.runner is None:
            return Batch([], [], len(parsed), self.default)
        return await self.runner.run(parsed)

    def _tally(self, batch: Batch, result: dict[str, Any]) -> dict[str, Any]:
        self.scored += batch.rows
        for name, counts, text in zip(batch.names, batch.failures, batch.last_error, strict=True):
            self._count(name, counts, text)
        return result

    def _count(self, name: str, counts: Mapping[str, int], text: str | None) -> None:
        for cause, n in counts.items():
            self.failures[name][cause] += n
        if text is not None:
            self.last_error[name] = text

    @oc.endpoint
    def stats(self) -> dict[str, Any]:
        """Counters since this member started: with a scorer ``{"scorer", "scored"}``; for
        rows ``{"functions", "scored", "failures", "last_error", "starts", "losses"}``
        (reward processes started; killed at a deadline or found dead), with a model also
        ``"model"`` (its name) and ``"truncated"`` (rows cut to its length)."""
        if self.scorer is not None:
            return {"scorer": self.scorer_path, "scored": self.scored}
        out: dict[str, Any] = {
            "functions": [spec.name for spec in self.specs],
            "scored": self.scored,
            "failures": {name: dict(c) for name, c in self.failures.items()},
            "last_error": dict(self.last_error),
            "starts": 0 if self.runner is None else self.runner.starts,
            "losses": 0 if self.runner is None else self.runner.losses,
        }
        if self.model is not None:
            out |= {"model": self.model_name, "truncated": self.truncated}
        return out

    async def aclose(self) -> None:
        """Stop the reward process, for a Reward used in this process (a worker's dies with
        the worker). Blocks until the process is killed and reaped; raises nothing of its
        own; idempotent and cancel-safe (the process is killed before the first wait)."""
        if self.runner is not None:
            await self.runner.aclose()
