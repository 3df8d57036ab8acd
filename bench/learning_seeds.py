"""How far the learning test's recipe clears its thresholds, over seeds and torch's CPU kernels.

    python bench/learning_seeds.py [--model llama|llama-demo|tinylm] [--seeds 0-9]
                                   [--kernels avx2,default] [--steps N] [--jobs J]
                                   [--set FIELD=VALUE ...]

Each (kernel path, seed) runs ``orchestr.roles.train(config)`` (the single-process reference
the sync-mode roles reproduce) in a process of its own with ``ATEN_CPU_CAPABILITY`` set to
that path: each rounds differently, as another machine would. ``config`` is the learning
test's: ``LLAMA_CONFIG`` (the example's ``--small``, the default), ``LLAMA_DEMO_CONFIG`` (the
main job's, ``--model llama-demo``) or ``SMALL_CONFIG`` (``--model tinylm``), with ``--set`` overriding its fields (``--set entropy_coef=0.03``;
values are read as JSON). ``--jobs`` runs that many at once, each on one torch thread.
A path the CPU lacks (``avx512`` without AVX-512) is skipped and said so. Prints one JSON line
per run (held-out accuracy at each evaluation, the last-50 mean reward, seconds), then a
summary: the smallest final accuracy, gain and last-50 reward per path, against the learning
test's thresholds (accuracy >= 0.9, gain >= 0.5, last-50 reward >= 0.8).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_RUN = """
import dataclasses, json, sys, time
from orchestr.roles import SMALL_CONFIG, train
from orchestr.roles.rl import LLAMA_CONFIG, LLAMA_DEMO_CONFIG
seed, steps, name, changes, threads = sys.argv[1:6]
base = {"llama": LLAMA_CONFIG, "llama-demo": LLAMA_DEMO_CONFIG, "tinylm": SMALL_CONFIG}[name]
start = time.perf_counter()
config = dataclasses.replace(
    base, seed=int(seed), steps=int(steps) or base.steps, **json.loads(changes),
    **({"threads": int(threads)} if int(threads) else {}),
)
history = train(config)
print(json.dumps({
    "seed": int(seed),
    "evals": [round(e.accuracy, 4) for e in history.evals],
    "last50_reward": round(history.mean_reward(last=50), 4),
    "s": round(time.perf_counter() - start, 1),
}))
"""

THRESHOLDS = {"final": 0.9, "gain": 0.5, "last50": 0.8}


def _seeds(text: str) -> list[int]:
    if "-" in text:
        low, high = text.split("-")
        return list(range(int(low), int(high) + 1))
    return [int(s) for s in text.split(",")]


def _cpu_has(kernel: str) -> bool:
    if kernel == "default":
        return True
    flags = open("/proc/cpuinfo").read()
    return {"avx2": " avx2", "avx512": " avx512f"}[kernel] in flags


def main() -> int:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="0-9")
    parser.add_argument("--kernels", default="avx2,default,avx512")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--model", choices=("llama", "llama-demo", "tinylm"), default="llama")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    add_record_flag(parser)
    args = parser.parse_args()
    changes = {k: json.loads(v) for k, _, v in (item.partition("=") for item in args.set)}
    import torch

    print(
        json.dumps(
            {
                "machine": {"cpus": os.cpu_count(), "load": os.getloadavg()[0]},
                "torch": torch.__version__,
                "model": args.model,
                "changes": changes,
            }
        ),
        flush=True,
    )
    summary = {}
    threads = 1 if args.jobs > 1 else 0  # 0: the config's own
    for kernel in args.kernels.split(","):
        if not _cpu_has(kernel):
            print(json.dumps({"kernel": kernel, "skipped": "this CPU lacks it"}), flush=True)
            continue
        env = {**os.environ, "ATEN_CPU_CAPABILITY": kernel}
        cmd = [sys.executable, "-c", _RUN]
        tail = [str(args.steps), args.model, json.dumps(changes), str(threads)]
        seeds = _seeds(args.seeds)
        runs = []
        for at in range(0, len(seeds), args.jobs):
            procs = [
                subprocess.Popen(
                    [*cmd, str(seed), *tail], env=env, stdout=subprocess.PIPE, text=True
                )
                for seed in seeds[at : at + args.jobs]
            ]
            for proc in procs:
                out, _ = proc.communicate()
                if proc.returncode:
                    raise RuntimeError(f"a run exited with {proc.returncode}")
                run = json.loads(out.splitlines()[-1])
                runs.append(run)
                print(json.dumps({"kernel": kernel, **run}), flush=True)
        summary[kernel] = {
            "runs": len(runs),
            "min_final": min(r["evals"][-1] for r in runs),
            "min_gain": min(r["evals"][-1] - r["evals"][0] for r in runs),
            "min_last50": min(r["last50_reward"] for r in runs),
        }
    cleared = all(
        s["min_final"] >= THRESHOLDS["final"]
        and s["min_gain"] >= THRESHOLDS["gain"]
        and s["min_last50"] >= THRESHOLDS["last50"]
        for s in summary.values()
    )
    print(json.dumps({"summary": summary, "thresholds": THRESHOLDS, "all_cleared": cleared}))
    if args.record:
        record("learning_seeds", {"summary": summary})
    return 0 if cleared else 1


if __name__ == "__main__":
    started = time.time()
    code = main()
    print(f"# {time.time() - started:.0f} s", file=sys.stderr)
    sys.exit(code)
