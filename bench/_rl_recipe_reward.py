"""The reward of ``bench/rl_recipe.py``, one function that both systems call: orchestr's reward
workers import it as ``_rl_recipe_reward:digit_answer`` (``bench/`` on their ``PYTHONPATH``)
and call ``digit_answer(prompt, completion, answer=...)`` per sample; the TRL driver wraps it
as ``f(prompts, completions, answer=[...]) -> list[float]``. Standard library only: it is
imported in the project's venv and in TRL's.

The task: ``reverse 3 1 4 ->`` asks for ``4 1 3``. Scoring reads the digits of the completion
in order (everything else is ignored) and gives partial credit, so that a random policy of a
tiny model scores well above zero and the curve can move:

- half of the reward for *format*: the share of the answer's ``k`` digits that the completion
  has digits for (``min(found, k) / k``);
- half for *content*: the share of positions ``i < k`` whose ``i``-th digit is the answer's.

A random tiny Llama (byte-level BPE of 391 tokens, 10 of them digits) writing 16 tokens scores
about 0.1: a third of its completions hold a digit at all. Emitting digits brings it to about
0.55, the right ones to 1.0.
"""

from __future__ import annotations


def digit_answer(prompt: str, completion: str, answer: str) -> float:
    """Partial credit in [0, 1] for the digits of ``completion`` against ``answer``'s digits
    (see the module docstring); ``prompt`` is not read."""
    want = [c for c in str(answer) if c.isdigit()]
    if not want:
        return 0.0
    got = [c for c in completion if c.isdigit()][: len(want)]
    k = len(want)
    format_credit = len(got) / k
    content_credit = sum(g == w for g, w in zip(got, want, strict=False)) / k
    return 0.5 * format_credit + 0.5 * content_credit
