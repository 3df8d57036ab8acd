"""The trainer's algorithm options against small cases computed by hand: advantage estimators,
clip-higher, loss aggregation, KL estimators, the overlong penalty, learning-rate schedules
and the update settings' validation."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from orchestr.roles.trainer import (
    UpdateConfig,
    group_advantages,
    grpo_loss,
    kl_penalty,
    overlong_penalty,
    scheduled_lr,
)
from orchestr.roles.trainer._advantages import batch_moments, whiten
from orchestr.roles.trainer._micro import plan_micro_batches

# Two groups of three: [3, 0, 0] (mean 1) and [1, 1, 4] (mean 2).
REWARDS = torch.tensor([3.0, 0.0, 0.0, 1.0, 1.0, 4.0])


def close(actual: torch.Tensor | None, expected: list[Any]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), atol=1e-6, rtol=1e-6)


def test_grpo_divides_by_the_group_std() -> None:
    # deviations [2, -1, -1] and [-1, -1, 2]; population variance (4 + 1 + 1) / 3 = 2, so
    # with eps 0 the advantages are 2 / sqrt(2) = 1.4142136 and -1 / sqrt(2) = -0.7071068
    close(
        group_advantages(REWARDS, 3, eps=0.0),
        [1.4142136, -0.7071068, -0.7071068, -0.7071068, -0.7071068, 1.4142136],
    )
    # a group that scored the same learns nothing; scale -1 is the sign-flipped control
    close(group_advantages(torch.tensor([5.0, 5.0]), 2), [0.0, 0.0])
    close(group_advantages(REWARDS[:3], 3, eps=0.0, scale=-1.0), [-1.4142136, 0.7071068, 0.7071068])


def test_dr_grpo_subtracts_the_group_mean_only() -> None:
    # r - mean: [3-1, 0-1, 0-1, 1-2, 1-2, 4-2]
    close(group_advantages(REWARDS, 3, estimator="dr_grpo"), [2.0, -1.0, -1.0, -1.0, -1.0, 2.0])
    close(group_advantages(REWARDS, 3, estimator="dr_grpo", scale=0.0), [0.0] * 6)


def test_rloo_takes_the_mean_of_the_others() -> None:
    # 3 - (0+0)/2 = 3, 0 - (3+0)/2 = -1.5 (twice); 1 - (1+4)/2 = -1.5 (twice), 4 - (1+1)/2 = 3
    close(group_advantages(REWARDS, 3, estimator="rloo"), [3.0, -1.5, -1.5, -1.5, -1.5, 3.0])
    close(group_advantages(REWARDS, 3, estimator="rloo", scale=-1.0)[:2], [-3.0, 1.5])
    with pytest.raises(ValueError, match="'rloo' needs groups of at least 2"):
        group_advantages(REWARDS, 1, estimator="rloo")


def test_reinforce_pp_whitens_the_group_baseline_over_the_batch_tokens() -> None:
    # group-mean baseline: [2, -1, -1, -1, -1, 2]. One token each: mean 0, sum of squares 12
    # over 6 tokens, unbiased variance 12 / 5 = 2.4, so 2 / sqrt(2.4) = 1.2909944 and
    # -1 / sqrt(2.4) = -0.6454972 (the 1e-8 under the root is below float32's resolution)
    close(
        group_advantages(REWARDS, 3, estimator="reinforce_pp"),
        [1.2909944, -0.6454972, -0.6454972, -0.6454972, -0.6454972, 1.2909944],
    )
    # Token counts [3, 1, 0, 1, 1, 2] (8 tokens): mean (6 - 1 + 0 - 1 - 1 + 4) / 8 = 0.875;
    # mean square (12 + 1 + 0 + 1 + 1 + 8) / 8 = 2.875; biased variance 2.875 - 0.875**2 =
    # 2.109375, unbiased * 8/7 = 2.4107143, std 1.5526475. (2 - 0.875) / 1.5526475 =
    # 0.7245688, (-1 - 0.875) / 1.5526475 = -1.2076147; a sample with no token gets 0.
    weights = torch.tensor([3.0, 1.0, 0.0, 1.0, 1.0, 2.0])
    expected = [0.7245688, -1.2076147, 0.0, -1.2076147, -1.2076147, 0.7245688]
    close(group_advantages(REWARDS, 3, estimator="reinforce_pp", weights=weights), expected)
    close(
        group_advantages(REWARDS, 3, estimator="reinforce_pp", weights=weights, scale=-1.0),
        [-x for x in expected],
    )
    # a group of one keeps its reward as it is (baseline 0) before the whitening: [1, 3]
    # -> mean 2, unbiased variance 2, so -1 / sqrt(2) and 1 / sqrt(2)
    close(
        group_advantages(torch.tensor([1.0, 3.0]), 1, estimator="reinforce_pp"),
        [-0.7071068, 0.7071068],
    )


def test_reinforce_pp_whitening_is_the_whole_batchs_across_shards() -> None:
    """What the all-reduce gives each data-parallel shard: the sums of both shards' moments,
    with which each shard's whitened values are the whole batch's rows."""
    centred = torch.tensor([2.0, -1.0, -1.0, -1.0, -1.0, 2.0])
    weights = torch.tensor([3.0, 1.0, 0.0, 1.0, 1.0, 2.0])
    # (sum w, sum w*v, sum w*v^2) = (8, 7, 23), as in the case above
    moments = batch_moments(centred, weights)
    assert moments.tolist() == [8.0, 7.0, 23.0]
    whole = whiten(centred, weights, moments)
    shards = batch_moments(centred[:2], weights[:2]) + batch_moments(centred[2:], weights[2:])
    torch.testing.assert_close(whiten(centred[2:], weights[2:], shards), whole[2:])
    # a batch of one token has no spread: nothing to learn from
    close(whiten(torch.tensor([4.0]), torch.tensor([1.0]), torch.tensor([1.0, 4.0, 16.0])), [0.0])


def test_unknown_estimators_and_bad_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="advantage must be one of grpo, dr_grpo, rloo"):
        group_advantages(REWARDS, 3, estimator="ppo")
    with pytest.raises(ValueError, match=r"weights must be \[N\] = \[6\]"):
        group_advantages(REWARDS, 3, estimator="reinforce_pp", weights=torch.ones(5))


def test_clip_higher_widens_only_the_upper_clip() -> None:
    # one row, behaviour log-probs 0, ratios [1.5, 0.7, 1.25], advantage +1, clip_eps 0.2:
    # symmetric [0.8, 1.2]: min(r, clip(r)) = [1.2, 0.7, 1.2], mean 3.1 / 3 = 1.0333333;
    # every ratio is outside the range
    ratios = torch.tensor([[1.5, 0.7, 1.25]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.tensor([1.0])
    logp = ratios.log().requires_grad_()
    loss, stats = grpo_loss(logp, torch.zeros(1, 3), adv, mask, 0.2)
    assert stats["loss"] == pytest.approx(-1.0333333) and stats["clip_frac"] == 1.0
    # clip-higher [0.8, 1.28]: [1.28, 0.7, 1.25], mean 3.23 / 3 = 1.0766667; 1.5 and 0.7 are
    # outside (2/3). The gradient of -mean(r) by log r is -r / 3 where r is unclipped (0.7,
    # 1.25: -0.2333333, -0.4166667) and 0 where the clip holds it (1.5).
    loss, stats = grpo_loss(logp, torch.zeros(1, 3), adv, mask, 0.2, clip_eps_high=0.28)
    assert stats["loss"] == pytest.approx(-1.0766667)
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    loss.backward()  # type: ignore[no-untyped-call]
    close(logp.grad, [[0.0, -0.2333333, -0.4166667]])


@pytest.mark.parametrize(
    ("mode", "alone", "shard"),
    [
        # the tokens' objectives are [1, 1] and [-4]; a shard of a batch of 6 tokens, 4 rows:
        # (1 + 1 - 4) / 3 = -2/3 alone, -2/6 as the shard
        ("token_mean", 2 / 3, 1 / 3),
        # row means 1 and -4: (1 - 4) / 2 = -1.5 alone, -3/4 as the shard
        ("seq_mean_token_mean", 1.5, 0.75),
        # row sums 2 and -4: (2 - 4) / 2 = -1 alone, -2/4 as the shard
        ("seq_mean_token_sum", 1.0, 0.5),
    ],
)
def test_loss_aggregation(mode: str, alone: float, shard: float) -> None:
    # ratio 1 everywhere, so each token's objective is its row's advantage
    mask = torch.tensor([[True, True], [True, False]])
    args = (torch.zeros(2, 2), torch.zeros(2, 2), torch.tensor([1.0, -4.0]), mask, 0.2)
    assert grpo_loss(*args, loss_agg=mode)[1]["loss"] == pytest.approx(alone)
    _, stats = grpo_loss(*args, total_tokens=6, loss_agg=mode, total_seqs=4)
    assert stats["loss"] == pytest.approx(shard)
    assert stats["ratio_mean"] == pytest.approx(3 / 6)  # stats stay means over tokens
    with pytest.raises(ValueError, match="loss_agg must be one of token_mean"):
        grpo_loss(*args, loss_agg="sum")


def test_kl_estimators() -> None:
    # token 1: policy 0.5, reference 0.25; token 2: policy 0.25, reference 0.5. With
    # d = ref - logp = -ln 2 and +ln 2 (ln 2 = 0.6931472):
    # k1 = logp - ref = [ln 2, -ln 2]; k2 = d^2 / 2 = 0.2402265 for both;
    # k3 = e^d - d - 1 = [0.5 + 0.6931472 - 1, 2 - 0.6931472 - 1] = [0.1931472, 0.3068528]
    logp = torch.tensor([math.log(0.5), math.log(0.25)], requires_grad=True)
    ref = torch.tensor([math.log(0.25), math.log(0.5)])
    close(kl_penalty(logp, ref, "k1"), [0.6931472, -0.6931472])
    close(kl_penalty(logp, ref, "k2"), [0.2402265, 0.2402265])
    k3 = kl_penalty(logp, ref)
    close(k3, [0.1931472, 0.3068528])
    # d k3 / d logp = 1 - e^d = [0.5, -1]: the reference pulls the policy back either way
    k3.sum().backward()  # type: ignore[no-untyped-call]
    close(logp.grad, [0.5, -1.0])
    with pytest.raises(ValueError, match="kl_estimator must be one of k1, k2, k3"):
        kl_penalty(logp, ref, "k4")


def test_overlong_penalty() -> None:
    # max_len 10, buffer 4, factor 2: 0 up to 6 tokens, then -2 * (length - 6) / 4, -2 at 10+
    assert [overlong_penalty(n, 10, 4, 2.0) for n in (0, 6, 7, 8, 10, 12)] == [
        0.0,
        0.0,
        -0.5,
        -1.0,
        -2.0,
        -2.0,
    ]
    # without a buffer only a completion past its limit pays
    assert [overlong_penalty(n, 10, 0) for n in (10, 11)] == [0.0, -1.0]
    for bad in [(-1, 10, 4), (5, 0, 0), (5, 10, 11), (5, 10, -1)]:
        with pytest.raises(ValueError):
            overlong_penalty(*bad)
    with pytest.raises(ValueError, match="factor must be >= 0"):
        overlong_penalty(5, 10, 4, -1.0)


def test_schedules_with_warmup() -> None:
    # linear over 5 versions with 2 of warm-up, floor 0.2: 1/2, 2/2, then from 1 down to 0.2
    # over the 3 left: 0.2 + 0.8 * (1 - k/3) for k = 0, 1, 2, 3 and held after
    rates = [scheduled_lr(1.0, v, "linear", 5, 0.2, warmup=2) for v in range(7)]
    assert rates == pytest.approx([0.5, 1.0, 1.0, 0.7333333, 0.4666667, 0.2, 0.2])
    # cosine over 3 with 1 of warm-up, floor 0: 1/1, then 1, (1 + cos(pi/2)) / 2, 0
    rates = [scheduled_lr(1.0, v, "cosine", 3, 0.0, warmup=1) for v in range(4)]
    assert rates == pytest.approx([1.0, 1.0, 0.5, 0.0])
    rates = [scheduled_lr(2.0, v, "constant", 1, 0.0, warmup=4) for v in (0, 1, 3, 10)]
    assert rates == [0.5, 1.0, 2.0, 2.0]
    # no warm-up: the positional call the reference loop makes, as before
    assert scheduled_lr(1.0, 1, "cosine", 2, 0.5) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="warmup must be >= 0"):
        scheduled_lr(1.0, 0, "linear", 3, 0.0, warmup=3)
    with pytest.raises(ValueError, match="warmup must be >= 0"):
        scheduled_lr(1.0, 0, "constant", 3, 0.0, warmup=-1)


def test_micro_batches_keep_order_and_their_bound() -> None:
    prompts, lengths = [2, 3, 2, 2], [4, 1, 6, 2]
    # bound 16: [0] is 1 x 6; [0, 1] is 2 x (3 + 4) = 14; adding 2 makes 3 x (3 + 6) = 27,
    # so 2 starts a run (1 x 8); [2, 3] is 2 x (2 + 6) = 16
    assert plan_micro_batches(prompts, lengths, 16) == [[0, 1], [2, 3]]
    # a sample wider than the bound runs alone
    assert plan_micro_batches(prompts, lengths, 5) == [[0], [1], [2], [3]]
    assert plan_micro_batches(prompts, lengths, None) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="micro_batch_tokens must be >= 1"):
        plan_micro_batches(prompts, lengths, 0)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("advantage", "ppo", "advantage must be one of grpo, dr_grpo, rloo, reinforce_pp"),
        ("loss_agg", "sum", "loss_agg must be one of token_mean, seq_mean_token_mean"),
        ("kl_estimator", "k4", "kl_estimator must be one of k1, k2, k3"),
        ("kl_coef", -0.1, "kl_coef must be >= 0"),
        ("clip_eps_high", 0.0, "clip_eps_high must be positive"),
        ("overlong_filter", 1, "overlong_filter must be True or False"),
        ("micro_batch_tokens", 0, "micro_batch_tokens must be an int >= 1"),
        ("micro_batch_tokens", 2.5, "micro_batch_tokens must be an int >= 1"),
    ],
)
def test_update_settings_are_checked(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        UpdateConfig(**{field: value})


def test_defaults_are_todays_grpo() -> None:
    config = UpdateConfig()
    assert (config.advantage, config.clip_eps_high, config.loss_agg) == ("grpo", None, "token_mean")
    assert (config.kl_coef, config.kl_estimator, config.overlong_filter) == (0.0, "k3", False)
    assert config.micro_batch_tokens is None
