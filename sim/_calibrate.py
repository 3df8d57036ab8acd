"""Calibrating a step-time model on the real engine: time the paged engine's steps on a
checkpoint, on this machine, and fit :class:`~._generation.StepTimeModel` to them.

Two kinds of step are timed, each of known composition:

- **prefill**: one request of ``p`` prompt tokens and one output token: one step of ``p``
  tokens, one sequence, ``p (p + 1) / 2`` attention pairs;
- **decode**: ``b`` requests of ``c`` prompt tokens (prefilled together in one step, which is
  timed too), then ``k`` steps of ``b`` tokens and sequences over ``b * (c + i)`` pairs (the
  first of them right after a prefill);
- **mixed**: such a decode run into which, after its third decode step, one request of ``p``
  prompt tokens and one output token arrives: one step computes its ``p`` tokens beside the
  ``b`` decodes, and the next decodes right after a prefill again.

One engine serves every run (so the weights are packed once, as in serving; each run's
prompts differ from every other's, so nothing is a prefix hit); a first run warms it up, and
each configuration is then timed (the median of ``repeats`` runs per step). The fit is least squares over all the steps (:func:`fit_step_model`);
the relative error of each step is reported beside it.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any

from ._generation import TERMS, StepTimeModel, attention_pairs

__all__ = ["calibrate", "fit_step_model"]


def calibrate(
    checkpoint: str,
    *,
    prefills: Sequence[int] = (32, 128, 512),
    decodes: Sequence[tuple[int, int]] = (
        (1, 64),
        (8, 64),
        (8, 256),
        (16, 128),
        (32, 32),
        (32, 64),
    ),
    mixes: Sequence[tuple[int, int, int]] = ((2, 256, 384), (4, 128, 256), (8, 64, 512)),
    decode_steps: int = 16,
    repeats: int = 3,
    token_budget: int = 2048,
    torch_threads: int | None = None,
) -> tuple[StepTimeModel, dict[str, Any]]:
    """Time the paged engine on ``checkpoint`` (a model folder) and fit a step-time model.
    ``prefills``: prompt lengths of the prefill steps; ``decodes``: ``(batch, context)`` of the
    decode runs (``batch * context`` at most ``token_budget``, so the prefill is one step);
    ``mixes``: ``(batch, context, prompt)`` of the mixed runs (``batch + prompt`` at most the
    budget too).
    Returns the model and a report: the samples, each one's relative error, the median and
    largest, the machine and the model's shape. Raises ``ValueError`` for a decode or mixed run
    that does not fit the budget, or mixed runs with fewer than 5 decode steps."""
    import torch

    from orchestr.roles import PagedEngine, Request, models

    for b, c in decodes:
        if b * c > token_budget:
            raise ValueError(f"decode run {b} x {c} tokens exceeds the step budget {token_budget}")
    if mixes and decode_steps < 5:
        raise ValueError(
            f"mixed runs need decode_steps >= 5 (a prompt joins after 3), got {decode_steps}"
        )
    for b, c, p in mixes:
        if b * c > token_budget or b + p > token_budget:
            raise ValueError(
                f"mixed run {b} x {c} then {p} tokens exceeds the step budget {token_budget}"
            )
    for p in prefills:
        if p > token_budget:
            raise ValueError(f"a prefill of {p} tokens exceeds the step budget {token_budget}")
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    model = models.load_model(checkpoint)
    vocab = model.config.vocab_size
    # runs are one after another on one engine: the pool holds the largest run twice over
    # (what the last runs left cached is evicted as needed)
    run_blocks = [-(-(p + 1) // 16) for p in prefills]
    run_blocks += [b * -(-(c + decode_steps + 1) // 16) for b, c in decodes]
    engine = PagedEngine(
        model,
        num_blocks=max(256, 2 * max(run_blocks)),
        block_size=16,
        max_batch=max(b for b, _ in decodes),
        token_budget=token_budget,
    )
    salts = iter(range(1, 1 << 30))

    def prompt(n: int) -> list[int]:
        salt = next(salts)  # every prompt its own: no prefix hits between runs
        return [(salt * 7919 + 31 * i * (salt % 97 + 1)) % (vocab - 5) + 5 for i in range(n)]

    def timed_steps(requests: list[Any], then: tuple[int, list[Any]] = (-1, [])) -> list[float]:
        """Each step's seconds; ``then``: requests submitted after that many steps."""
        engine.submit(requests)
        out: list[float] = []
        while engine.has_work():
            if len(out) == then[0]:
                engine.submit(then[1])
            began = time.perf_counter()
            engine.step()
            out.append(time.perf_counter() - began)
        return out

    # (prefill tokens, decodes, prefill pairs, decode pairs, mixed, after a prefill, seconds)
    samples: list[tuple[int, int, int, int, int, int, float]] = []
    ids = iter(range(1 << 30))

    def requests(b: int, c: int, out: int) -> list[Any]:
        return [Request(f"c{next(ids)}", prompt(c), out, ignore_eos=True) for _ in range(b)]

    with torch.inference_mode():
        b0, c0 = decodes[0]
        timed_steps(requests(b0, c0, decode_steps + 1))  # warm-up: weights packed, pools grown
        for p in prefills:
            runs = [timed_steps(requests(1, p, 1)) for _ in range(repeats)]
            seconds = statistics.median(r[0] for r in runs)
            samples.append((p, 0, attention_pairs(0, p), 0, 0, 0, seconds))
        runs_of = [(b, c, 0) for b, c in decodes] + list(mixes)
        for b, c, p in runs_of:
            runs = [
                timed_steps(
                    requests(b, c, decode_steps + 1), (4, requests(1, p, 1)) if p else (-1, [])
                )
                for _ in range(repeats)
            ]
            steps = min(len(x) for x in runs)
            for i in range(steps):
                seconds = statistics.median(x[i] for x in runs)
                if i == 0:
                    samples.append((b * c, 0, b * attention_pairs(0, c), 0, 0, 0, seconds))
                elif p and i == 4:  # the prompt that arrived, beside the decodes
                    pairs = attention_pairs(0, p)
                    samples.append((p, b, pairs, b * (c + i), 1, 0, seconds))
                else:
                    after = int(i == 1 or (p > 0 and i == 5))
                    samples.append((0, b, 0, b * (c + i), 0, after, seconds))
    machine = f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cpus, torch threads "
    machine += f"{torch.get_num_threads()})"
    fitted = fit_step_model(samples, machine)
    errors = [fitted.seconds(*x[:-1]) / x[-1] - 1 for x in samples]
    cfg = model.config
    report = {
        "samples": [list(x) for x in samples],
        "relative_errors": [round(e, 4) for e in errors],
        "median_abs_error": round(statistics.median(abs(e) for e in errors), 4),
        "max_abs_error": round(max(abs(e) for e in errors), 4),
        "machine": machine,
        "model": {
            "layers": cfg.num_hidden_layers,
            "hidden": cfg.hidden_size,
            "vocab": cfg.vocab_size,
            "parameters": sum(p.numel() for p in model.parameters()),
        },
    }
    return fitted, report


def fit_step_model(samples: Sequence[Sequence[float]], machine: str = "") -> StepTimeModel:
    """Least squares of the relative error over measured steps ``(prefill_tokens, decodes,
    prefill_pairs, decode_pairs[, mixed, after_prefill], seconds)`` (each step weighted by 1 /
    its time, so a 5 ms decode counts as much as a 300 ms prefill; in absolute terms the
    prefills decided the fit and the decodes came out 13-21% slow): coefficients that come out
    negative are dropped (held at 0) and the rest fitted again, and so are the terms no sample
    has (the mix terms without mixed runs; the decode terms for the recompute engine, whose
    steps are all whole sequences). Raises ``ValueError`` with fewer samples than coefficients, a step
    of no time, a sample of the wrong length, or samples that do not vary enough."""
    width = len(TERMS) - 1
    rows, ys = [], []
    for x in samples:
        if len(x) not in (5, width + 1):
            raise ValueError(f"a measured step is 4 or {width} features and seconds, got {x!r}")
        if not x[-1] > 0:
            raise ValueError("a measured step takes more than 0 seconds")
        feats = [*x[:-1], *[0] * (width + 1 - len(x))]
        rows.append([1.0 / x[-1], *(float(f) / x[-1] for f in feats)])
        ys.append(1.0)
    active = [i for i in range(len(TERMS)) if i == 0 or any(r[i] for r in rows)]
    while True:
        if len(rows) < len(active):
            raise ValueError(f"{len(rows)} measured steps cannot fit {len(active)} coefficients")
        coef = _least_squares([[r[i] for i in active] for r in rows], ys)
        negative = [i for i, c in zip(active, coef, strict=True) if c < 0]
        if not negative:
            break
        active = [i for i in active if i not in negative]
    values = dict.fromkeys(TERMS, 0.0)
    for i, c in zip(active, coef, strict=True):
        values[TERMS[i]] = c
    return StepTimeModel(**values, machine=machine or platform.node())


def _least_squares(x: list[list[float]], y: list[float]) -> list[float]:
    """Solve the normal equations (columns scaled to 1 first, for conditioning)."""
    k = len(x[0])
    scale = [max(abs(r[j]) for r in x) or 1.0 for j in range(k)]
    xs = [[r[j] / scale[j] for j in range(k)] for r in x]
    a = [[sum(r[i] * r[j] for r in xs) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * v for r, v in zip(xs, y, strict=True)) for i in range(k)]
    for col in range(k):  # Gaussian elimination with partial pivoting
        pivot = max(range(col, k), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) < 1e-12:
            raise ValueError("the measured steps do not vary enough to fit the step-time model")
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for i in range(col + 1, k):
            f = a[i][col] / a[col][col]
            for j in range(col, k):
                a[i][j] -= f * a[col][j]
            b[i] -= f * b[col]
    out = [0.0] * k
    for i in reversed(range(k)):
        out[i] = (b[i] - sum(a[i][j] * out[j] for j in range(i + 1, k))) / a[i][i]
    return [o / s for o, s in zip(out, scale, strict=True)]
