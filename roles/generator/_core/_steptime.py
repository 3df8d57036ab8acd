"""The step-time model: the seconds one paged-engine step takes, from what it computes.

The simulator (``orchestr.sim``) charges its virtual generators' steps with it, ``orchestr sim
calibrate`` fits it to the real engine's steps, and the simulated engine
(``Generator(engine="sim")``) sleeps each step's time on the wall clock. Sans-IO but for
:meth:`StepTimeModel.load`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from ._scheduler import Step

__all__ = ["TERMS", "StepTimeModel", "attention_pairs", "step_features"]


#: The model's coefficients, in the order of a sample's features (the first is per step).
TERMS = (
    "base_s",
    "prefill_token_s",
    "decode_s",
    "prefill_attention_s",
    "decode_attention_s",
    "mixed_s",
    "after_prefill_s",
)


@dataclasses.dataclass(frozen=True)
class StepTimeModel:
    """Seconds for one engine step: ``base_s`` + ``prefill_token_s`` per prompt token computed
    (compute-bound products) + ``decode_s`` per sequence decoding a token (each adds a row to
    memory-bound products, and its sampling) + ``prefill_attention_s`` and
    ``decode_attention_s`` per (query, key) pair the step's attention scores for prefill
    chunks and for decodes (a chunk of ``n`` tokens after ``s`` cached ones:
    ``n * s + n (n + 1) / 2`` pairs; a decode over ``c`` tokens: ``c``). Prefill and decode
    are apart because on this CPU a decode's row and its attention pairs cost differently from
    a prefill's (measured: one coefficient for both left a decode step 18-36% off).

    Two terms depend on the mix, both measured here rather than derived: ``mixed_s`` more for
    a step computing a prefill chunk and decodes together (they take two attention paths;
    without it such steps came out 6% fast), and ``after_prefill_s`` more for a step without
    a prefill chunk right after one with (the first decode steps after a prefill measured
    1.5-3 ms slower than the next; the cause is not isolated). ``machine`` says where it was
    measured."""

    base_s: float
    prefill_token_s: float = 0.0
    decode_s: float = 0.0
    prefill_attention_s: float = 0.0
    decode_attention_s: float = 0.0
    mixed_s: float = 0.0
    after_prefill_s: float = 0.0
    machine: str = ""

    def __post_init__(self) -> None:
        for name in TERMS:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0):
                raise ValueError(f"StepTimeModel.{name} is seconds >= 0, got {value!r}")

    def seconds(
        self,
        prefill_tokens: int = 0,
        decodes: int = 0,
        prefill_pairs: int = 0,
        decode_pairs: int = 0,
        mixed: int = 0,
        after_prefill: int = 0,
    ) -> float:
        """Seconds of a step of these features (``mixed`` and ``after_prefill`` are 0 or
        1)."""
        return (
            self.base_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_s * decodes
            + self.prefill_attention_s * prefill_pairs
            + self.decode_attention_s * decode_pairs
            + self.mixed_s * mixed
            + self.after_prefill_s * after_prefill
        )

    def step_seconds(self, step: Step, after_prefill: bool = False) -> float:
        """The model's time for ``step`` (what a scheduler's ``schedule()`` returned), which
        follows a step with a prefill chunk if ``after_prefill``."""
        f = step_features(step)
        return self.seconds(*f, after_prefill=int(after_prefill and f[0] == 0))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepTimeModel:
        """A model from :meth:`to_json`'s dict; ``ValueError`` names a missing, unknown or bad
        field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a step-time profile is a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown step-time field(s) {unknown}; known: {sorted(known)}")
        if "base_s" not in data:
            raise ValueError("a step-time profile needs base_s")
        return cls(**dict(data))

    @classmethod
    def load(cls, path: str) -> StepTimeModel:
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except ValueError as exc:
                raise ValueError(f"{path}: not JSON ({exc})") from None
        try:
            return cls.from_json(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None


def step_features(step: Step) -> tuple[int, int, int, int, int]:
    """``(prefill_tokens, decodes, prefill_pairs, decode_pairs, mixed)`` of a step (see
    :class:`StepTimeModel`); a sequence computing the one token it sampled last decodes."""
    prefill = decodes = prefill_pairs = decode_pairs = 0
    for seq, n in step.scheduled:
        pairs = attention_pairs(seq.num_computed, n)
        if n == 1 and seq.num_computed >= len(seq.prompt):
            decodes += 1
            decode_pairs += pairs
        else:
            prefill += n
            prefill_pairs += pairs
    return prefill, decodes, prefill_pairs, decode_pairs, int(prefill > 0 and decodes > 0)


def attention_pairs(cached: int, n: int) -> int:
    """(query, key) pairs of ``n`` new tokens after ``cached`` ones, causally."""
    return n * cached + n * (n + 1) // 2
