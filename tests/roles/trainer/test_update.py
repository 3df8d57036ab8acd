"""The update's options on a tiny model, in this process: micro-batches equal one pass, the
overlong filter equals leaving the samples out, the KL penalty's statistic, bfloat16 autocast,
activation checkpointing, and the Trainer's new settings."""

from __future__ import annotations

import copy
import dataclasses
import pathlib
from typing import Any

import pytest
import torch

import orchestr as oc
from orchestr.roles import models
from orchestr.roles._common._rollout import Generation, completion_logprobs, pack
from orchestr.roles.rl import _task
from orchestr.roles.trainer import UpdateConfig, group_advantages, grpo_update
from orchestr.roles.trainer._activations import checkpoint_layers
from orchestr.roles.trainer._actor import Trainer, build_model
from orchestr.roles.trainer._micro import plan_micro_batches
from tests.roles.trainer.batches import SMALL, as_dicts, samples


def _batch(step: int = 0) -> tuple[Generation, torch.Tensor]:
    batch = samples(step)
    gen = pack(
        [c.prompt for c, _ in batch],
        [c.tokens for c, _ in batch],
        [c.sample_logprobs for c, _ in batch],
        pad_id=_task.PAD,
    )
    return gen, group_advantages(torch.tensor([r for _, r in batch]), 2)


def _train(
    gen: Generation, adv: torch.Tensor, config: UpdateConfig, sgd: bool = False, **kwargs: Any
) -> tuple[torch.nn.Module, dict[str, float]]:
    model = build_model("orchestr.roles:TinyLM", SMALL, seed=3)
    params = model.parameters()
    # Adam scales each step by the gradient's own size, so float rounding in a near-zero
    # gradient shows as a full step: SGD compares the gradients themselves
    opt = torch.optim.SGD(params, lr=0.5) if sgd else torch.optim.AdamW(params, lr=1e-2)
    return model, grpo_update(model, opt, gen, adv, config, **kwargs)


def _shifted_ref(gen: Generation, shift: float) -> torch.Tensor:
    """The seed-3 model's own log-probs of ``gen`` minus ``shift`` (0 past each row's end)."""
    with torch.no_grad():
        logp, _ = completion_logprobs(build_model("orchestr.roles:TinyLM", SMALL, seed=3), gen)
    return torch.where(gen.mask, logp - shift, 0.0)


def test_micro_batches_equal_one_pass() -> None:
    gen, adv = _batch()
    ref = _shifted_ref(gen, 0.2)
    options = {"updates": 2, "loss_agg": "seq_mean_token_mean", "kl_coef": 0.1}
    whole, one = _train(gen, adv, UpdateConfig(**options), sgd=True, ref_logprobs=ref)
    width = gen.tokens.shape[1]
    bound = UpdateConfig(**options, micro_batch_tokens=2 * width)
    micro, parts = _train(gen, adv, bound, sgd=True, ref_logprobs=ref)
    plan = plan_micro_batches(gen.prompt_lengths.tolist(), gen.lengths.tolist(), 2 * width)
    assert 1 < len(plan) < len(adv)  # parts of one and of two samples
    for a, b in zip(whole.parameters(), micro.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert one.keys() == parts.keys()
    for key in one:
        assert parts[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key


def test_overlong_filter_leaves_the_truncated_samples_out() -> None:
    gen, adv = _batch()
    cut = torch.zeros(len(adv), dtype=torch.bool)
    cut[[1, 4]] = True
    config = UpdateConfig(updates=1, overlong_filter=True)
    filtered, stats = _train(gen, adv, config, truncated=cut)
    keep = (~cut).nonzero().squeeze(1)
    sub = dataclasses.replace(
        gen,
        tokens=gen.tokens[keep],
        prompt_lengths=gen.prompt_lengths[keep],
        lengths=gen.lengths[keep],
        logprobs=gen.logprobs[keep],
    )
    alone, expected = _train(sub, adv[keep], dataclasses.replace(config, overlong_filter=False))
    for a, b in zip(filtered.parameters(), alone.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert stats["tokens"] == expected["tokens"] == float(gen.lengths[keep].sum())
    assert stats["loss"] == pytest.approx(expected["loss"], abs=1e-7)
    assert stats["overlong_filtered"] == 2.0
    # off, the same flags change nothing
    _, unfiltered = _train(
        gen, adv, dataclasses.replace(config, overlong_filter=False), truncated=cut
    )
    assert (
        unfiltered["tokens"] == float(gen.lengths.sum()) and "overlong_filtered" not in unfiltered
    )


def test_kl_penalty_statistic_and_its_reference_log_probs() -> None:
    gen, adv = _batch()
    # the reference is 0.5 below the policy at every token: d = ref - logp = -0.5, so
    # k3 = e^-0.5 + 0.5 - 1 = 0.1065307, k1 = 0.5, k2 = 0.125 (one update: measured before it)
    ref = _shifted_ref(gen, 0.5)
    for estimator, expected in [("k3", 0.1065307), ("k1", 0.5), ("k2", 0.125)]:
        config = UpdateConfig(updates=1, kl_coef=0.5, kl_estimator=estimator)
        _, stats = _train(gen, adv, config, ref_logprobs=ref)
        assert stats["kl"] == pytest.approx(expected, abs=1e-5), estimator
    _, stats = _train(gen, adv, UpdateConfig(updates=1))
    assert "kl" not in stats
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logprobs"):
        _train(gen, adv, UpdateConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="ref_logprobs .* must have the shape"):
        _train(gen, adv, UpdateConfig(kl_coef=0.1), ref_logprobs=ref[:, :-1])


def test_trainer_takes_ref_logprobs_and_finish_reasons_from_samples() -> None:
    batch = samples(0)
    update = {"updates": 1, "kl_coef": 0.1, "overlong_filter": True, "advantage": "reinforce_pp"}
    trainer = Trainer(model_kwargs=SMALL, seed=3, update=update)
    dicts = as_dicts(batch, ref_shift=0.5)
    for i, d in enumerate(dicts):  # an untrained policy's completions mostly hit their limit
        d["finish_reason"] = "length" if i == 0 else "stop"
    stats = trainer.train_step(dicts, 2)
    # on-policy (the sampler's weights), so the reference is 0.5 below: k3 = 0.1065307
    assert stats["kl"] == pytest.approx(0.1065307, abs=1e-5)
    assert stats["overlong_filtered"] == 1.0
    assert stats["tokens"] == sum(len(c.tokens) for c, _ in batch[1:])
    del dicts[3]["ref_logprobs"]
    with pytest.raises(ValueError, match="needs ref_logprobs on every sample.*sample 3 has none"):
        trainer.train_step(dicts, 2)
    dicts[3]["ref_logprobs"] = [0.0] * (len(dicts[3]["tokens"]) + 1)
    with pytest.raises(ValueError, match="ref_logprobs; give one reference log-prob per"):
        trainer.train_step(dicts, 2)
    assert trainer.version == 1  # neither touched the model


def test_trainer_settings() -> None:
    schedule = {"lr_schedule": "linear", "lr_steps": 4, "min_lr_ratio": 0.5}
    trainer = Trainer(model_kwargs=SMALL, seed=3, lr=1e-3, warmup_steps=2, **schedule)
    # 1e-3 * 1/2, 1e-3 * 2/2, then down from 1e-3 to 5e-4 over 2 versions
    rates = [trainer.train_step(samples(s), 2)["lr"] for s in range(4)]
    assert rates == pytest.approx([5e-4, 1e-3, 1e-3, 7.5e-4])
    for bad, message in [
        ({"dtype": "float16"}, "dtype must be one of float32, bfloat16"),
        ({"activation_checkpointing": "yes"}, "activation_checkpointing must be True or False"),
        ({"warmup_steps": 4, "lr_schedule": "cosine", "lr_steps": 4}, "warmup must be >= 0"),
        ({"update": {"advantage": "ppo"}}, "advantage must be one of grpo"),
        ({"update": {"micro_batch_tokens": 0}}, "micro_batch_tokens must be an int >= 1"),
    ]:
        with pytest.raises(oc.ConfigError, match=message):
            Trainer(model_kwargs=SMALL, **bad)


def test_bfloat16_autocast_learns_the_right_way() -> None:
    batch = samples(0)
    completions = [c for c, _ in batch]
    adv = group_advantages(torch.tensor([r for _, r in batch]), 2)
    gaps = {}
    for dtype in ("float32", "bfloat16"):
        trainer = Trainer(model_kwargs=SMALL, seed=3, lr=1e-2, dtype=dtype)
        before = trainer.completion_logprobs(completions)
        stats = trainer.train_step(batch, 2)
        after = trainer.completion_logprobs(completions)
        gaps[dtype] = stats["logprob_gap"]
        # the samples the advantage favours became likelier, the others less likely
        moved = [sum(b) - sum(a) for a, b in zip(before, after, strict=True)]
        assert sum(a * m for a, m in zip(adv.tolist(), moved, strict=True)) > 0, dtype
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
        assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values())
    # the bfloat16 forward is visibly coarser than the sampler's float32 one
    assert gaps["bfloat16"] > 10 * gaps["float32"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("m") / "llama"
    return pathlib.Path(models.make_tiny("llama", folder, layers=2, tokenizer="digits"))


def test_activation_checkpointing_keeps_the_gradients(tiny_llama: pathlib.Path) -> None:
    plain = models.load_model(tiny_llama)
    wrapped = copy.deepcopy(plain)
    assert checkpoint_layers(wrapped) == 2 and checkpoint_layers(wrapped) == 2  # idempotent
    calls = [0]
    for layer in wrapped.model.layers:
        assert isinstance(layer, models.DecoderLayer)
        layer.self_attn.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    gen = pack([[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [3]], [[0.0] * 4, [0.0]], pad_id=0)
    weights = torch.tensor([[1.0, -2.0, 0.5, 1.5], [3.0, 0.0, 0.0, 0.0]])
    for model in (plain, wrapped):
        logp, entropy = completion_logprobs(model, gen)
        ((logp * weights).sum() + entropy.sum()).backward()  # type: ignore[no-untyped-call]
    # two prompt lengths, so two forward passes; each layer's attention ran once more in the
    # backward pass of each, recomputing what was not kept
    assert calls[0] == 2 * 2 * 2
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    calls[0] = 0
    with torch.no_grad():  # no recomputation where nothing is recorded
        completion_logprobs(wrapped, gen)
    assert calls[0] == 2 * 2


def test_trainer_with_activation_checkpointing_trains_alike(tiny_llama: pathlib.Path) -> None:
    batch = [
        {
            "prompt": [1, 2, 3],
            "tokens": t,
            "sample_logprobs": [-1.0] * len(t),
            "version": 0,
            "reward": r,
        }
        for t, r in [([4, 5, 6], 1.0), ([7, 8], 0.0), ([4, 4, 4, 4], 0.0), ([5], 1.0)]
    ]
    kwargs = {"model_kwargs": {"folder": str(tiny_llama)}, "update": {"updates": 2}}
    trainers = [
        Trainer(models.__name__ + ":load_model", activation_checkpointing=on, **kwargs)
        for on in (False, True)
    ]
    stats = [t.train_step(batch, 2) for t in trainers]
    assert stats[0]["loss"] == pytest.approx(stats[1]["loss"], abs=1e-6)
    for a, b in zip(trainers[0].model.parameters(), trainers[1].model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
