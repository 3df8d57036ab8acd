"""How often the main job clears its thresholds, run after run, as a new user runs it.

    python bench/demo_runs.py [--runs 20] [--config examples/rl/digits.toml] [--set K=V ...]

Runs ``orchestr rl train CONFIG`` (``make demo``'s command) ``--runs`` times, one after another,
each in a process of its own on an embedded cluster, with the config's own seed: what varies
between runs is the timing of the stream modes (which groups finish first, how stale each
trained sample is), as it varies between a user's runs. Prints one JSON line per run (final
held-out score, last-50 reward, seconds, whether it cleared the thresholds), then a count.
The thresholds are the config's promise: final held-out accuracy >= 0.9 and last-50 reward
>= 0.9.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
THRESHOLDS = {"held_out": 0.9, "last50_reward": 0.9}


def one(config: str, sets: list[str], folder: str) -> dict[str, object]:
    start = time.perf_counter()
    args = [sys.executable, "-m", "orchestr.cli", "rl", "train", config, "--quiet"]
    args += ["--run-dir", folder, *(x for s in sets for x in ("--set", s))]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    seconds = round(time.perf_counter() - start, 1)
    if proc.returncode:
        return {"ok": False, "error": proc.stderr.strip().splitlines()[-1:], "s": seconds}
    summary = json.loads(pathlib.Path(folder, "summary.json").read_text())
    held, last50 = summary["held_out"][-1], summary["last50_reward"]
    ok = held >= THRESHOLDS["held_out"] and last50 >= THRESHOLDS["last50_reward"]
    return {"ok": ok, "held_out": round(held, 4), "last50_reward": round(last50, 4), "s": seconds}


def main() -> int:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--config", default="examples/rl/digits.toml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    add_record_flag(parser)
    args = parser.parse_args()
    passed = 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="orchestr-demo-runs-") as tmp:
        for i in range(args.runs):
            row = one(args.config, args.set, os.path.join(tmp, f"run{i}"))
            passed += bool(row["ok"])
            rows.append(row)
            print(json.dumps({"run": i, **row}), flush=True)
    print(json.dumps({"config": args.config, "set": args.set, "passed": passed, "runs": args.runs,
                      "thresholds": THRESHOLDS}))  # fmt: skip
    if args.record:
        record("demo_runs", {"passed": passed, "runs": args.runs, "each": rows})
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
