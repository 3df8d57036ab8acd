"""Rule rewards that ship with orchestr, named in a :class:`~orchestr.roles.Reward`'s functions
as ``"orchestr.roles.reward:exact_match"`` and so on.

Each is ``fn(prompt, completion, **fields) -> float`` and scores 1.0 or 0.0 (a reasoning-gym
task may give partial credit):

- :func:`exact_match`: the completion's final answer (:func:`final_answer`) equals the row's
  ``answer`` after both are stripped of whitespace and one trailing period.
- :func:`regex_match`: ``re.search(pattern, completion)`` finds a match, ``pattern`` given in
  the function's ``args`` (no flags: use inline ones such as ``(?s)``; anchor with ``\\A`` and
  ``\\Z`` for a whole-completion match).
- :func:`math_answer`: math_verify parses the row's ``answer`` and the completion and finds
  them equal (``\\boxed{\\frac{1}{2}}`` against ``0.5``).
- :func:`reasoning_gym_score`: the row's reasoning-gym task scores the completion's answer
  (:func:`rg_answer`) with its own verifier.

Two optional attributes of a reward function (any function may carry them):
``reward_setup()`` runs once in the reward process before its first call, outside the per-call
time limit (importing math_verify takes seconds); ``reward_check(args)`` is called by
:func:`~orchestr.roles.reward.check_functions` with the function's ``args`` and raises
``ValueError`` saying what is wrong with them.

This module imports only the standard library at its top: the reward process loads it from its
file, not through the orchestr package (which imports torch), so it starts in a fraction of a
second. math_verify and reasoning_gym are imported on first use.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import re
from collections.abc import Callable
from typing import Any

__all__ = [
    "exact_match",
    "final_answer",
    "math_answer",
    "reasoning_gym_score",
    "regex_match",
    "rg_answer",
]

_BOXED = "\\boxed"


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (braces balanced), or None."""
    start = text.rfind(_BOXED + "{")
    while start >= 0:
        opening, depth = start + len(_BOXED), 0
        for i in range(opening, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[opening + 1 : i]
        start = text.rfind(_BOXED + "{", 0, start)  # unclosed: an earlier one may be whole
    return None


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _normalize(text: str) -> str:
    text = text.strip()
    return text[:-1].rstrip() if text.endswith(".") else text


def final_answer(completion: str) -> str:
    """What :func:`exact_match` compares: the content of the completion's last ``\\boxed{}``
    when it has one, else its last non-empty line; stripped of whitespace and one trailing
    period."""
    boxed = _last_boxed(completion)
    return _normalize(boxed if boxed is not None else _last_line(completion))


def exact_match(prompt: str, completion: str, answer: str | int) -> float:
    """1.0 when the completion's :func:`final_answer` is the row's ``answer`` (a string, or an
    integer compared as its decimal text), stripped of whitespace and a trailing period."""
    if isinstance(answer, bool) or not isinstance(answer, str | int):
        raise TypeError(f"exact_match compares text: the answer is {type(answer).__name__}")
    return float(final_answer(completion) == _normalize(str(answer)))


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def regex_match(prompt: str, completion: str, pattern: str) -> float:
    """1.0 when ``re.search(pattern, completion)`` matches; ``pattern`` comes from the
    function's ``args`` (``{"pattern": "<answer>.*</answer>"}``), compiled once."""
    return float(_compiled(pattern).search(completion) is not None)


def _check_pattern(args: dict[str, Any]) -> None:
    pattern = args.get("pattern")
    if not isinstance(pattern, str):
        raise ValueError(f"regex_match needs args {{'pattern': <a regex>}}, got {args!r}")
    try:
        _compiled(pattern)
    except re.error as exc:
        raise ValueError(f"the pattern {pattern!r} does not compile: {exc}") from None


def _hooks(
    fn: Callable[..., float],
    setup: Callable[[], Any] | None = None,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    # setattr: mypy refuses new attributes of a function
    if setup is not None:
        setattr(fn, "reward_setup", setup)  # noqa: B010
    if check is not None:
        setattr(fn, "reward_check", check)  # noqa: B010


_hooks(regex_match, check=_check_pattern)


@functools.cache
def _math_verify() -> Any:
    module = importlib.import_module("math_verify")
    # its own timeouts are SIGALRM alarms that would cancel the reward process's per-call
    # timer (one timer serves both), so they are off; off, it logs that once as a warning
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return module


def math_answer(prompt: str, completion: str, answer: str | int | float) -> float:
    """1.0 when math_verify finds the completion's answer equal to the row's. The gold is parsed
    as LaTeX between ``$`` signs (``1+x``, ``2\\sqrt{2}``, ``\\{1,2\\}`` whole; as it is
    when it has ``$`` or ``\\boxed`` already, or if that finds nothing); the completion by
    math_verify's defaults (the last ``\\boxed{}`` first, then LaTeX, then plain
    expressions). Raises ``ValueError`` when the gold does not parse (a fault of the data,
    counted as an error). math_verify's own alarms are off: the reward process's per-call time
    limit bounds it."""
    mv = _math_verify()
    gold_text = str(answer).strip()
    gold = []
    if "$" not in gold_text and _BOXED not in gold_text:
        gold = mv.parse(f"${gold_text}$", parsing_timeout=None)
    gold = gold or mv.parse(gold_text, parsing_timeout=None)
    if not gold_text or not gold:
        raise ValueError(f"math_verify cannot parse the answer {gold_text!r}")
    predicted = mv.parse(completion, parsing_timeout=None)
    return float(bool(predicted) and bool(mv.verify(gold, predicted, timeout_seconds=None)))


_hooks(math_answer, setup=_math_verify)

_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def rg_answer(completion: str) -> str | None:
    """The model's answer as reasoning-gym's own examples take it: the content of the last
    ``<answer>...</answer>`` (their ``extract_answer``), else the completion's last non-empty
    line; stripped. None for an empty completion (which every task scores 0)."""
    tagged = _ANSWER_TAG.findall(completion)
    answer = tagged[-1] if tagged else _last_line(completion)
    return answer.strip() or None


@functools.cache
def _reasoning_gym() -> Any:
    return importlib.import_module("reasoning_gym")


@functools.cache
def _task_scorer(name: str) -> Callable[[str | None, dict[str, Any]], float]:
    """The ``score_answer`` of task ``name`` (a dataset object built once per task)."""
    scorer: Callable[[str | None, dict[str, Any]], float] = _reasoning_gym().get_score_answer_fn(
        name
    )
    return scorer


def reasoning_gym_score(
    prompt: str,
    completion: str,
    answer: Any,
    metadata: dict[str, Any] | str,
    question: str | None = None,
) -> float:
    """The score reasoning-gym's task gives the completion's :func:`rg_answer`, the task named
    by ``metadata["source_dataset"]`` (``metadata`` a dict, or its JSON text as a Parquet
    column keeps it). The entry scored is ``{"question", "answer", "metadata"}`` of the row,
    ``question`` the prompt when the row has none. Raises ``ValueError`` for metadata without
    a task."""
    if isinstance(metadata, str):
        metadata = json.loads(metadata)
    if not isinstance(metadata, dict) or not isinstance(metadata.get("source_dataset"), str):
        raise ValueError(
            "reasoning_gym_score needs the row's metadata with its task's name under "
            f"'source_dataset', got {str(metadata)[:200]!r}"
        )
    entry = {
        "question": prompt if question is None else question,
        "answer": answer,
        "metadata": metadata,
    }
    return float(_task_scorer(metadata["source_dataset"])(rg_answer(completion), entry))


_hooks(reasoning_gym_score, setup=_reasoning_gym)
