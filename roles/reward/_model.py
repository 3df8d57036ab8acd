"""A neural reward model on the reward mesh: :class:`ModelScorer` scores ``score_rows``' rows
with a reward model checkpoint (:func:`orchestr.roles.models.load_reward_model`), in the
worker's own process, loaded once at spawn.

Text, never the policy's ids: a row's text is ``prompt + completion`` (a completion sent as
``completion_ids`` is decoded first, with the policy's tokenizer, as the functions get it),
encoded with the reward model's own tokenizer with its special tokens (``encode(text,
special=True)``: a BOS where its template adds one). The policy's ids are the policy
vocabulary's, which the reward model's need not share. A sequence longer than the model's
positions (``max_position_embeddings``) keeps its *end* (the completion, whose last token the
score is read at) and is counted as truncated.

Rows are scored in batches of at most :data:`BATCH_ROWS`, shortest first (less padding),
each batch right-padded, in a thread of the default executor (torch leaves the GIL, and the
worker's event loop keeps running). A row that cannot be scored (text its tokenizer cannot
spell, no tokens, an id past the model's vocabulary, a score that is not finite, or a batch
whose forward pass raised, each of its rows then tried alone) scores the default and counts
as an ``error``, as a failed reward function's call does; it never fails the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch

import orchestr as oc

from .._common._hf._scorer import RewardModel, load_reward_model
from .._common._hf._tokenizer import Tokenizer

__all__ = ["BATCH_ROWS", "ModelRun", "ModelScorer", "ModelScores", "check_name", "merge"]

#: The most rows one forward pass takes: bounds the activations' memory.
BATCH_ROWS = 32


@dataclasses.dataclass
class ModelScores:
    """One batch's model scores: ``values`` per row (``default`` where it failed), failures
    by cause (only ``error``: nothing here times out), the last failure's text, and how many
    rows were cut to the model's length."""

    values: list[float]
    failures: dict[str, int]
    last_error: str | None = None
    truncated: int = 0

    def fail(self, row: int, text: str) -> None:
        self.failures["error"] += 1
        self.last_error = f"row {row}: {text}"


class ModelScorer:
    """A reward model and its tokenizer, from one checkpoint folder. Raises
    :class:`orchestr.ConfigError` when the folder does not load (see
    :func:`~orchestr.roles.models.load_reward_model`) or has no tokenizer."""

    def __init__(self, folder: str, *, threads: int | None = None) -> None:
        self.folder = folder
        self.threads = threads
        self.model: RewardModel = load_reward_model(folder)
        self.tokenizer = Tokenizer(folder)
        self._lock = asyncio.Lock()  # one run at a time: two would split the cores

    def encode(self, prompt: str, completion: str) -> tuple[list[int], bool]:
        """The ids the model scores for one row, cut to its length keeping the end, and
        whether they were cut. Raises ``ValueError`` for text the tokenizer cannot spell or
        ids the model cannot score."""
        ids = self.tokenizer.encode(prompt + completion, special=True)
        cut = len(ids) > self.model.max_length
        if cut:
            ids = ids[-self.model.max_length :]
        self.model.check(ids)
        return ids, cut

    def score(
        self,
        rows: Sequence[tuple[str, str, Any]],
        default: float,
        stop: threading.Event | None = None,
    ) -> ModelScores:
        """Score ``(prompt, completion, ...)`` rows. Blocks the calling thread for the
        forward passes; raises nothing for a row (see the module's docstring). Checks
        ``stop`` between batches: when it is set, the remaining rows score ``default``
        without counting as failures (the batch is being abandoned)."""
        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)  # a thread's own count: set where it runs
        out = ModelScores([default] * len(rows), {"error": 0, "timeout": 0})
        encoded: list[tuple[int, list[int]]] = []
        for i, (prompt, completion, *_) in enumerate(rows):
            try:
                ids, cut = self.encode(prompt, completion)
            except ValueError as exc:
                out.fail(i, str(exc))
                continue
            encoded.append((i, ids))
            out.truncated += cut
        encoded.sort(key=lambda item: len(item[1]))
        for start in range(0, len(encoded), BATCH_ROWS):
            if stop is not None and stop.is_set():
                break
            self._batch(encoded[start : start + BATCH_ROWS], out)
        return out

    def _batch(self, chunk: list[tuple[int, list[int]]], out: ModelScores) -> None:
        try:
            scores = self.model.score([ids for _, ids in chunk])
        except Exception as exc:  # a failed pass (memory...): each row alone finds the culprit
            if len(chunk) == 1:
                out.fail(chunk[0][0], f"the reward model failed: {exc!r:.300}")
                return
            for one in chunk:
                self._batch([one], out)
            return
        for (row, _), value in zip(chunk, scores, strict=True):
            if math.isfinite(value):
                out.values[row] = value
            else:
                out.fail(row, f"the reward model scored {value}")

    @contextlib.asynccontextmanager
    async def open_run(
        self, rows: Sequence[tuple[str, str, Any]], default: float
    ) -> AsyncIterator[ModelRun]:
        """Start scoring ``rows`` in an executor thread (once the run before has ended: runs
        go one at a time); the :class:`ModelRun` yielded gives the result. On leaving, the
        thread is told to stop after its current batch and waited for, whatever happened in
        the block: no thread outlives the call. Cancel-safe in that sense (a cancelled call
        still waits for the batch in progress)."""
        async with self._lock:
            stop = threading.Event()
            loop = asyncio.get_running_loop()
            future = loop.run_in_executor(None, self.score, rows, default, stop)
            try:
                yield ModelRun(future)
            finally:
                stop.set()
                await asyncio.wait([future])


class ModelRun:
    """The result of one :meth:`ModelScorer.open_run`."""

    def __init__(self, future: asyncio.Future[ModelScores]) -> None:
        self._future = future

    async def result(self) -> ModelScores:
        """Blocks until the thread has scored every row. Cancelling the wait does not stop
        the thread (``open_run``'s exit does)."""
        return await asyncio.shield(self._future)


def merge(result: dict[str, Any], name: str, weight: float, scores: ModelScores) -> dict[str, Any]:
    """``result`` (``Batch.result()``'s shape) with the model's scores added: ``weight *
    value`` to each row's reward, its values under ``per_function[name]`` and its failures
    under ``failures[name]``."""
    result["rewards"] = [
        float(r + weight * v) for r, v in zip(result["rewards"], scores.values, strict=True)
    ]
    result["per_function"][name] = list(scores.values)
    result["failures"][name] = dict(scores.failures)
    return result


def check_name(name: Any, taken: Sequence[str]) -> str:
    """``model_name`` checked: a non-empty string that no function's name is. Raises
    :class:`orchestr.ConfigError`."""
    if not isinstance(name, str) or not name:
        raise oc.ConfigError(f"Reward's model_name is a non-empty string, got {name!r}")
    if name in taken:
        raise oc.ConfigError(
            f"Reward's model_name {name!r} is also a reward function's name; give the model "
            f"or the function another name"
        )
    return name
