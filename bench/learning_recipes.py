"""How often the entry points' learning recipes clear their thresholds, over seeds and torch's
CPU kernels.

    python bench/learning_recipes.py [--tasks say,spell] [--seeds 0-9] [--kernels avx2,default]
                                     [--jobs J]

Each (kernel path, task, seed) runs :func:`tests.rl_recipes.sft_then_grpo` (a tiny llama, SFT,
then GRPO beside a control with zeroed advantages, through ``run_sft``/``run_rl``) on an
embedded cluster in a process of its own with ``ATEN_CPU_CAPABILITY`` set to that path. Prints
one JSON line per run (SFT's held-out loss, the held-out reward of GRPO and of the control at
each evaluation, seconds), then per (path, task) how many runs cleared
``tests.rl_recipes.THRESHOLDS``, the smallest margin over the control, and the slowest run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

from learning_seeds import _cpu_has, _seeds

ROOT = pathlib.Path(__file__).resolve().parents[1]

_RUN = """
import json, pathlib, sys, tempfile, time
import orchestr as oc
from tests.rl_recipes import clears, sft_then_grpo
task, seed = sys.argv[1], int(sys.argv[2])
start = time.perf_counter()
out = {}
async def main(ctx):
    with tempfile.TemporaryDirectory(prefix="orchestr-recipe-") as folder:
        out.update(await sft_then_grpo(ctx, task, pathlib.Path(folder), seed))
oc.run(main)
out["cleared"] = clears(out)
out["s"] = round(time.perf_counter() - start, 1)
print(json.dumps(out))
"""


def main() -> int:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", default="say,spell")
    parser.add_argument("--seeds", default="0-9")
    parser.add_argument("--kernels", default="avx2,default")
    parser.add_argument("--jobs", type=int, default=1)
    add_record_flag(parser)
    args = parser.parse_args()
    print(json.dumps({"cpus": os.cpu_count(), "load": os.getloadavg()[0]}), flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    work = [
        (kernel, task, seed)
        for kernel in args.kernels.split(",")
        for task in args.tasks.split(",")
        for seed in _seeds(args.seeds)
    ]
    for kernel in {k for k, _, _ in work if not _cpu_has(k)}:
        print(json.dumps({"kernel": kernel, "skipped": "this CPU lacks it"}), flush=True)
    work = [w for w in work if _cpu_has(w[0])]
    runs: dict[tuple[str, str], list[dict[str, object]]] = {}
    for at in range(0, len(work), args.jobs):
        batch = work[at : at + args.jobs]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _RUN, task, str(seed)], cwd=ROOT,
                env={**env, "ATEN_CPU_CAPABILITY": kernel}, stdout=subprocess.PIPE, text=True,
            )
            for kernel, task, seed in batch
        ]  # fmt: skip
        for (kernel, task, _), proc in zip(batch, procs, strict=True):
            out, _ = proc.communicate()
            if proc.returncode:
                raise RuntimeError(f"a run exited with {proc.returncode}")
            run = json.loads(out.splitlines()[-1])
            runs.setdefault((kernel, task), []).append(run)
            print(json.dumps({"kernel": kernel, **run}), flush=True)
    summary = {
        f"{kernel}/{task}": {
            "cleared": f"{sum(bool(r['cleared']) for r in rs)}/{len(rs)}",
            "min_margin": round(min(r["grpo"][-1] - r["control"][-1] for r in rs), 4),  # type: ignore[index]
            "max_s": max(r["s"] for r in rs),  # type: ignore[type-var]
        }
        for (kernel, task), rs in runs.items()
    }
    cleared = all(r["cleared"] for rs in runs.values() for r in rs)
    print(json.dumps({"summary": summary, "all_cleared": cleared}))
    if args.record:  # per (path, task): runs cleared, and each run's margin and seconds
        figures = {
            f"{kernel}/{task}": {
                "cleared": sum(bool(r["cleared"]) for r in rs),
                "runs": len(rs),
                "margin": [r["grpo"][-1] - r["control"][-1] for r in rs],
                "s": [r["s"] for r in rs],
            }
            for (kernel, task), rs in runs.items()
        }
        record("learning_recipes", figures, peers=["reasoning-gym"])
    return 0 if cleared else 1


if __name__ == "__main__":
    started = time.time()
    code = main()
    print(f"# {time.time() - started:.0f} s", file=sys.stderr)
    sys.exit(code)
