"""The learning core of the RL loop: the digit-reversal task, TinyLM, generation, GRPO's math,
and the single-process reference run's determinism. That it learns, and that its two controls
do not, is tested through the roles, whose sync mode reproduces it bit for bit
(``test_grpo_job.py``): the example learning in each mode while its roles are killed
(``test_grpo_faults.py``), and the controls (``test_controls_through_the_roles``)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from orchestr.roles._common._model import TinyLM, TinyLMConfig
from orchestr.roles._common._rollout import (
    completion_logprobs,
    generate,
    sample_key,
    token_logprobs,
)
from orchestr.roles._common._seeding import derive_seed
from orchestr.roles.rl import _task
from orchestr.roles.rl._reference import SMALL_CONFIG, History, TrainConfig, train
from orchestr.roles.rl._task import BOS, EOS, PAD, SEP
from orchestr.roles.trainer import UpdateConfig, grpo_update, scheduled_lr
from orchestr.roles.trainer._grpo import group_advantages, grpo_loss

#: The task's own ids: sampling knows none of its own.
TOKENS = {"pad_id": PAD, "eos_id": EOS}

LENGTHS = _task.LengthDistribution()


# --- task ------------------------------------------------------------------------------------


def test_encode_and_decode() -> None:
    digits = _task.prompt_from_str("0123")
    assert digits == (0, 1, 2, 3)
    assert _task.encode_prompt(digits) == [BOS, 0, 1, 2, 3, SEP]
    assert _task.answer(digits) == [3, 2, 1, 0]
    assert _task.max_new_tokens(digits) == 4
    assert _task.decode([BOS, 4, 2, SEP, 2, 4, EOS, PAD, 99]) == "<bos>42<sep>24<eos><pad><?99>"


@pytest.mark.parametrize("text", ["", "12a", "1 2", "-1", "١٢", "1" * 17])
def test_bad_prompt_strings(text: str) -> None:
    with pytest.raises(ValueError, match="digits"):
        _task.prompt_from_str(text)


@pytest.mark.parametrize("digits", [(), (1, 10), (1, -1), tuple([1] * 17)])
def test_bad_prompts(digits: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="digits"):
        _task.encode_prompt(digits)
    with pytest.raises(ValueError, match="digits"):
        _task.reward(digits, [1])


def test_reward() -> None:
    p = (1, 2, 3)  # the answer is 3 2 1
    assert _task.reward(p, [3, 2, 1]) == 1.0
    assert _task.reward(p, [3, 2, 1, EOS, 7, PAD]) == 1.0  # after EOS nothing counts
    assert _task.reward(p, [3, 0, 1]) == pytest.approx(2 / 3)
    assert _task.reward(p, [3, EOS, 1]) == pytest.approx(1 / 3)  # short: missing positions lose
    assert _task.reward(p, []) == 0.0
    assert _task.reward(p, [3, 2, 1, 0]) == pytest.approx(3 / 4)  # long: diluted
    assert _task.reward(p, [3, SEP, BOS]) == pytest.approx(1 / 3)  # non-digits are wrong
    assert _task.reward((7,), [PAD]) == 0.0


def test_accuracy() -> None:
    p = (1, 2, 3)
    assert _task.accuracy(p, [3, 2, 1])
    assert _task.accuracy(p, [3, 2, 1, EOS, 5])
    assert not _task.accuracy(p, [3, 2])
    assert not _task.accuracy(p, [3, 2, 1, 0])
    assert not _task.accuracy(p, [3, 2, 0])


def test_copy_within_a_field() -> None:
    task = _task.Task("copy", field=5)
    p = (1, 2, 3)
    prompt = task.encode_prompt(p)
    assert prompt == [BOS, 1, 2, 3, _task.FILL, _task.FILL, SEP]
    assert len(task.encode_prompt((4,))) == len(task.encode_prompt((1, 2, 3, 4, 5)))  # one length
    assert task.digits_of(prompt) == p
    assert task.answer(p) == [1, 2, 3]
    assert task.reward(p, [1, 2, 3, EOS]) == 1.0 and task.accuracy(p, [1, 2, 3])
    assert task.reward(p, [3, 2, 1]) == pytest.approx(1 / 3)  # the reversal is not the answer
    assert not task.accuracy(p, [3, 2, 1])
    assert _task.copy_reward(p, [1, 2, 0]) == pytest.approx(2 / 3)
    reverse = _task.Task("reverse", field=5)
    assert reverse.encode_prompt(p) == prompt and reverse.accuracy(p, [3, 2, 1])
    assert _task.Task().encode_prompt(p) == _task.encode_prompt(p)  # no field: today's prompts
    with pytest.raises(ValueError, match="overflows a field of 5"):
        task.encode_prompt((1,) * 6)
    with pytest.raises(ValueError, match="task must be one of reverse, copy"):
        _task.Task("sort")
    with pytest.raises(ValueError, match="field must be in 1..16"):
        _task.Task("copy", field=17)
    with pytest.raises(ValueError, match="narrower than the longest prompt"):
        TrainConfig(task=_task.Task("copy", field=8))  # the demo's prompts have up to 16 digits


def test_lr_schedules() -> None:
    assert scheduled_lr(2e-3, 7, "constant", 10, 0.1) == 2e-3
    cosine = [scheduled_lr(2e-3, v, "cosine", 4, 0.1) for v in range(6)]
    assert cosine[0] == pytest.approx(2e-3) and cosine[2] == pytest.approx(1.1e-3)
    assert cosine[4] == cosine[5] == pytest.approx(2e-4)  # it stays at the floor past the end
    assert cosine == sorted(cosine, reverse=True)
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        TrainConfig(lr_schedule="step")
    with pytest.raises(ValueError, match="min_ratio in"):
        TrainConfig(lr_schedule="cosine", min_lr_ratio=-0.5)


def test_random_policy_scores_about_a_tenth() -> None:
    rng = torch.Generator().manual_seed(0)
    scores = []
    for i in range(2000):
        p = _task.sample_prompt(0, 0, i, LENGTHS)
        guess = torch.randint(0, 10, (len(p),), generator=rng).tolist()
        scores.append(_task.reward(p, guess))
    assert sum(scores) / len(scores) == pytest.approx(0.1, abs=0.015)


def test_prompts_are_keyed_and_skewed() -> None:
    a = [_task.sample_prompt(7, 3, i, LENGTHS) for i in range(2000)]
    assert a == [_task.sample_prompt(7, 3, i, LENGTHS) for i in range(2000)]
    assert a[5] == _task.sample_prompt(7, 3, 5, LENGTHS)  # no hidden order dependence
    assert a != [_task.sample_prompt(8, 3, i, LENGTHS) for i in range(2000)]
    assert a != [_task.sample_prompt(7, 4, i, LENGTHS) for i in range(2000)]
    lengths = [len(p) for p in a]
    assert min(lengths) == 1 and max(lengths) == 16
    assert sum(n <= 4 for n in lengths) / len(a) > 0.45  # most short
    assert 0.05 < sum(n >= 12 for n in lengths) / len(a) < 0.15  # a long tail
    assert all(0 <= d <= 9 for p in a for d in p)


def test_eval_set_is_fixed() -> None:
    held_out = _task.eval_prompts(64, LENGTHS)
    assert held_out == _task.eval_prompts(64, LENGTHS)
    assert len({len(p) for p in held_out}) > 5
    small = _task.eval_prompts(64, _task.LengthDistribution(max_digits=6))
    assert max(len(p) for p in small) <= 6
    with pytest.raises(ValueError, match="at least one"):
        _task.eval_prompts(0, LENGTHS)


def test_length_distribution_checks() -> None:
    with pytest.raises(ValueError, match="max_digits"):
        _task.LengthDistribution(max_digits=17)
    with pytest.raises(ValueError, match="decay"):
        _task.LengthDistribution(decay=0.0)
    assert 5 < LENGTHS.mean() < 6


def test_derive_seed() -> None:
    assert derive_seed("prompt", 1, 2) == derive_seed("prompt", 1, 2)
    assert derive_seed("prompt", 1, 2) != derive_seed("sample", 1, 2)
    assert derive_seed("prompt", 1, 2) != derive_seed("prompt", 12)
    assert 0 <= derive_seed("x", 2**70) < 2**63
    with pytest.raises(TypeError, match="ints"):
        derive_seed("prompt", 1.0)


# --- model and generation --------------------------------------------------------------------


@pytest.fixture
def model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(d_model=32, n_heads=2, d_ff=64))


def test_forward_shape_and_padding_is_invisible(model: TinyLM) -> None:
    seq = [*_task.encode_prompt((4, 2, 7)), 7, 2]
    plain = model(torch.tensor([seq]))
    assert plain.shape == (1, len(seq), _task.VOCAB_SIZE)
    padded = model(torch.tensor([[PAD, PAD, *seq, PAD]]))
    torch.testing.assert_close(padded[:, 2:-1], plain)


def test_from_start_positions_are_padding_invariant_too() -> None:
    torch.manual_seed(0)
    m = TinyLM(TinyLMConfig(d_model=32, n_heads=2, d_ff=64, positions="from_start"))
    seq = [BOS, 1, 2]  # no separator needed
    torch.testing.assert_close(m(torch.tensor([[PAD, *seq]]))[:, 1:], m(torch.tensor([seq])))


def test_forward_errors(model: TinyLM) -> None:
    with pytest.raises(ValueError, match="token ids"):
        model(torch.tensor([[BOS, 14, SEP]]))
    with pytest.raises(ValueError, match="separator"):
        model(torch.tensor([[BOS, 1, 2]]))
    with pytest.raises(ValueError, match="outside the model's table"):
        model(torch.tensor([[BOS, *([1] * 20), SEP]]))
    with pytest.raises(ValueError, match=r"\[batch, time\]"):
        model(torch.tensor([BOS, 1, SEP]))
    with pytest.raises(ValueError, match="multiple of n_heads"):
        TinyLMConfig(d_model=30, n_heads=4)


def _prompts(n: int) -> list[tuple[int, ...]]:
    return [_task.sample_prompt(1, 0, i, LENGTHS) for i in range(n)]


def test_sampling_does_not_depend_on_the_batch(model: TinyLM) -> None:
    ps = _prompts(12)
    keys = [sample_key(1, 0, i, 0) for i in range(12)]
    enc = [_task.encode_prompt(p) for p in ps]
    caps = [_task.max_new_tokens(p) for p in ps]
    batch = generate(model, enc, caps, keys=keys, **TOKENS)
    order = list(reversed(range(12)))
    shuffled = generate(
        model,
        [enc[i] for i in order],
        [caps[i] for i in order],
        keys=[keys[i] for i in order],
        **TOKENS,
    )
    for pos, i in enumerate(order):
        alone = generate(model, [enc[i]], [caps[i]], keys=[keys[i]], **TOKENS)
        assert alone.completion(0) == batch.completion(i) == shuffled.completion(pos)
        assert batch.lengths[i] <= caps[i]
    again = generate(model, enc, caps, keys=[sample_key(1, 0, i, 1) for i in range(12)], **TOKENS)
    assert [again.completion(i) for i in range(12)] != [batch.completion(i) for i in range(12)]


def test_behaviour_logprobs_match_a_recomputation(model: TinyLM) -> None:
    ps = _prompts(16)
    gen = generate(
        model,
        [_task.encode_prompt(p) for p in ps],
        [_task.max_new_tokens(p) for p in ps],
        keys=[sample_key(2, 0, i, 0) for i in range(16)],
        temperature=0.7,
        **TOKENS,
    )
    full = token_logprobs(model, gen.tokens, gen.prompt_width, temperature=0.7) * gen.mask
    bucketed, entropy = completion_logprobs(model, gen, temperature=0.7)
    torch.testing.assert_close(bucketed, full)
    torch.testing.assert_close(gen.logprobs * gen.mask, full.detach())
    assert bool((entropy[gen.mask] > 0).all()) and bool((entropy[~gen.mask] == 0).all())
    assert bucketed.requires_grad


def test_update_reports_the_behaviour_gap(model: TinyLM) -> None:
    ps = _prompts(8)
    gen = generate(
        model,
        [_task.encode_prompt(p) for p in ps],
        [_task.max_new_tokens(p) for p in ps],
        keys=[sample_key(3, 0, i, 0) for i in range(8)],
        **TOKENS,
    )
    adv = torch.linspace(-1, 1, 8)
    config = UpdateConfig(updates=2)

    def gap(behaviour: torch.Tensor) -> float:
        trained = TinyLM(model.cfg)
        trained.load_state_dict(model.state_dict())
        opt = torch.optim.SGD(trained.parameters(), lr=0.1)
        return grpo_update(trained, opt, dataclasses.replace(gen, logprobs=behaviour), adv, config)[
            "logprob_gap"
        ]

    assert gap(gen.logprobs) == pytest.approx(0.0, abs=1e-6)  # sampled by this very model
    # every behaviour log-prob 0.25 off; padding (junk here) ignored
    shifted = torch.where(gen.mask, gen.logprobs - 0.25, 7.0)
    assert gap(shifted) == pytest.approx(0.25, abs=1e-5)


def test_greedy_is_deterministic_and_stops_at_eos() -> None:
    torch.manual_seed(0)
    m = TinyLM(TinyLMConfig(d_model=32, n_heads=2, d_ff=64))
    with torch.no_grad():
        m.head.bias[EOS] = 100.0  # a policy that always stops at once
    gen = generate(m, [_task.encode_prompt((1, 2, 3))], [3], **TOKENS)
    assert gen.completion(0) == [EOS]
    assert gen.tokens[0, gen.prompt_width + 1 :].tolist() == [PAD, PAD]
    assert _task.reward((1, 2, 3), gen.completion(0)) == 0.0
    # the stop and padding ids are the caller's: sampling has none of its own
    endless = generate(m, [_task.encode_prompt((1, 2, 3))], [3], pad_id=0, eos_id=None)
    assert endless.completion(0) == [EOS, EOS, EOS]
    other = generate(m, [_task.encode_prompt((1, 2))], [3], pad_id=0, eos_id=EOS)
    assert other.completion(0) == [EOS] and other.tokens[0, other.prompt_width + 1 :].tolist() == [
        0,
        0,
    ]


def test_tinylm_defaults_fit_the_example_task() -> None:
    """TinyLM imports nothing of the task; its defaults are the task's shape, checked here."""
    cfg = TinyLMConfig()
    assert (cfg.vocab_size, cfg.pad_id, cfg.sep_id) == (_task.VOCAB_SIZE, PAD, SEP)
    assert cfg.sep_position == _task.MAX_DIGITS + 1  # the separator after the longest prompt
    assert cfg.max_positions == 2 * _task.MAX_DIGITS + 4


def test_generate_errors(model: TinyLM) -> None:
    enc = [_task.encode_prompt((1,))]
    with pytest.raises(ValueError, match="max_new_tokens and keys"):
        generate(model, enc, [1, 2], **TOKENS)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, enc, [1], keys=[0], temperature=0.0, **TOKENS)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[]], [1], **TOKENS)


# --- GRPO ------------------------------------------------------------------------------------


def test_group_advantages_by_hand() -> None:
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.5, 0.2, 0.4])
    adv = group_advantages(rewards, 2, eps=1e-9)
    # groups: (0, 1) mean .5 std .5; (.5, .5) all equal, so no signal; (.2, .4) mean .3 std .1
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0, -1.0, 1.0]))
    with_eps = group_advantages(rewards[:2], 2, eps=1e-4)
    torch.testing.assert_close(with_eps, torch.tensor([-0.5, 0.5]) / (0.5 + 1e-4))
    torch.testing.assert_close(group_advantages(rewards, 2, scale=0.0), torch.zeros(6))
    torch.testing.assert_close(
        group_advantages(rewards, 3, scale=-1.0), -group_advantages(rewards, 3)
    )
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(rewards, 4)
    with pytest.raises(ValueError, match="one-dimensional"):
        group_advantages(rewards.view(2, 3), 3)


def test_grpo_loss_by_hand() -> None:
    # Four samples of one token each: ratios 1.5, 1.5, 0.5, 0.5 against advantages +1, -1, +1,
    # -1, clip 0.2. Objectives: min(1.5, 1.2) = 1.2; min(-1.5, -1.2) = -1.5;
    # min(0.5, 0.8) = 0.5; min(-0.5, -0.8) = -0.8. A fifth token is masked out.
    ratio = torch.tensor([[1.5, 9.0], [1.5, 9.0], [0.5, 9.0], [0.5, 9.0]])
    logp_new = ratio.log().requires_grad_(True)
    logp_b = torch.zeros(4, 2)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = torch.tensor([[True, False]] * 4)
    loss, stats = grpo_loss(logp_new, logp_b, adv, mask, clip_eps=0.2)
    expected = -(1.2 - 1.5 + 0.5 - 0.8) / 4
    assert float(loss.detach()) == pytest.approx(expected)
    assert stats["loss"] == pytest.approx(expected)
    assert stats["clip_frac"] == 1.0 and stats["tokens"] == 4.0
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["approx_kl"] == pytest.approx(-(2 * math.log(1.5) + 2 * math.log(0.5)) / 4)
    loss.backward()  # type: ignore[no-untyped-call]
    # Clipped where it helps (samples 0 and 3): no gradient. Elsewhere d/dlogp of
    # -(ratio * A) / 4 is -A * ratio / 4. Masked tokens get nothing.
    grad = logp_new.grad
    assert grad is not None
    torch.testing.assert_close(
        grad, torch.tensor([[0.0, 0.0], [1.5 / 4, 0.0], [-0.5 / 4, 0.0], [0.0, 0.0]])
    )


def test_grpo_loss_on_policy_is_the_policy_gradient() -> None:
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    loss, stats = grpo_loss(logp, logp.detach(), torch.tensor([2.0, -1.0]), mask, 0.2)
    assert float(loss.detach()) == pytest.approx(-(2 + 2 - 1) / 3)
    assert stats["clip_frac"] == 0.0 and stats["approx_kl"] == 0.0
    loss.backward()  # type: ignore[no-untyped-call]
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-2 / 3, -2 / 3], [1 / 3, 0.0]]))


def test_decoupled_loss_clips_against_the_proximal_policy_and_weighs_by_behaviour() -> None:
    # Two one-token samples, advantage +1. Behaviour log-probs log 0.25 and log 0.5; the
    # proximal policy (the weights before the batch) log 0.5 and log 2 (as ratios to 1): the
    # behaviour weights are 2 and 4 (capped to 3). The current policy equals the proximal
    # one, so the ratios are 1 and nothing is clipped even though the samples are stale.
    prox = torch.tensor([[math.log(0.5)], [math.log(2.0)]])
    behaviour = torch.tensor([[math.log(0.25)], [math.log(0.5)]])
    logp = prox.clone().requires_grad_(True)
    adv = torch.tensor([1.0, 1.0])
    mask = torch.ones(2, 1, dtype=torch.bool)
    loss, stats = grpo_loss(
        logp, behaviour, adv, mask, 0.2, logp_proximal=prox, behaviour_weight_cap=3.0
    )
    assert float(loss.detach()) == pytest.approx(-(2.0 + 3.0) / 2)
    assert stats["clip_frac"] == 0.0 and stats["behaviour_weight"] == pytest.approx(2.5)
    loss.backward()  # type: ignore[no-untyped-call]
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0], [-1.5]]))
    # against the behaviour policy (not decoupled) the same tokens are far outside the clip
    _, plain = grpo_loss(logp, behaviour, adv, mask, 0.2)
    assert plain["clip_frac"] == 1.0
    # a data-parallel shard divides by the whole batch's tokens
    half, _ = grpo_loss(logp[:1], behaviour[:1], adv[:1], mask[:1], 0.2, total_tokens=2.0)
    assert float(half.detach()) == pytest.approx(-1.2 / 2)  # min(2 * 1, 1.2 * 1) / 2 tokens
    with pytest.raises(ValueError, match="less than"):
        grpo_loss(logp, behaviour, adv, mask, 0.2, total_tokens=1.0)


def test_grpo_loss_errors() -> None:
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="one shape"):
        grpo_loss(z, torch.zeros(2, 4), torch.zeros(2), z.bool(), 0.2)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(z, z, torch.zeros(3), z.bool(), 0.2)
    with pytest.raises(ValueError, match="no completion tokens"):
        grpo_loss(z, z, torch.zeros(2), z.bool(), 0.2)


# --- the reference run -----------------------------------------------------------------------


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="group_size"):
        TrainConfig(group_size=1)
    with pytest.raises(ValueError, match=">= 1"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="entropy_coef must be >= 0"):
        TrainConfig(entropy_coef=-0.1)


def test_same_seed_same_history() -> None:
    cfg = dataclasses.replace(SMALL_CONFIG, steps=4, prompts_per_step=8, eval_every=2, eval_size=32)
    a, b = train(cfg), train(cfg)
    c = train(dataclasses.replace(cfg, seed=1))

    def trace(h: History) -> list[tuple[float, ...]]:
        return [(s.mean_reward, s.loss, s.entropy) for s in h.steps]

    assert trace(a) == trace(b)
    assert [e.accuracy for e in a.evals] == [e.accuracy for e in b.evals]
    assert [e.step for e in a.evals] == [0, 2, 4]
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert trace(a) != trace(c)
