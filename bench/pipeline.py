"""Pipeline schedules on actors: each one's bubble as measured here, beside its closed form
and the schedule's own timing model run with the passes' measured costs.

    python bench/pipeline.py [--microbatches 8] [--repeats 3] [--width 512] [--rows 64]

A model of ``2 * chunks`` stages (``--depth`` linear layers of ``--width`` with GELUs each,
``bench/_pipeline_model.py``) runs on 2 ranks (one process each, one torch thread each: this
machine's 2 cores) under GPipe, 1F1B, interleaved 1F1B (2 chunks a rank) and ZB-H1, with
``--microbatches`` micro-batches of ``--rows`` rows, SGD after each step. Per schedule, after
one warm-up step, over ``--repeats`` steps:

- ``bubble_measured``: the share of ``ranks * makespan`` the ranks did not spend in a pass
  (median and min-max), from each pass's start and end in one clock;
- ``bubble_theory``: :func:`orchestr.roles.pipeline.bubble_theory`, which assumes a backward
  takes twice a forward and each half of a split backward as long as a forward, and nothing
  else takes time;
- ``bubble_model``: :func:`orchestr.roles.pipeline.run` of the same schedule with the passes'
  median measured durations: what the schedule would give if only the passes took time, so
  ``bubble_measured - bubble_model`` is what sending and the runtime cost;
- ``step_s``: the step's wall time, against ``ideal_step_s``, one process running the whole
  model's passes for the batch (measured the same way, in this process) divided by the ranks.

One JSON line per schedule, then one summary line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import orchestr as oc
from orchestr.roles.pipeline import Cost, Pipeline, bubble_theory, build, run

RANKS = 2
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1))


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def single_process_step(args: argparse.Namespace) -> float:
    """The whole model (both ranks' stages) in this process, one thread, one batch."""
    from _pipeline_model import mlp_stage

    torch.set_num_threads(1)
    stages = [mlp_stage(s, RANKS, args.width, args.depth) for s in range(RANKS)]
    x = torch.randn(args.rows * args.microbatches, args.width)
    times = []
    for _ in range(args.repeats + 1):
        start = time.perf_counter()
        for xs in x.chunk(args.microbatches):
            h = xs
            for module in stages:
                h = module(h)
            torch.nn.functional.mse_loss(h, torch.zeros_like(h)).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def pass_costs(timelines: list[list[list[Any]]]) -> Cost:
    by_kind: dict[str, list[float]] = {}
    for timeline in timelines:
        for kind, _mb, _chunk, start, end in timeline:
            by_kind.setdefault(kind, []).append(end - start)

    def median(kind: str) -> float:
        return statistics.median(by_kind.get(kind) or [0.0])

    return Cost(f=median("F"), b=median("B"), bi=median("BI"), bw=median("BW"))


async def measure(ctx: oc.JobContext, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for name, chunks in SCHEDULES:
        # each stage holds depth / chunks layers: the whole model is the same for every schedule
        depth = max(1, args.depth // chunks)
        pipe = await Pipeline.spawn(
            ctx,
            "_pipeline_model:mlp_stage",
            schedule=name,
            ranks=RANKS,
            microbatches=args.microbatches,
            chunks=chunks,
            model_options={"width": args.width, "depth": depth},
            threads=1,
        )
        x = torch.randn(args.rows * args.microbatches, args.width)
        y = torch.zeros(args.rows * args.microbatches, args.width)
        await pipe.step(x, y)  # warm-up
        results = [await pipe.step(x, y) for _ in range(args.repeats)]
        model = [
            run(build(name, RANKS, args.microbatches, chunks), pass_costs(r.timelines)).bubble
            for r in results
        ]
        rows.append(
            {
                "schedule": name,
                "chunks": chunks,
                "bubble_measured": summary([r.bubble for r in results]),
                "bubble_model": summary(model),
                "bubble_theory": bubble_theory(name, RANKS, args.microbatches, chunks),
                "step_s": summary([r.makespan_s for r in results]),
            }
        )
        await ctx.stop(pipe.mesh)
    return rows


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rows", type=int, default=64)
    add_record_flag(parser)
    args = parser.parse_args()
    ideal = single_process_step(args) / RANKS

    async def main(ctx: oc.JobContext) -> list[dict[str, Any]]:
        return await measure(ctx, args)

    rows = oc.run(main)
    for row in rows:
        row["ideal_step_s"] = ideal
        print(json.dumps(row))
    line = {
        row["schedule"]: {
            "bubble_measured": row["bubble_measured"]["median"],
            "bubble_model": row["bubble_model"]["median"],
            "bubble_theory": row["bubble_theory"],
            "step_over_ideal": row["step_s"]["median"] / ideal,
        }
        for row in rows
    }
    print(json.dumps(line))
    if args.record:
        record("pipeline", {row["schedule"]: row for row in rows})


if __name__ == "__main__":
    main()
