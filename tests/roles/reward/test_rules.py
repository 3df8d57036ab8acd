"""The rule rewards that ship: what each extracts from a completion and scores, on hand-written
cases, and reasoning-gym rows scored by their own task's verifier after a trip through JSON."""

from __future__ import annotations

import importlib
import json

import pytest

from orchestr.roles.reward import (
    exact_match,
    final_answer,
    math_answer,
    reasoning_gym_score,
    regex_match,
    rg_answer,
)
from orchestr.roles.reward._rules import _check_pattern


def test_final_answer_is_the_last_boxed_else_the_last_line() -> None:
    assert final_answer("so \\boxed{42}.\nDone") == "42"
    assert final_answer("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert final_answer("\\boxed{2} and \\boxed{unclosed") == "2"
    assert final_answer("work\n\n  The answer is 7.  \n\n") == "The answer is 7"
    assert final_answer("") == ""


def test_exact_match() -> None:
    assert exact_match("q", "reasoning\n42.", "42") == 1.0
    assert exact_match("q", "reasoning\n42", " 42. ") == 1.0
    assert exact_match("q", "\\boxed{ 42 }", 42) == 1.0
    assert exact_match("q", "42\nthat is all", "42") == 0.0
    assert exact_match("q", "\\boxed{4.2}", "42") == 0.0
    with pytest.raises(TypeError, match="compares text"):
        exact_match("q", "1", True)


def test_regex_match_searches_and_refuses_a_bad_pattern() -> None:
    assert regex_match("q", "x <answer>3</answer> y", "<answer>\\d+</answer>") == 1.0
    assert regex_match("q", "x <answer>3</answer> y", "\\A<answer>.*</answer>\\Z") == 0.0
    assert regex_match("q", "<answer>\n3\n</answer>", "(?s)\\A<answer>.*</answer>\\Z") == 1.0
    _check_pattern({"pattern": "a+"})
    with pytest.raises(ValueError, match="does not compile"):
        _check_pattern({"pattern": "a("})
    with pytest.raises(ValueError, match="needs args"):
        _check_pattern({})


def test_math_answer() -> None:
    assert math_answer("q", "So the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_answer("q", "\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert math_answer("q", "The answer is $x+1$", "1+x") == 1.0
    assert math_answer("q", "\\boxed{2\\sqrt{2}}", "2\\sqrt{2}") == 1.0
    assert math_answer("q", "\\boxed{\\sqrt{8}}", "2\\sqrt{2}") == 1.0
    assert math_answer("q", "\\boxed{2}", "2\\sqrt{2}") == 0.0
    assert math_answer("q", "the set is $\\{2, 1\\}$", "1,2") == 1.0
    assert math_answer("q", "I get 0.4", "0.5") == 0.0
    assert math_answer("q", "no idea", "0.5") == 0.0
    assert math_answer("q", "", 3) == 0.0
    with pytest.raises(ValueError, match="cannot parse the answer"):
        math_answer("q", "1", "")


def test_rg_answer_is_the_last_answer_tag_else_the_last_line() -> None:
    assert rg_answer("<answer>1</answer> then <answer> 12 </answer>") == "12"
    assert rg_answer("thinking\n-4\n") == "-4"
    assert rg_answer("  \n") is None


def test_reasoning_gym_rows_scored_by_their_tasks_verifier() -> None:
    reasoning_gym = importlib.import_module("reasoning_gym")  # untyped: no stubs
    entries = list(reasoning_gym.create_dataset("chain_sum", size=3, seed=7))
    for entry in entries:
        row = json.loads(json.dumps(entry))  # as a JSONL dataset gives it back
        fields = {k: row[k] for k in ("question", "answer", "metadata")}
        right = f"Let me add.\n<answer>{row['answer']}</answer>"
        wrong = f"<answer>{int(row['answer']) + 1}</answer>"
        assert reasoning_gym_score(row["question"], right, **fields) == 1.0
        assert reasoning_gym_score(row["question"], wrong, **fields) == 0.0
        assert reasoning_gym_score(row["question"], f"so\n{row['answer']}", **fields) == 1.0
        assert reasoning_gym_score(row["question"], "", **fields) == 0.0
        # metadata kept as JSON text (a Parquet column), and no question: the prompt is
        as_text = json.dumps(row["metadata"])
        assert reasoning_gym_score(row["question"], right, row["answer"], as_text) == 1.0
    with pytest.raises(ValueError, match="'source_dataset'"):
        reasoning_gym_score("q", "1", "1", {"task": "chain_sum"})
