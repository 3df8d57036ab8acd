"""Learning, shown through the entry points a user has (``run_sft`` then ``run_rl``, the
programs behind ``orchestr rl sft`` and ``orchestr rl train``): a tiny llama warm-started by
SFT, then trained by GRPO, gains held-out reward that a control with its advantages zeroed
does not, on a JSONL task scored by a user's reward function and on a reasoning-gym task scored
by its own verifier (:mod:`tests.rl_recipes`). One seed here; ``bench/learning_recipes.py``
counts seeds and kernel paths."""

from __future__ import annotations

import pathlib

import pytest

import orchestr as oc
from tests.rl_recipes import TASKS, THRESHOLDS, clears, sft_then_grpo


@pytest.mark.timeout(300)
@pytest.mark.parametrize("task", TASKS)
async def test_sft_then_grpo_learns_what_the_control_does_not(
    ctx: oc.JobContext, tmp_path: pathlib.Path, task: str
) -> None:
    run = await sft_then_grpo(ctx, task, tmp_path, seed=0)
    first, last = run["sft_loss"]
    assert last < first * 0.5, run  # SFT learned the format at least
    control, grpo = run["control"], run["grpo"]
    assert control[0] == grpo[0]  # both start from the SFT run's export
    assert abs(control[-1] - control[0]) <= THRESHOLDS["flat"], run
    assert grpo[-1] >= control[-1] + THRESHOLDS["margin"], run
    assert clears(run)
