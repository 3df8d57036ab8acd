"""The reward role: a stateless mesh that scores samples, with a scorer named by path or with
weighted reward functions and/or a neural reward model on a dataset's rows, and the rule
rewards that ship with it.

- :class:`Reward`: ``Reward(scorer)`` scores ``[prompt, completion]`` pairs;
  ``Reward(functions=[...])`` scores rows in a process of its own under time limits;
  ``Reward(model=folder)`` (alone or beside functions) adds a reward model's score (a one-label
  ``...ForSequenceClassification`` checkpoint, :func:`orchestr.roles.models.load_reward_model`)
  of each row's text, weighted.
- :func:`check_functions`: a config's reward functions checked against a dataset's fields
  before any process starts.
- Rule rewards, named ``"orchestr.roles.reward:<name>"``: :func:`exact_match`,
  :func:`regex_match`, :func:`math_answer` (math_verify), :func:`reasoning_gym_score` (a
  reasoning-gym task's own verifier), with the answer extraction they use
  (:func:`final_answer`, :func:`rg_answer`).
"""

from ._actor import DEFAULT_SCORER, Reward, load_scorer
from ._rules import (
    exact_match,
    final_answer,
    math_answer,
    reasoning_gym_score,
    regex_match,
    rg_answer,
)
from ._spec import check_functions

__all__ = [
    "DEFAULT_SCORER",
    "Reward",
    "check_functions",
    "exact_match",
    "final_answer",
    "load_scorer",
    "math_answer",
    "reasoning_gym_score",
    "regex_match",
    "rg_answer",
]
