"""Calibrating the RL job's role costs (:class:`~._rlroles.RLCosts`) on the real roles, in this
process, on the job's own requests.

:func:`calibrate_rl` builds what the job spawns for a TinyLM run (``orchestr.roles.rl``'s
digit tasks: the generators' recompute engine and the :class:`~orchestr.roles.Trainer` and
:class:`~orchestr.roles.Reward` actors' classes, called directly, not as actors), on one
torch thread as the job runs each role, and times:

- **generation**: the engine on the first ``steps`` batches' requests, each batch whole and
  then its first half, quarter and eighth (the sizes a generator gets in the sync and stream
  schedules), every step timed with the shape it ran (``b`` sequences padded to ``t``
  tokens), fitted as a :class:`~._generation.StepTimeModel` of the recompute engine's
  features (:func:`~._generation.recompute_features`);
- **training**: ``Trainer.train_step`` on each batch's completions, scored by the task, and on
  its first half, ``repeats`` times each (the median): ``train_step_s`` + ``train_token_s`` per
  token, by least squares;
- **scoring**: ``Reward.score`` of each batch, per sample; the **evaluation**:
  ``Trainer.greedy`` on the held-out prompts, once; **publishing**: ``Trainer.publish`` after
  each trained batch but the first (which allocates the buckets), the median;
- **loading**: copying the trainer's weights into the generator's model (``load_state_dict``),
  the median of 5: what a load on one host does (the live load borrows the publisher's
  buckets and checksums them across processes; that difference is not measured).

What is not timed: the actor calls, their serialisation and the controller between them.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import platform
import statistics
import time
from typing import Any

from ._calibrate import fit_step_model
from ._generation import attention_pairs
from ._rlroles import RLCosts

__all__ = ["calibrate_rl", "fit_line"]


def calibrate_rl(
    train: Any,
    *,
    trainers: int = 1,
    steps: int = 2,
    fractions: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125),
    max_batch: int = 512,
    repeats: int = 3,
    torch_threads: int | None = 1,
) -> tuple[RLCosts, dict[str, Any]]:
    """Time the roles of a GRPO run of ``train`` (a :class:`~orchestr.roles.rl.TrainConfig`
    of a TinyLM) with ``trainers`` (see the module docstring). Returns the
    costs and a report: every timed sample, the step-time fit's errors, and the machine.
    Raises ``ValueError`` for a checkpoint model (its engine is calibrated by
    :func:`~._calibrate.calibrate`) or bad counts."""
    import torch

    from orchestr.roles import TinyLMConfig

    if not isinstance(train.model, TinyLMConfig):
        raise ValueError(
            "calibrate_rl times a TinyLM run; calibrate a checkpoint's engine with calibrate()"
        )
    if min(trainers, steps, repeats) < 1 or not fractions or not all(0 < f <= 1 for f in fractions):
        raise ValueError("trainers, steps and repeats are >= 1; fractions are in (0, 1]")
    threads = torch.get_num_threads()
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    try:
        return _calibrate(train, trainers, steps, fractions, max_batch, repeats)
    finally:
        torch.set_num_threads(threads)  # this process's own again


def _calibrate(
    train: Any,
    trainers: int,
    steps: int,
    fractions: tuple[float, ...],
    max_batch: int,
    repeats: int,
) -> tuple[RLCosts, dict[str, Any]]:
    import torch

    from orchestr.roles import Reward, Trainer
    from orchestr.roles.generator import RecomputeEngine
    from orchestr.roles.rl import reverse_task, step_requests

    trainer = Trainer(
        model_kwargs=dataclasses.asdict(train.model),
        seed=train.seed,
        lr=train.lr,
        betas=train.betas,
        weight_decay=train.weight_decay,
        update=dataclasses.asdict(train.update),
        pad_id=reverse_task.PAD,
        eos_id=reverse_task.EOS,
        lr_schedule=train.lr_schedule,
        lr_steps=train.steps,
        min_lr_ratio=train.min_lr_ratio,
    )
    model = copy.deepcopy(trainer.model)
    shapes: list[tuple[int, ...]] = []
    model.register_forward_pre_hook(lambda _m, args: shapes.append(tuple(args[0].shape)))
    cfg: Any = model.cfg  # a TinyLM's
    engine = RecomputeEngine(
        model, max_batch=max_batch, seed=train.seed, pad_id=cfg.pad_id, vocab_size=cfg.vocab_size
    )
    reward = Reward(train.task.scorer)
    group = train.group_size
    step_samples: list[tuple[int, int, int, int, float]] = []
    train_samples: list[tuple[int, float]] = []
    score_s: list[float] = []
    publish_s: list[float] = []
    runs = iter(range(1 << 30))

    def generate(requests: list[Any]) -> list[Any]:
        run = next(runs)  # ids are the engine's to keep unique
        engine.submit(dataclasses.replace(r, id=f"{run}:{r.id}") for r in requests)
        done = []
        while engine.has_work():
            shapes.clear()
            began = time.perf_counter()
            done += engine.step()
            seconds = time.perf_counter() - began
            b, t = shapes[-1][:2]
            step_samples.append((b * t, b, b * attention_pairs(0, t), 0, seconds))
        order = {f"{run}:{r.id}": i for i, r in enumerate(requests)}
        return sorted(done, key=lambda c: order[c.id])

    with torch.inference_mode():
        generate(step_requests(train, 0)[: group * 2])  # warm-up
    step_samples.clear()
    for s in range(steps):
        requests = step_requests(train, s)
        whole: list[Any] = []
        for f in fractions:
            n = max(group, round(len(requests) * f / group) * group)
            with torch.inference_mode():
                done = generate(requests[:n])
            if n == len(requests):
                whole = done
        if not whole:
            with torch.inference_mode():
                whole = generate(requests)
        pairs = [[list(c.prompt[1:-1]), c.tokens] for c in whole]
        began = time.perf_counter()
        rewards = reward.score(pairs)
        score_s.append((time.perf_counter() - began) / len(pairs))
        scored = list(zip(whole, rewards, strict=True))
        shard = scored[: len(scored) // trainers]
        for part in (shard, shard[: max(group, len(shard) // 2 // group * group)]):
            tokens = sum(len(c.prompt) + len(c.tokens) for c, _ in part)
            took = []
            for _ in range(repeats):  # the median: one step in a few runs 50% over
                took.append(float(trainer.train_step(part, group, train.advantage_scale)["busy_s"]))
                began = time.perf_counter()
                trainer.publish()
                publish_s.append(time.perf_counter() - began)
            train_samples.append((tokens, statistics.median(took)))
    loads = []
    for _ in range(5):
        began = time.perf_counter()
        engine.model.load_state_dict(trainer.model.state_dict())
        loads.append(time.perf_counter() - began)
    held_out = reverse_task.eval_prompts(train.eval_size, train.lengths)
    began = time.perf_counter()
    trainer.greedy(
        [train.task.encode_prompt(p) for p in held_out],
        [reverse_task.max_new_tokens(p) for p in held_out],
    )
    eval_s = time.perf_counter() - began

    machine = f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cpus, torch threads "
    machine += f"{torch.get_num_threads()})"
    generation = fit_step_model(step_samples, machine)
    step_s, token_s = fit_line(train_samples)
    costs = RLCosts(
        generation=generation,
        weight_bytes=sum(p.numel() * p.element_size() for p in trainer.model.parameters()),
        train_token_s=token_s,
        train_step_s=step_s,
        load_s=statistics.median(loads),
        score_s=statistics.median(score_s),
        eval_s=eval_s,
        publish_s=statistics.median(publish_s[1:] or publish_s),
        reward_p=0.5,
        num_blocks=1 << 20,
        token_budget=1 << 20,
        engine="recompute",
    )
    errors = [generation.seconds(*x[:-1]) / x[-1] - 1 for x in step_samples]
    report = {
        "machine": machine,
        "generation_steps": [list(x) for x in step_samples],
        "generation_errors": [round(e, 4) for e in errors],
        "generation_median_abs_error": round(statistics.median(abs(e) for e in errors), 4),
        "train_steps": [list(x) for x in train_samples],
        "publish_s": publish_s,
        "load_s": loads,
    }
    return costs, report


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(a, b)`` of ``seconds = a + b * tokens`` by least squares, neither below 0."""
    xs, ys = [float(x) for x, _ in points], [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    if b <= 0:
        return my, 0.0
    a = my - b * mx
    if a < 0:  # through the origin
        return 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    return a, b
