"""How far the learning test's recipe clears its thresholds, over seeds and torch's CPU kernels.

    python bench/learning_seeds.py [--seeds 0-9] [--kernels avx2,default] [--steps N]

Each (kernel path, seed) runs ``orchestr.roles.train(SMALL_CONFIG)`` (the single-process
reference the sync-mode roles reproduce) in a process of its own with
``ATEN_CPU_CAPABILITY`` set to that path: each rounds differently, as another machine would.
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
seed, steps = int(sys.argv[1]), int(sys.argv[2])
start = time.perf_counter()
config = dataclasses.replace(SMALL_CONFIG, seed=seed, steps=steps or SMALL_CONFIG.steps)
history = train(config)
print(json.dumps({
    "seed": seed,
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
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="0-9")
    parser.add_argument("--kernels", default="avx2,default,avx512")
    parser.add_argument("--steps", type=int, default=0)
    args = parser.parse_args()
    import torch

    print(
        json.dumps(
            {
                "machine": {"cpus": os.cpu_count(), "load": os.getloadavg()[0]},
                "torch": torch.__version__,
            }
        ),
        flush=True,
    )
    summary = {}
    for kernel in args.kernels.split(","):
        if not _cpu_has(kernel):
            print(json.dumps({"kernel": kernel, "skipped": "this CPU lacks it"}), flush=True)
            continue
        runs = []
        for seed in _seeds(args.seeds):
            env = {**os.environ, "ATEN_CPU_CAPABILITY": kernel}
            out = subprocess.run(
                [sys.executable, "-c", _RUN, str(seed), str(args.steps)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
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
    return 0 if cleared else 1


if __name__ == "__main__":
    started = time.time()
    code = main()
    print(f"# {time.time() - started:.0f} s", file=sys.stderr)
    sys.exit(code)
