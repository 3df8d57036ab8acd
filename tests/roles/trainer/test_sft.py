"""Supervised fine-tuning on the trainer: the loss by hand, response-only masking, steps that
learn, micro-batches equal to one pass, and a data-parallel pair equal to one trainer."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

import orchestr as oc
from orchestr.roles.trainer import UpdateConfig, sft_loss, sft_update
from orchestr.roles.trainer._actor import Trainer, build_model
from orchestr.roles.trainer._micro import plan_micro_batches
from orchestr.roles.trainer._sft import sft_batch
from tests.roles.trainer.batches import SMALL

PAD = 13  # the TinyLM's padding token

#: Prompts of three lengths (begin, digits, separator: the TinyLM counts positions from the
#: separator), responses of four (ending with the end token).
SAMPLES = [
    {"prompt": [10, 1, 2, 3, 11], "tokens": [3, 2, 1, 12]},
    {"prompt": [10, 4, 11], "tokens": [4, 12]},
    {"prompt": [10, 5, 6, 11], "tokens": [6, 5, 12]},
    {"prompt": [10, 7, 11], "tokens": [7, 7, 7, 7, 12]},
    {"prompt": [10, 8, 9, 0, 11], "tokens": [0, 9, 8, 12]},
    {"prompt": [10, 1, 1, 11], "tokens": [1, 12]},
]


def test_the_loss_by_hand() -> None:
    # Two rows over a vocabulary of two. Logits [0, 0] give p = (1/2, 1/2); [ln 3, 0] give
    # p = (3/4, 1/4). Row 0's targets are 0 under [0, 0] and 0 under [ln 3, 0]: log-probs
    # ln(1/2), ln(3/4). Row 1's first target is 1 under [ln 3, 0]: ln(1/4); its second column
    # is padding (outside the mask). The token-mean NLL over the 3 response tokens is
    # (ln 2 + ln(4/3) + ln 4) / 3 = ln(32/3) / 3 = 0.78904...; divided by a whole batch of 6
    # tokens instead (a shard's share in data parallel) it is ln(32/3) / 6.
    logits = torch.tensor(
        [[[0.0, 0.0], [math.log(3), 0.0]], [[math.log(3), 0.0], [5.0, -5.0]]],
        requires_grad=True,
    )
    targets = torch.tensor([[0, 0], [1, 0]])
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    mask = torch.tensor([[True, True], [True, False]])
    loss = sft_loss(logp, mask)
    assert loss.item() == pytest.approx(math.log(32 / 3) / 3, abs=1e-6)
    assert loss.item() == pytest.approx(0.78904, abs=1e-5)
    assert sft_loss(logp, mask, total_tokens=6).item() == pytest.approx(math.log(32 / 3) / 6)
    loss.backward()  # type: ignore[no-untyped-call]
    assert logits.grad is not None
    # the padded column's logits get no gradient
    assert torch.equal(logits.grad[1, 1], torch.zeros(2))
    # d(-ln softmax_0)/d logit_0 = -(1 - p_0), over 3 tokens: for [0, 0], -(1/2) / 3
    assert float(logits.grad[0, 0, 0]) == pytest.approx(-0.5 / 3, abs=1e-6)


def test_only_the_masked_columns_count() -> None:
    logp = -torch.rand(3, 4) - 0.1
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    before = float(sft_loss(logp, mask))
    outside = logp.clone().requires_grad_(True)
    with torch.no_grad():
        outside[~mask] = torch.tensor(-math.inf)  # a target the model calls impossible
    loss = sft_loss(outside, mask)
    assert loss.item() == pytest.approx(before)
    loss.backward()  # type: ignore[no-untyped-call]
    assert outside.grad is not None
    assert torch.equal(outside.grad[~mask], torch.zeros(int((~mask).sum())))
    with pytest.raises(ValueError, match="differ in shape"):
        sft_loss(logp, mask[:, :2])
    with pytest.raises(ValueError, match="at least one response token"):
        sft_loss(logp, torch.zeros_like(mask))


def test_the_trainers_loss_is_the_responses_alone() -> None:
    """``Trainer.sft_loss`` is the mean NLL of the response tokens, each given everything
    before it, computed here from the model's logits over each whole sequence; the prompt's
    own tokens are no targets (counting them gives another number)."""
    trainer = Trainer(model_kwargs=SMALL, seed=3)
    model = trainer.model
    response_nll, all_nll, response_n, all_n = 0.0, 0.0, 0, 0
    with torch.no_grad():
        for s in SAMPLES:
            seq = torch.tensor([s["prompt"] + s["tokens"]])
            logp = torch.log_softmax(model(seq)[0, :-1].float(), -1)
            nll = -logp.gather(-1, seq[0, 1:, None]).squeeze(-1)  # target t + 1 at row t
            response_nll += float(nll[len(s["prompt"]) - 1 :].sum())
            response_n += len(s["tokens"])
            all_nll, all_n = all_nll + float(nll.sum()), all_n + len(nll)
    out = trainer.sft_loss(SAMPLES)
    assert out["tokens"] == response_n
    assert out["loss"] == pytest.approx(response_nll / response_n, abs=1e-5)
    assert abs(out["loss"] - all_nll / all_n) > 1e-3
    # the prompt's tokens change the conditioning, not the targets: a row with another
    # prompt is scored on its response's tokens still
    other = [{"prompt": [10, 9, 9, 9, 11], "tokens": s["tokens"]} for s in SAMPLES]
    assert trainer.sft_loss(other)["tokens"] == response_n


def test_steps_lower_the_loss_on_the_same_rows() -> None:
    for dtype in ("float32", "bfloat16"):
        trainer = Trainer(model_kwargs=SMALL, seed=3, lr=1e-2, warmup_steps=2, dtype=dtype)
        before = trainer.sft_loss(SAMPLES)["loss"]
        stats = [trainer.sft_step(SAMPLES) for _ in range(8)]
        after = trainer.sft_loss(SAMPLES)["loss"]
        assert after < 0.6 * before, dtype
        assert [s["version"] for s in stats] == list(range(1, 9)) and trainer.version == 8
        assert [s["lr"] for s in stats[:3]] == pytest.approx([5e-3, 1e-2, 1e-2])
        # a step's loss is the batch's under the weights before it
        assert stats[0]["loss"] == pytest.approx(before, rel=0.02 if dtype != "float32" else 1e-5)
        assert stats[0]["tokens"] == sum(len(s["tokens"]) for s in SAMPLES)
        assert {"loss", "tokens", "grad_norm", "lr", "version", "busy_s"} <= set(stats[0])
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


def test_a_malformed_batch_is_refused_and_changes_nothing() -> None:
    trainer = Trainer(model_kwargs=SMALL, seed=3)
    before = trainer.digest()["digest"]
    bad: list[object] = [
        [],
        [{"prompt": [1, 2]}],
        [{"prompt": [], "tokens": [3]}],
        [{"prompt": [1], "tokens": ["3"]}],
    ]
    for batch in bad:
        with pytest.raises(ValueError):
            trainer.sft_step(batch)
    assert trainer.version == 0 and trainer.digest()["digest"] == before


def test_micro_batches_equal_one_pass() -> None:
    gen = sft_batch(SAMPLES, PAD)
    bound = 2 * gen.tokens.shape[1]
    plan = plan_micro_batches(gen.prompt_lengths.tolist(), gen.lengths.tolist(), bound)
    assert 1 < len(plan) < len(SAMPLES)
    out = []
    for micro in (None, bound):
        model = build_model("orchestr.roles:TinyLM", SMALL, seed=3)
        # SGD: the step is the gradient itself (Adam's would hide its size)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        config = UpdateConfig(micro_batch_tokens=micro, max_grad_norm=100.0)
        out.append((model, [sft_update(model, opt, gen, config) for _ in range(2)]))
    (whole, one), (parts, split) = out
    for a, b in zip(whole.parameters(), parts.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    for x, y in zip(one, split, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            assert y[key] == pytest.approx(x[key], rel=1e-5), key
    assert one[1]["loss"] < one[0]["loss"]


@pytest.mark.timeout(90)
async def test_a_data_parallel_pair_takes_the_single_trainers_steps(ctx: oc.JobContext) -> None:
    kwargs = {"model_kwargs": SMALL, "seed": 3, "lr": 1e-2}
    pair = await ctx.spawn(Trainer, n=2, resources={"cpu": 0.5}, torch_threads=1, **kwargs)
    single = Trainer(**kwargs)  # in this process: the same steps on the whole batch
    await ctx.init_distributed(pair)
    for _ in range(2):
        # unequal shares: the mean is the whole batch's tokens', not each member's
        stats = await asyncio.gather(
            pair[0].sft_step.call_one(SAMPLES[:2]), pair[1].sft_step.call_one(SAMPLES[2:])
        )
        alone = single.sft_step(SAMPLES)
        for key in ("loss", "tokens", "grad_norm"):
            assert stats[0][key] == stats[1][key] == pytest.approx(alone[key], rel=1e-5), key
    digests = await pair.digest.call()
    assert digests[0]["digest"] == digests[1]["digest"]
    dp = await pair[0].sft_loss.call_one(SAMPLES)
    assert dp["loss"] == pytest.approx(single.sft_loss(SAMPLES)["loss"], rel=1e-5)
