"""A pipeline-parallel model on actors: each schedule's gradients and updates equal the
single-process model's; bad inputs are refused with the reason."""

from __future__ import annotations

import pytest
import torch

import orchestr as oc
from orchestr.roles.pipeline import Pipeline, bubble_theory
from tests.roles.pipeline.stages import WIDTH, make_pair, make_stage

MODEL = "tests.roles.pipeline.stages:make_stage"


def reference(
    factory: object, stages: int, x: torch.Tensor, y: torch.Tensor, microbatches: int
) -> tuple[list[torch.nn.Module], list[float]]:
    """The same stages in one process, the batch's mean micro-batch loss backwarded."""
    modules = []
    for stage in range(stages):
        torch.manual_seed(stage)
        modules.append(factory(stage, stages))  # type: ignore[operator]
    losses = []
    total = torch.zeros(())
    for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
        h = xs
        for module in modules:
            h = module(h)
        loss = torch.nn.functional.mse_loss(h, ys)
        losses.append(float(loss.detach()))
        total = total + loss / microbatches
    total.backward()  # type: ignore[no-untyped-call]
    return modules, losses


def batch(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, 1, generator=g)


@pytest.mark.parametrize(
    ("schedule", "chunks"), [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)]
)
async def test_each_schedule_gives_the_single_process_gradients(
    ctx: oc.JobContext, schedule: str, chunks: int
) -> None:
    ranks, m = 2, 4
    pipe = await Pipeline.spawn(
        ctx,
        MODEL,
        schedule=schedule,
        ranks=ranks,
        microbatches=m,
        chunks=chunks,
        optimizer="torch.optim:SGD",
        optimizer_options={"lr": 0.1},
        threads=1,
    )
    x, y = batch()
    modules, losses = reference(make_stage, ranks * chunks, x, y, m)
    result = await pipe.step(x, y, update=False)
    assert result.losses == pytest.approx(losses, rel=1e-5)
    grads = await pipe.grads()
    assert sorted(grads) == list(range(ranks * chunks))
    for stage, module in enumerate(modules):
        named = dict(module.named_parameters())
        assert sorted(grads[stage]) == sorted(named)
        for name, p in named.items():
            assert p.grad is not None
            torch.testing.assert_close(grads[stage][name], p.grad, rtol=1e-5, atol=1e-6)
    # each rank ran every pass of its list once, and the timing adds up
    assert [len(t) for t in result.timelines] == [len(ops) for ops in pipe.schedule.ops]
    assert 0 <= result.bubble < 1 and result.makespan_s > 0
    assert bubble_theory(schedule, ranks, m, chunks) > 0

    # a step that updates: SGD on the same gradients gives the reference's weights
    await pipe.step(x, y, update=True)
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                assert p.grad is not None
                p.sub_(0.1 * p.grad)
    state = await pipe.state_dict()
    for stage, module in enumerate(modules):
        for name, value in module.state_dict().items():
            torch.testing.assert_close(state[stage][name], value, rtol=1e-5, atol=1e-6)


async def test_a_split_backward_falls_back_for_modules_that_return_tuples(
    ctx: oc.JobContext,
) -> None:
    pipe = await Pipeline.spawn(
        ctx, "tests.roles.pipeline.stages:make_pair", schedule="zb_h1", ranks=2, microbatches=2
    )
    x, y = batch(4)
    modules, losses = reference(make_pair, 2, x, y, 2)
    result = await pipe.step(list(x.chunk(2)), list(y.chunk(2)), update=False)
    assert result.losses == pytest.approx(losses, rel=1e-5)
    grads = await pipe.grads()
    for stage, module in enumerate(modules):
        for name, p in module.named_parameters():
            assert p.grad is not None
            torch.testing.assert_close(grads[stage][name], p.grad, rtol=1e-5, atol=1e-6)


async def test_a_rank_that_fails_fails_the_step_and_the_next_step_runs(
    ctx: oc.JobContext,
) -> None:
    pipe = await Pipeline.spawn(
        ctx, "tests.roles.pipeline.stages:make_guarded", schedule="1f1b", ranks=2, microbatches=4
    )
    x, y = batch()
    bad = x.clone()
    bad[0, 0] = float("nan")  # through rank 0, then refused by rank 1's first forward
    with pytest.raises(oc.ActorError, match="non-finite activation") as info:
        await pipe.step(bad, y)
    assert info.value.remote_type == "ValueError"  # the cause, not rank 0's abandoned wait
    result = await pipe.step(x, y, update=False)  # nobody is left waiting on the failed step
    assert len(result.losses) == 4 and all(loss == loss for loss in result.losses)


async def test_bad_inputs_are_refused(ctx: oc.JobContext) -> None:
    with pytest.raises(oc.ConfigError, match="pipeline schedule"):
        await Pipeline.spawn(ctx, MODEL, schedule="nope")
    pipe = await Pipeline.spawn(ctx, MODEL, schedule="1f1b", ranks=2, microbatches=2)
    x, y = batch(6)
    with pytest.raises(ValueError, match="does not split into 2"):
        await pipe.step(x[:5], y[:5])
    with pytest.raises(ValueError, match="expected a tensor or 2"):
        await pipe.step([x], [y])
    for args, message in [
        ((0, "weights", 1, 0, x), "activation or a gradient"),
        ((0, "activation", 0, 0, x), "does not run on rank 1"),
        ((0, "activation", 1, 9, x), "outside 0..1"),
        ((0, "activation", 1, 0, "x"), "is a tensor"),
    ]:
        with pytest.raises(oc.ActorError, match=message):
            await pipe.mesh[1].take.call_one(*args)
    # a refused item loses nothing: the pipeline still steps
    result = await pipe.step(x[:4], y[:4], update=False)
    assert len(result.losses) == 2
    with pytest.raises(oc.ActorError, match="not a torch nn.Module"):
        await Pipeline.spawn(ctx, "tests.roles.pipeline.stages:not_a_module", ranks=1)
