"""Scored batches for the trainer's tests: a fresh TinyLM's completions of the digit task."""

from __future__ import annotations

import dataclasses
from typing import Any

from orchestr.roles.generator import RecomputeEngine
from orchestr.roles.generator._core._types import Completion
from orchestr.roles.rl import _task
from orchestr.roles.rl._reference import TrainConfig, request_digits, step_requests
from orchestr.roles.trainer._actor import build_model

SMALL = {"d_model": 32, "n_heads": 2, "n_layers": 1, "d_ff": 64}
CONFIG = TrainConfig(prompts_per_step=4, group_size=2, lengths=_task.LengthDistribution(6))


def samples(step: int, version: int = 0) -> list[tuple[Completion, float]]:
    """Step ``step``'s scored completions from a fresh model (seed 3), stamped ``version``."""
    model = build_model("orchestr.roles:TinyLM", SMALL, seed=3)
    engine = RecomputeEngine(model, max_batch=64, pad_id=_task.PAD, vocab_size=_task.VOCAB_SIZE)
    requests = step_requests(CONFIG, step)
    engine.submit(requests)
    done: dict[str, Completion] = {}
    while engine.has_work():
        done.update((c.id, c) for c in engine.step())
    out = []
    for r in requests:
        c = dataclasses.replace(done[r.id], version=version)
        out.append((c, _task.reward(request_digits(c), c.tokens)))
    return out


def as_dicts(batch: list[tuple[Completion, float]], ref_shift: float = 0.0) -> list[dict[str, Any]]:
    """``batch`` as sample dicts, each with ``ref_logprobs`` (its behaviour log-probs minus
    ``ref_shift``) and its ``finish_reason``."""
    return [
        {
            "prompt": c.prompt,
            "tokens": c.tokens,
            "sample_logprobs": c.sample_logprobs,
            "version": c.version,
            "reward": r,
            "ref_logprobs": [x - ref_shift for x in c.sample_logprobs],
            "finish_reason": c.finish_reason,
        }
        for c, r in batch
    ]
