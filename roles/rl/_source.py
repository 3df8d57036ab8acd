"""What an RL job trains on: its prompts, how its samples are scored and how the held-out set is
judged. The job's schedules (``sync``, ``stream``, ``stream+skew``) ask a :class:`Source` and
know nothing of the task.

- :class:`DigitSource`: the built-in digit tasks (:mod:`._task`), scored by a
  :class:`~orchestr.roles.Reward` mesh's single scorer on the prompt's digits; held out: greedy
  exact-match accuracy.
- :class:`~._data.DataSource`: a user's rows (JSONL, Parquet, a reasoning-gym task) rendered
  with the checkpoint's tokenizer and scored by weighted reward functions; held out: the mean
  reward of greedy completions.

A step's requests are keyed by ``(seed, step, index, sample)``: whoever generates them draws the
same completions, so the position in the data and every sample follow from the step alone.
"""

from __future__ import annotations

import abc
import collections
from collections.abc import Sequence
from typing import Any

from orchestr.roles._common._rollout import sample_key
from orchestr.roles.generator import Completion, Request

from . import _task
from ._reference import TrainConfig, group_requests, kv_options, request_digits, step_requests

__all__ = ["DigitSource", "RewardTally", "Source"]


class RewardTally:
    """What the reward functions scored over a run: the mean of each function's values in the
    last batch, and failures counted per function and cause."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.failures: dict[str, collections.Counter[str]] = {}

    def add(self, per_function: dict[str, Sequence[float]], failures: dict[str, Any]) -> None:
        self.last = {
            name: sum(values) / len(values) for name, values in per_function.items() if values
        }
        for name, causes in failures.items():
            counter = self.failures.setdefault(name, collections.Counter())
            counter.update({cause: int(n) for cause, n in causes.items() if n})

    def failed(self) -> dict[str, dict[str, int]]:
        return {name: dict(c) for name, c in self.failures.items() if c}


class Source(abc.ABC):
    """The base of the job's sources; each method is what the schedules call (the abstract
    ones, every source has its own)."""

    #: Pads the trainer's batches; ends its greedy (held-out) completions.
    pad_id: int = 0
    eos_id: int | None = None
    #: The reward mesh's arguments: ``Reward(*reward_args[0], **reward_args[1])``.
    reward_args: tuple[tuple[Any, ...], dict[str, Any]] = ((), {})
    #: The reward mesh's endpoint the job calls with :meth:`reward_payload`.
    reward_endpoint: str = "score"

    def __init__(self) -> None:
        #: What the reward functions scored (per function, failures); empty for a single
        #: scorer.
        self.tally = RewardTally()

    @abc.abstractmethod
    def step_requests(self, step: int) -> list[Request]:
        """Step ``step``'s requests: ``group_size`` of each of its prompts, ids
        ``"step/index/sample"``, grouped by prompt."""

    @abc.abstractmethod
    def extra_requests(self, step: int, draw: int) -> list[Request]:
        """More groups for ``step`` (dynamic sampling's ``draw``-th extra batch): prompt
        indices from ``draw * prompts_per_step`` on, keyed like the step's own."""
        ...

    @abc.abstractmethod
    def reward_payload(self, completions: Sequence[Completion]) -> list[Any]:
        """What the reward mesh's :attr:`reward_endpoint` scores of ``completions``."""

    def rewards(self, result: Any, held_out: bool = False) -> list[float]:
        """The rewards in the reward endpoint's ``result``, in order (``held_out``: of the
        held-out set's greedy completions, which the run's tallies leave out)."""
        return [float(r) for r in result]

    def shape(self, completions: Sequence[Completion], rewards: list[float]) -> list[float]:
        """The rewards the trainer sees for ``completions`` (a penalty or bonus on top of what
        the reward mesh scored); as scored by default."""
        return rewards

    def samples(self) -> list[dict[str, Any]]:
        """A few completions of the last scored batch with their rewards, for people to read."""
        return []

    @abc.abstractmethod
    def held_out(self) -> tuple[list[list[int]], list[int]]:
        """The held-out prompts (encoded) and each one's generation limit."""
        ...

    def held_out_payload(self, completions: Sequence[Sequence[int]]) -> list[Any] | None:
        """What the reward mesh scores of the greedy held-out completions; None when the
        source judges them itself (:meth:`held_out_score`)."""
        return None

    @abc.abstractmethod
    def held_out_score(
        self, completions: Sequence[Sequence[int]], rewards: list[float] | None
    ) -> float:
        """The held-out score of the greedy ``completions`` (and their ``rewards``, when
        :meth:`held_out_payload` had them scored)."""

    def kv(self, config: TrainConfig) -> dict[str, Any]:
        """The paged engine's sizes for a step of ``config``."""
        return kv_options(config)

    def state(self) -> dict[str, Any]:
        """What a resumed run needs to go on from where this one was (beyond the step, from
        which the position in the data and every sample's seed follow)."""
        return {"reward_failures": self.tally.failed()}

    def restore(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state` gave."""
        for name, causes in state.get("reward_failures", {}).items():
            self.tally.failures[name] = collections.Counter(causes)


class DigitSource(Source):
    """The digit tasks of :mod:`._task`, as :func:`~._reference.train` draws them."""

    def __init__(self, config: TrainConfig, scorer: str | None = None) -> None:
        self.config = config
        self.pad_id, self.eos_id = _task.PAD, _task.EOS
        self.reward_args = ((scorer or config.task.scorer,), {})
        self.prompts = _task.eval_prompts(config.eval_size, config.lengths)
        super().__init__()

    def step_requests(self, step: int) -> list[Request]:
        return step_requests(self.config, step)

    def extra_requests(self, step: int, draw: int) -> list[Request]:
        per = self.config.prompts_per_step
        indices = range(draw * per, (draw + 1) * per)
        return [r for i in indices for r in group_requests(self.config, step, i)]

    def reward_payload(self, completions: Sequence[Completion]) -> list[Any]:
        return [[list(request_digits(c)), c.tokens] for c in completions]

    def held_out(self) -> tuple[list[list[int]], list[int]]:
        task = self.config.task
        return [task.encode_prompt(p) for p in self.prompts], [
            _task.max_new_tokens(p) for p in self.prompts
        ]

    def held_out_score(
        self, completions: Sequence[Sequence[int]], rewards: list[float] | None
    ) -> float:
        task = self.config.task
        hits = sum(task.accuracy(p, c) for p, c in zip(self.prompts, completions, strict=True))
        return hits / len(self.prompts)


def group_of(
    config: TrainConfig, step: int, index: int, prompt: list[int], max_new: int
) -> list[Request]:
    """The ``group_size`` requests of prompt ``index`` of ``step``, ids ``"step/index/j"``."""
    return [
        Request(
            id=f"{step}/{index}/{j}",
            prompt=list(prompt),
            max_new_tokens=max_new,
            temperature=config.temperature,
            seed=sample_key(config.seed, step, index, j),
        )
        for j in range(config.group_size)
    ]
