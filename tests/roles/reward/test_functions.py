"""Weighted reward functions on rows, run in the reward process: routing by signature, failures
counted by cause, time limits that hold against any function (a loop, a sleep, one deaf to
SIGALRM, one that kills its process), the check before any process starts, and the actor on a
cluster. Real processes throughout; short time limits keep it quick."""

from __future__ import annotations

import asyncio
import contextlib
import math
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

import orchestr as oc
from orchestr.roles import models
from orchestr.roles.reward import Reward, check_functions
from orchestr.roles.reward._batch import HARD_FAILURES, Batch

F = "tests.roles.reward.functions"


def fn(function: str, weight: float = 1.0, **extra: Any) -> dict[str, Any]:
    return {"path": f"{F}:{function}", "weight": weight, **extra}


def row(completion: str = "c", prompt: str = "p", **fields: Any) -> dict[str, Any]:
    return {"prompt": prompt, "completion": completion, "fields": fields}


@contextlib.asynccontextmanager
async def reward(*functions: dict[str, Any], **kwargs: Any) -> AsyncIterator[Reward]:
    """A Reward in this process (its reward process a child of the test), stopped after; the
    time limit short only where a test runs into it."""
    actor = Reward(functions=list(functions), **kwargs)
    try:
        yield actor
    finally:
        await actor.aclose()


def test_the_batch_core_fails_the_running_call_and_drops_a_function_that_keeps_failing() -> None:
    batch = Batch(["a", "b"], [1.0, 2.0], rows=3, default=-1.0)
    assert batch.work() == [(0, [0, 1]), (1, [0, 1]), (2, [0, 1])]
    batch.record(0, 0, "ok", 0.5)
    with pytest.raises(ValueError, match="while \\(0, 1\\) runs"):
        batch.record(1, 0, "ok", 1.0)
    batch.lost("timeout", "killed")  # b at row 0
    batch.lost("timeout", "killed")  # a at row 1
    assert HARD_FAILURES == 2 and batch.running() == (1, 1)
    batch.lost("error", "died")  # b's second: the rest of b fails unrun
    assert batch.running() == (2, 0) and batch.work() == [(2, [0])]
    batch.record(2, 0, "error", "ValueError: x")
    assert batch.done
    result = batch.result()
    assert result["per_function"] == {"a": [0.5, -1.0, -1.0], "b": [-1.0, -1.0, -1.0]}
    assert result["rewards"] == [0.5 - 2.0, -3.0, -3.0]
    assert result["failures"] == {
        "a": {"error": 1, "timeout": 1},
        "b": {"error": 2, "timeout": 1},
    }
    assert batch.last_error == ["ValueError: x", "died (2 times in this batch: not run again)"]


async def test_weighted_sum_fields_routed_by_signature_and_args() -> None:
    functions = [
        fn("length", 0.5),
        fn("has_answer", 2.0),  # returns a bool: 1.0 or 0.0
        fn("scaled", 1.0, args={"scale": 3.0}),
        fn("fields_seen", 0.0, name="seen"),
        fn("prints", 0.0),  # its prints must not reach the protocol
    ]
    async with reward(*functions) as actor:
        result = await actor.score_rows(
            [
                row("abcd", answer="bc", a=1, c=[1, {"x": None}]),
                row("yes", answer="yes", bonus=0.25, b="b"),
                {"prompt": "p", "completion": "", "fields": {"answer": "z", "scale": 100}},
            ]
        )
        assert result["per_function"] == {
            "length": [4.0, 3.0, 0.0],
            "has_answer": [1.0, 1.0, 0.0],
            "scaled": [0.0, 3.25, 0.0],  # the row's "scale" loses to args
            "seen": [5.0, 2.0, 0.0],
            "prints": [1.0, 1.0, 1.0],
        }
        assert result["rewards"] == [2.0 + 2.0, 1.5 + 2.0 + 3.25, 0.0]
        assert all(f == {"error": 0, "timeout": 0} for f in result["failures"].values())
        assert await actor.score_rows([]) == {
            "rewards": [],
            "per_function": {name: [] for name in result["per_function"]},
            "failures": {name: {"error": 0, "timeout": 0} for name in result["per_function"]},
        }
        stats = actor.stats()
        assert stats["scored"] == 3 and stats["starts"] == 1 and stats["losses"] == 0


async def test_a_raising_or_non_numeric_function_scores_the_default_as_an_error() -> None:
    functions = [fn("length"), fn("raises"), fn("nan"), fn("text"), fn("needs_label", 5.0)]
    async with reward(*functions, default=-1.0) as actor:
        result = await actor.score_rows([row("ab", label="x"), row("abc")])
        assert result["per_function"]["length"] == [2.0, 3.0]
        for name in ("raises", "nan", "text"):
            assert result["per_function"][name] == [-1.0, -1.0]
            assert result["failures"][name] == {"error": 2, "timeout": 0}
        # a field the function requires that one row lacks: that row's call fails
        assert result["per_function"]["needs_label"] == [0.0, -1.0]
        assert result["failures"]["needs_label"] == {"error": 1, "timeout": 0}
        assert result["rewards"] == [2.0 - 3.0, 3.0 - 3.0 - 5.0]
        errors = actor.stats()["last_error"]
        assert "RuntimeError: no reward for 'abc'" in errors["raises"]
        assert "returned nan" in errors["nan"] and "returned 'high'" in errors["text"]
        assert "label" in errors["needs_label"]
        assert actor.stats()["losses"] == 0  # none of that costs the process


async def test_loops_and_sleeps_stop_at_the_time_limit_in_the_process() -> None:
    async with reward(
        fn("spins"), fn("sleeps"), fn("swallows"), fn("length"), timeout_s=0.5
    ) as actor:
        result = await actor.score_rows([row("go"), row("stop")])
        assert result["per_function"] == {
            "spins": [0.0, 1.0],
            "sleeps": [0.0, 0.0],
            "swallows": [0.0, 0.0],
            "length": [2.0, 4.0],
        }
        assert result["failures"]["spins"] == {"error": 0, "timeout": 1}
        assert result["failures"]["sleeps"] == {"error": 0, "timeout": 2}
        assert result["failures"]["swallows"] == {"error": 0, "timeout": 2}
        assert actor.stats()["losses"] == 0  # SIGALRM stopped each: no kill
        assert "limit of 0.5 s" in actor.stats()["last_error"]["sleeps"]


async def test_a_function_deaf_to_the_alarm_is_killed_at_the_deadline_and_dropped() -> None:
    async with reward(fn("deaf"), fn("length"), timeout_s=0.5) as actor:
        rows = [row("slow"), row("slow!"), row("fast"), row("fast")]
        result = await actor.score_rows(rows)
        # killed at rows 0 and 1; then not run again in this batch, its rows timeouts unrun
        assert result["per_function"]["deaf"] == [0.0] * 4
        assert result["failures"]["deaf"] == {"error": 0, "timeout": 4}
        assert result["per_function"]["length"] == [4.0, 5.0, 4.0, 4.0]  # all scored
        assert result["failures"]["length"] == {"error": 0, "timeout": 0}
        stats = actor.stats()
        assert stats["losses"] == HARD_FAILURES and stats["starts"] == 1 + HARD_FAILURES
        assert "killed" in stats["last_error"]["deaf"]
        # the next batch scores in a fresh process, the function given its chance again
        again = await actor.score_rows([row("fast")])
        assert again["per_function"] == {"deaf": [1.0], "length": [4.0]}


async def test_a_function_that_kills_its_process_is_an_error_and_the_process_replaced() -> None:
    async with reward(fn("exits"), fn("length")) as actor:
        result = await actor.score_rows([row("ok"), row("exit"), row("ok")])
        assert result["per_function"] == {"exits": [1.0, 0.0, 1.0], "length": [2.0, 4.0, 2.0]}
        assert result["failures"]["exits"] == {"error": 1, "timeout": 0}
        stats = actor.stats()
        assert stats["starts"] == 2 and stats["losses"] == 1
        assert "died" in stats["last_error"]["exits"]


async def test_a_cancelled_batch_kills_the_process_and_the_next_starts_one() -> None:
    async with reward(fn("sleeps"), fn("length"), timeout_s=30.0) as actor:
        assert actor.runner is not None
        task = asyncio.ensure_future(actor.score_rows([row("x")]))
        for _ in range(200):
            await asyncio.sleep(0.05)
            process = actor.runner._process
            if process is not None and process.ready:
                break
        await asyncio.sleep(0.3)  # it sleeps in the call now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert actor.runner._process is None  # killed and reaped
    async with reward(fn("length")) as actor:
        assert (await actor.score_rows([row("abc")]))["rewards"] == [3.0]


async def test_rows_decoded_from_token_ids_with_the_checkpoints_tokenizer(
    tmp_path: pathlib.Path,
) -> None:
    folder = models.make_tiny("llama", tmp_path / "tiny")
    tokenizer = models.Tokenizer(folder)
    text = "hello world"
    ids = tokenizer.encode(text)
    eos = tokenizer.eos_id
    assert eos is not None
    async with reward(fn("length"), fn("has_answer"), tokenizer=folder) as actor:
        result = await actor.score_rows(
            [
                {"prompt": "p", "completion_ids": [*ids, eos], "fields": {"answer": "world"}},
                {
                    "prompt": "p",
                    "completion": "text wins",
                    "completion_ids": ids,
                    "fields": {"answer": "zz"},
                },
            ]
        )
        assert result["per_function"]["length"] == [float(len(tokenizer.decode(ids))), 9.0]
        assert tokenizer.decode([*ids, eos]) == tokenizer.decode(ids)  # special tokens skipped
        assert result["per_function"]["has_answer"] == [1.0, 0.0]
    async with reward(fn("length")) as actor:
        with pytest.raises(ValueError, match="spawn Reward\\(functions=..., tokenizer="):
            await actor.score_rows([{"prompt": "p", "completion_ids": ids}])


async def test_malformed_rows_are_refused_before_anything_runs() -> None:
    async with reward(fn("length")) as actor:
        bad = [
            ("nope", "takes a list of row dicts"),
            ([["p", "c"]], "row 0 is a dict"),
            (
                [row(), {"prompt": "p", "completions": "c"}],
                "row 1: unknown keys \\['completions'\\]",
            ),
            ([{"prompt": 3, "completion": "c"}], "row 0: 'prompt' is text"),
            ([{"prompt": "p"}], "row 0 has neither 'completion' nor 'completion_ids'"),
            ([{"prompt": "p", "completion_ids": [1, -2]}], "list of token ids"),
            ([{"prompt": "p", "completion": 5}], "'completion' is text"),
            ([{"prompt": "p", "completion": "c", "fields": [1]}], "'fields' is a dict"),
            (
                [{"prompt": "p", "completion": "c", "fields": {"prompt": "x"}}],
                "may not be named 'prompt'",
            ),
            ([row(blob=b"\x00" * 3, thing={1, 2})], "row 0: its fields must be plain data"),
        ]
        for rows, message in bad:
            with pytest.raises(ValueError, match=message):
                await actor.score_rows(rows)
        assert actor.runner is not None and actor.runner.starts == 0
        with pytest.raises(ValueError, match="call score_rows"):
            actor.score([["p", "c"]])
    legacy = Reward("tests.roles.scorers:length_ratio")
    with pytest.raises(ValueError, match="spawned with a scorer"):
        await legacy.score_rows([row()])
    assert legacy.stats() == {"scorer": "tests.roles.scorers:length_ratio", "scored": 0}


def test_the_constructor_refuses_what_cannot_work() -> None:
    with pytest.raises(oc.ConfigError, match="a scorer or functions, not both"):
        Reward("tests.roles.scorers:length_ratio", functions=[fn("length")])
    with pytest.raises(oc.ConfigError, match="tokenizer decodes rows for functions"):
        Reward(tokenizer="/nowhere")
    with pytest.raises(oc.ConfigError, match="timeout_s is above 0"):
        Reward(functions=[fn("length")], timeout_s=0)
    with pytest.raises(oc.ConfigError, match="default is a finite number"):
        Reward(functions=[fn("length")], default=math.nan)
    with pytest.raises(oc.ConfigError, match="not a readable tokenizer"):
        Reward(functions=[fn("length")], tokenizer="/nowhere")
    with pytest.raises(oc.ConfigError, match="non-empty list"):
        Reward(functions=[])
    with pytest.raises(oc.ConfigError, match="'needs_label'.*neither a field"):
        check_functions([fn("needs_label")], {"answer"})


def test_check_functions_names_the_function_and_the_fix() -> None:
    fields = {"answer", "metadata", "prompt"}
    names = check_functions(
        [
            fn("scaled", args={"scale": 2}),
            fn("every_field", name="all"),
            {"path": "orchestr.roles.reward:regex_match", "args": {"pattern": "^a+$"}},
            {"path": "orchestr.roles.reward:reasoning_gym_score"},
        ],
        fields,
    )
    assert names == ["scaled", "all", "regex_match", "reasoning_gym_score"]
    cases = [
        ({"path": "no.such.module:f"}, "cannot import 'no.such.module:f': ModuleNotFoundError"),
        ({"path": f"{F}:missing"}, f"cannot import '{F}:missing': AttributeError"),
        (
            {"path": "tests.roles.reward.broken_module:f"},
            "RuntimeError: this module cannot be imported",
        ),
        (fn("NOT_CALLABLE"), "is not callable"),
        (
            fn("needs_label"),
            "'needs_label' .*parameter 'label' is neither a field of the dataset nor in its "
            "'args'; the dataset's fields are: answer, metadata \\(rename it",
        ),
        (fn("one_arg"), "names a .prompt. parameter but no .completion."),
        (fn("unnamed_one"), "fewer than two positional parameters"),
        (fn("positional"), "parameter 'extra' is positional-only"),
        (fn("scaled"), "parameter 'scale' is neither"),
        (fn("length", args={"size": 1}), "'args' sets 'size', which is not one of its parameters"),
        (fn("length", args={"prompt": 1}), "'args' sets 'prompt', which the row"),
        (
            {"path": "orchestr.roles.reward:regex_match", "args": {"pattern": "(unclosed"}},
            "'regex_match'.*'args' refused: the pattern '\\(unclosed' does not compile",
        ),
        (
            {"path": "orchestr.roles.reward:regex_match"},
            "parameter 'pattern' is neither",
        ),
        ({"path": "no-colon"}, "'path' is 'package.module:function'"),
        (fn("length", weight=True), "'weight' is a number"),
        (fn("length", weight=math.inf), "'weight' is a finite number"),
        (fn("length", color="red"), "unknown keys \\['color'\\]"),
        (fn("length", args={"x": object()}), "'args' must be plain data"),
    ]
    for spec, message in cases:
        with pytest.raises(oc.ConfigError, match=message):
            check_functions([spec], fields)
    with pytest.raises(oc.ConfigError, match="a second function is named 'length'"):
        check_functions([fn("length"), fn("length")], fields)
    # every problem in one message
    with pytest.raises(oc.ConfigError, match="(?s)reward functions:\n- .*'one_arg'.*\n- .*'label'"):
        check_functions([fn("one_arg"), fn("needs_label")], fields)


async def test_the_reward_mesh_scores_rows_on_a_cluster(ctx: oc.JobContext) -> None:
    functions = [
        {"path": "orchestr.roles.reward:exact_match", "weight": 1.0},
        {"path": "orchestr.roles.reward:math_answer", "weight": 0.5, "name": "math"},
        fn("completion_first", 0.0),  # named parameters: the completion, not the prompt
        fn("exits", 0.0),
    ]
    mesh = await ctx.spawn(Reward, functions=functions, timeout_s=5.0, resources={"cpu": 0.25})
    rows = [
        row("so \\boxed{\\frac{1}{2}}", answer="0.5"),
        row("thinking...\n0.5.", answer="0.5"),
        row("I think 7", answer="7"),
        row("exit", answer="7"),  # last: the process it kills is not needed again
    ]
    result = await mesh[0].score_rows.call_one(rows)
    assert result["per_function"]["exact_match"] == [0.0, 1.0, 0.0, 0.0]
    assert result["per_function"]["math"] == [1.0, 1.0, 1.0, 0.0]
    assert result["per_function"]["completion_first"] == [
        len(r["completion"]) + (0.5 if r["fields"]["answer"] in r["completion"] else 0.0)
        for r in rows
    ]
    assert result["rewards"] == [0.5, 1.5, 0.5, 0.0]
    assert result["failures"]["exits"] == {"error": 1, "timeout": 0}
    stats = await mesh[0].stats.call_one()
    assert stats["scored"] == 4 and stats["losses"] == 1 and stats["starts"] == 1
    with pytest.raises(oc.SpawnError, match="'one_arg'.*names a 'prompt' parameter but no"):
        await ctx.spawn(Reward, functions=[fn("one_arg"), fn("needs_label")])
