"""The RL simulator against the GRPO job on this machine: ``bench/rl_throughput.py``'s runs
(sync, stream, stream+skew on one embedded cluster) and ``orchestr.sim.simulate_grpo`` of the
same config, with the signed error of each metric beside the real runs' spread.

    python bench/sim_rl.py [--runs 5] [--demo] [--steps N] [--modes ...] [--save PATH]
                           [--no-call-path]

**Calibration** (before any real run, in this process, one torch thread):
``orchestr.sim._calibrate_rl.calibrate_rl`` times the roles' own code on the job's first two
batches (the recompute engine's steps, ``Trainer.train_step``, ``Reward.score``,
``Trainer.greedy``, ``Trainer.publish``, a weight copy) and gives the simulator's
:class:`~orchestr.sim.RLCosts`.

**The call path.** The roles' code does not hold what an actor call adds around it. Before the
workload, on the same cluster, the job's roles are spawned as the job spawns them and its calls
are made one at a time at idle (:func:`call_path`): ``generate``, ``score`` and ``train_step``
of two batch sizes, less the work each carried, fit ``call_s`` + ``call_item_s`` per item. The
trainer's own time for those steps in its process, a publish's round trip and the generators'
own load times replace the in-process estimates. The simulator charges them
(``--no-call-path``: the in-process calibration alone, for comparison).

**Real:** ``run_grpo(ctx, GRPOConfig(train=config, mode=m))`` on ``orchestr.run``'s embedded
cluster (two generators at nice 10, a trainer and a reward worker, each a quarter of a CPU and
one torch thread, as ``bench/rl_throughput.py`` runs them), ``--runs`` rounds of every mode,
alternating. ``config`` is ``SMALL_CONFIG`` (100 batches of 32 prompts x 8 samples, up to 8
digits); ``--demo`` the demo's (200 of 64 x 8, up to 16 digits). **Simulated:** the same
``GRPOConfig`` through ``simulate_grpo`` on one host of this machine's cores
(``host_cpus``: the roles' compute shares them, the generators at their nice), each sample
running to its request's length (``OutputLengths(requested=True)``, as the digit task's do).

Metrics, as the job reports them (``GRPOResult``): ``samples_per_s`` (trained samples over the
run, spawn and first sync excluded), ``generator_idle_frac`` and ``trainer_idle_frac``, and
``version_lag`` (the mean over batches of the samples' mean lag). ``error`` is sim / real
median - 1 for the rate and the lag, sim - real median for the idle fractions (points).

Prints a table and one JSON line ``{"costs": {...}, "calibration": {...}, "<mode>": {"real":
{...}, "sim": {...}, "error": {...}}, "_meta": {...}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import orchestr as oc
from orchestr._log import configure_logging
from orchestr.roles.rl import (
    DEMO_CONFIG,
    MODES,
    SMALL_CONFIG,
    GRPOConfig,
    GRPOResult,
    run_grpo,
    step_requests,
)  # fmt: skip
from orchestr.roles.rl._job import Job
from orchestr.sim import OutputLengths, RLCosts, one_host, simulate_grpo
from orchestr.sim._calibrate_rl import calibrate_rl, fit_line

#: Relative error for these; the idle fractions' is a difference.
RATES = ("samples_per_s", "version_lag")
METRICS = ("samples_per_s", "generator_idle_frac", "trainer_idle_frac", "version_lag")
RESOURCES = {"cpu": 0.25}  # what the job asks per member (GRPOConfig.cpu)
#: The costs the call-path probe measures, in place of the in-process calibration's.
PROBED = ("call_s", "call_item_s", "publish_s", "load_s", "train_step_s", "train_token_s")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def metrics(result: GRPOResult) -> dict[str, float]:
    lags = [s.version_lag for s in result.steps]
    return {
        "samples_per_s": result.steps[-1].samples_per_s,
        "generator_idle_frac": result.generator_idle_frac,
        "trainer_idle_frac": result.trainer_idle_frac,
        "version_lag": sum(lags) / len(lags),
    }


async def call_path(ctx: oc.JobContext, train: Any, costs: RLCosts) -> dict[str, Any]:
    """The job's calls at idle, on roles spawned as the job spawns them (its own ``Job``), beyond
    the work they carry: ``generate`` (minus the engine's busy time), ``score`` (minus the
    calibrated scoring) and ``train_step`` (minus its ``busy_s``) of a whole batch and of an
    eighth of one, three times each after a round of warm-up, their medians fitted as
    ``call_s`` + ``call_item_s`` per item; the trainer's own ``busy_s`` of those steps (the
    median at each size), fitted as ``train_step_s`` + ``train_token_s`` per token; a
    publish's round trip and the generators' own load times (medians)."""
    job = Job(ctx, GRPOConfig(train=train), None, None)
    await job.spawn()
    try:
        gen, trainer, group = job.gens[0], job.trainers[0], train.group_size
        requests = step_requests(train, 0)
        await job.sync_weights()  # the first load allocates the loaders' buffers
        calls: dict[tuple[str, int], list[float]] = {}  # (call, items): overheads
        steps: dict[int, list[float]] = {}  # tokens: the trainer's own time, in its process
        publishes: list[float] = []
        loads: list[float] = []
        sizes = (len(requests), max(group, len(requests) // 8 // group * group))
        for rep in range(4):  # the first a warm-up (a fresh trainer's first step: 1.5x)
            for n in sizes:
                part = [dataclasses.replace(r, id=f"probe{rep}-{n}/{r.id}") for r in requests[:n]]
                busy = (await gen.stats.call_one())["busy_s"]
                began = time.perf_counter()
                done = await gen.generate.call_one(part)
                seconds = time.perf_counter() - began
                took = [seconds - ((await gen.stats.call_one())["busy_s"] - busy)]
                pairs = [[list(c.prompt[1:-1]), c.tokens] for c in done]
                began = time.perf_counter()
                rewards = await job.rewards.score.choose(pairs)
                took.append(time.perf_counter() - began - costs.score_s * n)
                began = time.perf_counter()
                scored = list(zip(done, rewards, strict=True))
                stats = await trainer.train_step.call_one(scored, group, train.advantage_scale)
                took.append(time.perf_counter() - began - stats["busy_s"])
                tokens = sum(len(c.prompt) + len(c.tokens) for c in done)
                began = time.perf_counter()
                ref = await trainer.publish.call_one()
                published = time.perf_counter() - began
                reports = await asyncio.gather(
                    *(job.gens[i].sync_weights.call_one(ref) for i in range(len(job.gens)))
                )
                if rep == 0:
                    continue
                for kind, overhead in zip(("generate", "score", "train_step"), took, strict=True):
                    calls.setdefault((kind, n), []).append(overhead)
                steps.setdefault(tokens, []).append(stats["busy_s"])
                publishes.append(published)
                loads += [r["seconds"] for r in reports]
        calls_at = [(n, statistics.median(xs)) for (_, n), xs in calls.items()]
        steps_at = [(t, statistics.median(xs)) for t, xs in steps.items()]
        call_s, call_item_s = fit_line(calls_at)
        train_step_s, train_token_s = fit_line(steps_at)
        return {
            "call_s": call_s, "call_item_s": call_item_s, "publish_s": statistics.median(publishes),
            "load_s": statistics.median(loads), "train_step_s": train_step_s,
            "train_token_s": train_token_s, "calls": calls_at, "train_steps": steps_at,
        }  # fmt: skip
    finally:
        await job.stop()


def real_runs(
    train: Any, modes: list[str], runs: int, costs: RLCosts
) -> tuple[dict[str, Any], dict[str, list[dict[str, float]]]]:
    async def job(ctx: oc.JobContext) -> tuple[dict[str, Any], dict[str, list[dict[str, float]]]]:
        log("probing the job's calls at idle")
        probe = await call_path(ctx, train, costs)
        log(f"calls: {probe['call_s'] * 1e3:.2f} ms + {probe['call_item_s'] * 1e6:.1f} us an "
            f"item; publish {probe['publish_s'] * 1e3:.2f} ms, load {probe['load_s'] * 1e3:.2f} ms")  # fmt: skip
        out: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        for round_ in range(1, runs + 1):
            for mode in modes:
                result = await run_grpo(ctx, GRPOConfig(train=train, mode=mode))  # type: ignore[arg-type]
                out[mode].append(metrics(result))
                m = out[mode][-1]
                log(f"real {mode} (run {round_}/{runs}): {m['samples_per_s']:.0f} samples/s, "
                    f"{result.wall_s:.1f} s")  # fmt: skip
        return probe, out

    result: tuple[dict[str, Any], dict[str, list[dict[str, float]]]] = oc.run(job)
    return result


def simulated(train: Any, mode: str, costs: RLCosts) -> dict[str, float]:
    run = simulate_grpo(
        GRPOConfig(train=train, mode=mode),  # type: ignore[arg-type]
        one_host(),
        costs,
        OutputLengths(requested=True),
        resources={role: RESOURCES for role in ("generator", "trainer", "reward")},
        host_cpus=os.cpu_count() or 1,
    )
    return metrics(run.result)


def compare(runs: list[dict[str, float]], sim: dict[str, float]) -> dict[str, Any]:
    entry: dict[str, Any] = {"real": {}, "sim": {}, "error": {}}
    for metric in METRICS:
        values = [r[metric] for r in runs]
        med = statistics.median(values)
        entry["real"][metric] = {"median": round(med, 4), "min": round(min(values), 4),
                                 "max": round(max(values), 4)}  # fmt: skip
        entry["sim"][metric] = round(sim[metric], 4)
        if metric in RATES:
            entry["error"][metric] = round(sim[metric] / med - 1, 4) if med else None
        else:
            entry["error"][metric] = round(sim[metric] - med, 4)
    return entry


def table(out: dict[str, Any], modes: list[str]) -> None:
    print(
        f"{'mode':<12} {'metric':<20} {'real p50':>9} {'min':>9} {'max':>9} {'sim':>9} {'error':>8}"
    )
    for mode in modes:
        for metric in METRICS:
            real, sim = out[mode]["real"][metric], out[mode]["sim"][metric]
            err = out[mode]["error"][metric]
            shown = "-" if err is None else (f"{err:+.1%}" if metric in RATES else f"{err:+.3f}")
            print(f"{mode:<12} {metric:<20} {real['median']:>9.3f} {real['min']:>9.3f} "
                  f"{real['max']:>9.3f} {sim:>9.3f} {shown:>8}")  # fmt: skip


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="real runs of each mode")
    parser.add_argument("--demo", action="store_true", help="DEMO_CONFIG instead of SMALL_CONFIG")
    parser.add_argument("--steps", type=int, default=None, help="batches per run")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of modes")
    parser.add_argument("--save", default=None, help="also write the JSON here")
    parser.add_argument(
        "--no-call-path", action="store_true", help="probe the calls but do not charge them"
    )
    add_record_flag(parser)
    args = parser.parse_args()
    modes = list(dict.fromkeys(m for m in args.modes.split(",") if m))
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes is a comma list of {', '.join(MODES)}")
    if args.runs < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--runs and --steps are at least 1")
    base, name = (DEMO_CONFIG, "DEMO_CONFIG") if args.demo else (SMALL_CONFIG, "SMALL_CONFIG")
    train = dataclasses.replace(base, steps=args.steps or base.steps)
    configure_logging(json=False, level="WARNING")
    started = time.perf_counter()

    log("calibrating the roles (one torch thread)")
    costs, report = calibrate_rl(train)
    log(f"calibrated: step fit median |error| {report['generation_median_abs_error']:.1%}")
    probe, runs = real_runs(train, modes, args.runs, costs)
    if not args.no_call_path:
        costs = dataclasses.replace(costs, **{k: probe[k] for k in PROBED})
    out: dict[str, Any] = {
        "costs": dataclasses.asdict(costs),
        "call_path": probe,
        "calibration": {
            "generation_median_abs_error": report["generation_median_abs_error"],
            "train_steps": report["train_steps"],
            "machine": report["machine"],
        },
    }
    for mode in modes:
        log(f"simulating {mode}")
        out[mode] = compare(runs[mode], simulated(train, mode, costs))
    out["_meta"] = {
        "config": name, "steps": train.steps, "runs": args.runs, "modes": modes,
        "cores": os.cpu_count(), "whole_run_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    table(out, modes)
    line = json.dumps(out)
    if args.save:
        Path(args.save).write_text(line + "\n", encoding="utf-8")
    print(line)
    if args.record:
        record("sim_rl", out)


if __name__ == "__main__":
    main()
