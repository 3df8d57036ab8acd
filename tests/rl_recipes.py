"""The learning tests' recipes, through the entry points a user has: a tiny llama (make-tiny)
warm-started by SFT (:func:`~orchestr.roles.rl.run_sft`), then trained by GRPO
(:func:`~orchestr.roles.rl.run_rl`) beside a control whose advantages are zeroed, on

- ``say``: a task from a JSONL file, saying a two-digit number back (``Say 47:`` -> `` 47``),
  scored by a reward function of the user's (``tests.cli.rl_rewards:digit_match``, partial
  credit per digit);
- ``spell``: reasoning-gym's ``spell_backward`` on three-letter words (``Spell this word
  backward (example: sun -> nus): cat`` -> ``tac``), scored by the task's own verifier
  (``reasoning_gym_score``, partial credit per letter): a task nobody here wrote, its held-out
  words mostly unseen in training. (``leg_counting`` with one animal was tried first: a
  lookup of 37 animals, where GRPO's 0/1 reward settled on the commonest counts, 4 and 6, in
  one seed of four, no better than SFT.)

:func:`sft_then_grpo` runs one (task, seed) on a cluster and returns the held-out figures;
``tests/roles/rl/test_rl_learning.py`` checks them for one seed, ``bench/learning_recipes.py``
counts the seeds and kernel paths that clear :data:`THRESHOLDS`: ``say`` on 10 of 10 on avx2
and on the default kernels, ``spell`` on 5 of 12 (``docs/bench/learning_recipes.md``); its
seed 0 clears on both, by 0.17-0.20."""

from __future__ import annotations

import json
import pathlib
import random
from typing import Any

import orchestr as oc
from orchestr.roles.models import make_tiny
from orchestr.roles.rl import rl_config_from_dict, run_rl, run_sft, sft_config_from_dict

TASKS = ("say", "spell")

#: What a (task, seed) must clear: GRPO's last held-out reward above the control's by
#: ``margin``, and the control's last within ``flat`` of its first (nothing to learn from).
THRESHOLDS = {"margin": 0.1, "flat": 0.02}

_SPELL = {
    "reasoning_gym": "spell_backward",
    "size": 4000,
    "held_out_size": 64,
    "options": {"min_word_len": 3, "max_word_len": 3},
}


def _say_rows(path: pathlib.Path, seed: int) -> None:
    rng = random.Random(seed)
    rows = []
    for _ in range(600):
        n = f"{rng.randrange(100):02d}"
        rows.append({"prompt": f"Say {n}:", "response": f" {n}", "answer": n})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _tables(task: str, folder: pathlib.Path, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The SFT run's config table and the GRPO run's (its model the SFT run's export)."""
    if task == "say":
        _say_rows(folder / "rows.jsonl", seed)
        data: dict[str, Any] = {"path": str(folder / "rows.jsonl"), "held_out_size": 64}
        reward = {"function": "tests.cli.rl_rewards:digit_match"}
    elif task == "spell":
        data = {**_SPELL, "seed": seed}  # SFT on its question and answer fields
        reward = {"function": "orchestr.roles.reward:reasoning_gym_score"}
    else:
        raise ValueError(f"task is one of {TASKS}, got {task!r}")
    model = make_tiny(
        "llama", folder / "model", hidden=64, layers=2, heads=2, kv_heads=2, seed=seed
    )
    sft = {
        "model": {"path": model},
        "data": data,
        # short of learning the task: GRPO has the rest to learn
        "schedule": {
            "steps": 20 if task == "say" else 30,
            "batch_size": 16,
            "lr": 3e-3,
            "eval_every": 30,
            "seed": seed,
        },
    }
    grpo = {
        "model": {"path": str(folder / "sft" / "model")},
        "data": data,
        "reward": [reward],
        "algorithm": {"max_new_tokens": 4, "entropy_coef": 0.0},
        "schedule": {
            "steps": 40 if task == "say" else 30,
            "prompts_per_step": 16,
            "group_size": 8,
            "eval_every": 10,
            "seed": seed,
            "lr": 2e-3 if task == "say" else 1e-3,  # faster, the spelling's falls back
        },
        "layout": {"mode": "sync"},
        "run": {"export": False, "checkpoint_every": 0},
    }
    return sft, grpo


async def sft_then_grpo(
    ctx: oc.JobContext, task: str, folder: pathlib.Path, seed: int
) -> dict[str, Any]:
    """Run ``task``'s recipe with ``seed`` on ``ctx``, its runs under ``folder``: the SFT
    run's held-out loss (first, last), and the held-out reward of GRPO and of its control at
    each evaluation."""
    sft_table, grpo_table = _tables(task, folder, seed)
    _, _, sft = await run_sft(
        ctx, sft_config_from_dict(sft_table, f"{task}-sft"), run_dir=str(folder / "sft")
    )
    out: dict[str, Any] = {
        "task": task,
        "seed": seed,
        "sft_loss": [sft["first_held_out"], sft["last_held_out"]],
    }
    for name, scale in (("grpo", 1.0), ("control", 0.0)):
        table = {**grpo_table, "algorithm": {**grpo_table["algorithm"], "advantage_scale": scale}}
        config = rl_config_from_dict(table, f"{task}-{name}")
        _, result, _ = await run_rl(ctx, config, run_dir=str(folder / name))
        out[name] = [round(score, 4) for _, score, _ in result.evals]
    return out


def clears(run: dict[str, Any]) -> bool:
    """Whether ``run`` (from :func:`sft_then_grpo`) clears :data:`THRESHOLDS`, and SFT's
    held-out loss fell."""
    control, grpo = run["control"], run["grpo"]
    return (
        run["sft_loss"][1] < run["sft_loss"][0]
        and abs(control[-1] - control[0]) <= THRESHOLDS["flat"]
        and grpo[-1] >= control[-1] + THRESHOLDS["margin"]
    )
