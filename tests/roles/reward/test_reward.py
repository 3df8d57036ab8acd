"""The reward role: a stateless mesh, the task's rule-based scorer and user scorers by path."""

from __future__ import annotations

import pytest

import orchestr as oc
from orchestr.roles.reward._actor import Reward, load_scorer
from orchestr.roles.rl import _task


async def test_the_default_scorer_is_the_tasks(ctx: oc.JobContext) -> None:
    rewards = await ctx.spawn(Reward, n=2, resources={"cpu": 0.25})
    digits = [1, 2, 3, 4]
    right = _task.answer(digits)
    half = [4, 3, 9, 9, _task.EOS]
    scores = await rewards[0].score.call_one([[digits, right], [digits, half], [digits, []]])
    assert scores == [1.0, 0.5, 0.0]
    assert await rewards[1].score.call_one([[digits, right]]) == [1.0]
    assert [s["scored"] for s in await rewards.stats.call()] == [3, 1]


async def test_a_user_scorer_by_path_and_bad_input(ctx: oc.JobContext) -> None:
    mine = await ctx.spawn(Reward, "tests.roles.scorers:length_ratio")
    assert await mine.score.call_one([["ab", "abcd"], ["abcd", "ab"]]) == [2.0, 0.5]
    with pytest.raises(oc.ActorError, match="is not a \\[prompt, completion\\] pair"):
        await mine.score.call_one([["only one"]])
    with pytest.raises(oc.ActorError, match="takes a list"):
        await mine.score.call_one("nope")
    odd = await ctx.spawn(Reward, "tests.roles.scorers:not_a_number")
    with pytest.raises(oc.ActorError, match="returned 'high' for sample 0"):
        await odd.score.call_one([["a", "b"]])
    with pytest.raises(oc.SpawnError, match="cannot import scorer 'no.such:thing'"):
        await ctx.spawn(Reward, "no.such:thing")


def test_load_scorer_errors() -> None:
    with pytest.raises(oc.ConfigError, match="package.module:callable"):
        load_scorer("no-colon")
    with pytest.raises(oc.ConfigError, match="is not callable"):
        load_scorer("tests.roles.scorers:NOT_CALLABLE")
    assert load_scorer("tests.roles.scorers:length_ratio")("a", "ab") == 2.0
