"""The digit tasks: tokens, a seeded prompt sampler, the rewards and the evaluation set.

A prompt is a string of 1..16 decimal digits; the policy sees ``BOS d_0 .. d_{n-1} SEP`` and
should answer ``d_{n-1} .. d_0``; the generator stops it after ``n`` tokens. Prompt lengths are skewed (most short, a long tail), so
answer lengths have a long tail too: the shape a continuous-batching generator is for.

That is the ``reverse`` task, the module-level functions. :class:`Task` also names ``copy``
(answer the digits as given) and a fixed-width ``field``: the digits are followed by
``FILL`` tokens up to ``field`` of them, so every prompt has the same length and the answer's
``i``-th digit sits the same distance back from where it is written, whatever the prompt's
length. A model with rotary positions (Llama's), which see only such distances, learns that
copy in a few dozen GRPO steps; reversal asks it to find ``d_{n-1-i}``, a distance that
changes with ``n`` and ``i``, and in the same budget it did not (held-out accuracy 0.16 after
100 steps, where a model with positions counted from the separator reaches 0.93-1.0).

Everything here is pure Python and deterministic; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from orchestr.roles._common._seeding import derive_seed

__all__ = [
    "BOS",
    "EOS",
    "EVAL_SEED",
    "FILL",
    "MAX_DIGITS",
    "PAD",
    "SEP",
    "TASKS",
    "VOCAB_SIZE",
    "LengthDistribution",
    "Task",
    "accuracy",
    "answer",
    "copy_reward",
    "decode",
    "encode_prompt",
    "eval_prompts",
    "max_new_tokens",
    "prompt_from_str",
    "reward",
    "sample_prompt",
]

# Digits are their own token ids, so a completion reads as digits without a lookup table.
BOS, SEP, EOS, PAD = 10, 11, 12, 13
VOCAB_SIZE = 14
#: Fills a fixed-width field after the digits (:class:`Task`); beyond TinyLM's vocabulary.
FILL = 14
TASKS = ("reverse", "copy")
MAX_DIGITS = 16
EVAL_SEED = 20_240_517  # the evaluation set's own seed: held out from every training seed

_NAMES = {BOS: "<bos>", SEP: "<sep>", EOS: "<eos>", PAD: "<pad>", FILL: "_"}

Prompt = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Prompt lengths ``1..max_digits`` with ``P(n) ∝ decay ** (n - 1)``.

    With the defaults (16, 0.85) the mean is about 5.4 digits, half the prompts have at most
    four and one in ten has twelve or more: most short, a long tail. (A steeper 0.8 left too
    few long prompts for RL to learn them from in the demo's budget.)
    """

    max_digits: int = MAX_DIGITS
    decay: float = 0.85

    def __post_init__(self) -> None:
        if not 1 <= self.max_digits <= MAX_DIGITS:
            raise ValueError(f"max_digits must be in 1..{MAX_DIGITS}, got {self.max_digits}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")

    def weights(self) -> list[float]:
        """Unnormalised weights for lengths ``1..max_digits``."""
        return [self.decay ** (n - 1) for n in range(1, self.max_digits + 1)]

    def mean(self) -> float:
        w = self.weights()
        return sum(n * x for n, x in enumerate(w, start=1)) / sum(w)


def sample_prompt(seed: int, step: int, index: int, lengths: LengthDistribution) -> Prompt:
    """The prompt for ``(seed, step, index)``: the same digits whoever asks, in any order."""
    rng = random.Random(derive_seed("prompt", seed, step, index))
    n = rng.choices(range(1, lengths.max_digits + 1), weights=lengths.weights())[0]
    return tuple(rng.randrange(10) for _ in range(n))


def eval_prompts(count: int, lengths: LengthDistribution) -> list[Prompt]:
    """The fixed held-out evaluation set: ``count`` prompts from ``lengths``.

    Drawn from :data:`EVAL_SEED` in a stream of its own, so it does not move with the training
    seed. "Held out" means independently drawn: with only ten one-digit prompts, short ones
    necessarily also occur in training.
    """
    if count < 1:
        raise ValueError(f"an evaluation set needs at least one prompt, got count={count}")
    rng = random.Random(derive_seed("eval", EVAL_SEED, lengths.max_digits))
    choices = range(1, lengths.max_digits + 1)
    ns = rng.choices(choices, weights=lengths.weights(), k=count)
    return [tuple(rng.randrange(10) for _ in range(n)) for n in ns]


def _check_prompt(digits: Sequence[int]) -> None:
    if not 1 <= len(digits) <= MAX_DIGITS:
        raise ValueError(f"a prompt has 1..{MAX_DIGITS} digits, got {len(digits)}")
    bad = [d for d in digits if not (isinstance(d, int) and 0 <= d <= 9)]
    if bad:
        raise ValueError(f"a prompt holds digits 0..9 only, got {bad[:3]!r} in {list(digits)!r}")


def prompt_from_str(text: str) -> Prompt:
    """``"0123"`` -> ``(0, 1, 2, 3)``; raises ``ValueError`` for anything but 1..16 digits."""
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"a prompt is a string of decimal digits, got {text!r}")
    digits = tuple(int(c) for c in text)
    _check_prompt(digits)
    return digits


def encode_prompt(digits: Sequence[int]) -> list[int]:
    """``BOS d_0 .. d_{n-1} SEP``; raises ``ValueError`` for an empty, long or non-digit prompt."""
    _check_prompt(digits)
    return [BOS, *digits, SEP]


def answer(digits: Sequence[int]) -> list[int]:
    """The correct completion: the reversed digits."""
    _check_prompt(digits)
    return list(reversed(digits))


def max_new_tokens(digits: Sequence[int]) -> int:
    """The generation limit for a prompt: its length, the length of the answer.

    The generator stops a completion there, so the policy never has to say ``EOS``; one it
    says early ends the answer and loses the positions it did not fill (see :func:`reward`).
    """
    return len(digits)


def _until_eos(completion: Sequence[int]) -> list[int]:
    out: list[int] = []
    for token in completion:
        if token == EOS:
            break
        out.append(int(token))
    return out


def _score(target: Sequence[int], completion: Sequence[int]) -> float:
    got = _until_eos(completion)
    hits = sum(1 for g, t in zip(got, target, strict=False) if g == t)
    return hits / max(len(target), len(got))


def reward(digits: Sequence[int], completion: Sequence[int]) -> float:
    """The fraction of positions equal to the reversed prompt, in ``[0, 1]``.

    The completion is read up to its first ``EOS`` (or its end, if it has none); tokens after
    that, padding included, are ignored. Position ``i`` scores when it equals ``digits[-1 - i]``;
    the score is divided by ``max(n, len(answer))``, so a short answer loses the positions it
    lacks and a long one is diluted by the tokens it adds. Any non-digit token before ``EOS``
    counts as a wrong position. 1.0 exactly when the answer is the reversed prompt; a uniformly
    random digit string scores about 0.1.
    """
    _check_prompt(digits)
    return _score(digits[::-1], completion)


def copy_reward(digits: Sequence[int], completion: Sequence[int]) -> float:
    """:func:`reward` for the ``copy`` task: position ``i`` scores when it equals
    ``digits[i]``."""
    _check_prompt(digits)
    return _score(digits, completion)


def accuracy(digits: Sequence[int], completion: Sequence[int]) -> bool:
    """Exact match: the completion, read up to ``EOS``, is the reversed prompt."""
    _check_prompt(digits)
    return _until_eos(completion) == answer(digits)


def decode(tokens: Sequence[int]) -> str:
    """A readable form for logs: ``<bos>123<sep>321<eos>``; ids outside the vocabulary show
    as ``<?17>`` rather than raising, since this is for looking at bad output too."""
    parts = []
    for t in tokens:
        t = int(t)
        parts.append(str(t) if 0 <= t <= 9 else _NAMES.get(t, f"<?{t}>"))
    return "".join(parts)


@dataclasses.dataclass(frozen=True)
class Task:
    """Which digit task, and how its prompts are laid out (see the module's docstring).

    ``field``: prompts hold the digits then ``FILL`` up to this many (at least the longest
    prompt's digits); ``None``: the digits alone, as the module-level functions have them.
    """

    name: str = "reverse"
    field: int | None = None

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.name!r}")
        if self.field is not None and not 1 <= self.field <= MAX_DIGITS:
            raise ValueError(f"field must be in 1..{MAX_DIGITS}, got {self.field}")

    @property
    def scorer(self) -> str:
        """The reward function's path, for a :class:`~orchestr.roles.Reward` mesh."""
        name = "reward" if self.name == "reverse" else "copy_reward"
        return f"orchestr.roles.rl._task:{name}"

    def encode_prompt(self, digits: Sequence[int]) -> list[int]:
        """``BOS d_0 .. d_{n-1} [FILL ..] SEP``; raises ``ValueError`` for a prompt that is
        empty, too long (for the field too), or not digits."""
        _check_prompt(digits)
        fill = 0
        if self.field is not None:
            if len(digits) > self.field:
                raise ValueError(
                    f"a prompt of {len(digits)} digits overflows a field of {self.field}"
                )
            fill = self.field - len(digits)
        return [BOS, *digits, *[FILL] * fill, SEP]

    def digits_of(self, prompt: Sequence[int]) -> Prompt:
        """The digits an encoded prompt was made from."""
        return tuple(int(t) for t in prompt[1:-1] if t != FILL)

    def answer(self, digits: Sequence[int]) -> list[int]:
        _check_prompt(digits)
        return list(digits) if self.name == "copy" else list(reversed(digits))

    def reward(self, digits: Sequence[int], completion: Sequence[int]) -> float:
        return (copy_reward if self.name == "copy" else reward)(digits, completion)

    def accuracy(self, digits: Sequence[int], completion: Sequence[int]) -> bool:
        return _until_eos(completion) == self.answer(digits)
