"""The simulated engine against the real one: one generator, the same requests, on the wall
clock, in one run.

    python bench/sim_engine.py [--requests 24] [--repeats 3] [--record]

A Llama checkpoint (``--hidden`` wide, 4 layers) is calibrated here (``orchestr.sim``'s
``calibrate``: the profile the simulated engine steps), then one workload runs on the paged
engine and on the simulated engine (``Generator(engine="sim")``'s), each in this process with
this machine's threads. The workload is ``--requests`` requests all at once, prompts of 64
to 256 tokens and 32 to 96 tokens out (``ignore_eos``: the real engine runs to the same
lengths the simulated one does). Each side reports the median time to first token and time
per output token over its requests, and its output tokens a second. ``*_error`` is the
simulated figure's signed error against the real one (median of ``--repeats``). Beside it,
the simulator's published targets for its serving validation (``docs/simulator.md``): ±10%
on the latencies and ±5% on the rate.

Prints one JSON line per repeat, then the summary line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import torch

from orchestr.roles import models
from orchestr.roles._common._hf._config import read_config
from orchestr.roles.generator import PagedEngine, Request
from orchestr.roles.generator._engines._sim import SimEngine
from orchestr.sim._calibrate import calibrate

KV = {"num_blocks": 1024, "block_size": 16, "max_batch": 32, "token_budget": 2048}
TARGETS = {"ttft_ms_p50": 0.10, "tpot_ms_p50": 0.10, "output_tokens_per_s": 0.05}


def workload(n: int, repeat: int) -> list[Request]:
    """``n`` requests of prompts 64-256 tokens long and 32-96 out, distinct per repeat."""
    out = []
    for i in range(n):
        prompt = [(7 * i + 13 * repeat + j) % 300 + 1 for j in range(64 + (i * 37) % 193)]
        out.append(Request(f"r{repeat}-{i}", prompt, 32 + (i * 29) % 65, ignore_eos=True))
    return out


def measure(engine: Any, requests: list[Request]) -> dict[str, float]:
    start = time.perf_counter()
    engine.submit(requests)
    done = []
    while engine.has_work():
        done += engine.step()
    wall = time.perf_counter() - start
    tokens = sum(len(c.tokens) for c in done)
    tpot = [(c.latency_s - c.ttft_s) / (len(c.tokens) - 1) for c in done if len(c.tokens) > 1]
    return {
        "ttft_ms_p50": 1e3 * statistics.median(c.ttft_s for c in done),
        "tpot_ms_p50": 1e3 * statistics.median(tpot),
        "output_tokens_per_s": tokens / wall,
    }


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    add_record_flag(parser)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        shape = {"layers": 4, "hidden": args.hidden, "heads": 4, "kv_heads": 2}
        folder = str(models.make_tiny("llama", f"{tmp}/llama", **shape))
        profile, report = calibrate(folder, torch_threads=2, repeats=3)
        real = PagedEngine(models.load_model(folder), **KV)
        sim = SimEngine(read_config(folder), profile, **KV)
        measure(real, workload(4, 99))  # warm-up: packing, the kernels' first calls
        runs = []
        for repeat in range(args.repeats):
            row = {
                "real": measure(real, workload(args.requests, repeat)),
                "sim": measure(sim, workload(args.requests, repeat)),
            }
            print(json.dumps({"repeat": repeat, **row}))
            runs.append(row)
    errors = {
        f"{k}_error": statistics.median(r["sim"][k] / r["real"][k] - 1 for r in runs)
        for k in TARGETS
    }
    summary = {
        "real": {k: statistics.median(r["real"][k] for r in runs) for k in TARGETS},
        "sim": {k: statistics.median(r["sim"][k] for r in runs) for k in TARGETS},
        **errors,
        "_targets": {f"{k}_error": f"±{v:.0%}" for k, v in TARGETS.items()},
        "_met": {f"{k}_error": abs(errors[f"{k}_error"]) <= v for k, v in TARGETS.items()},
        "profile_fit_error_median": report.get("median_abs_error"),
    }
    print(json.dumps(summary))
    if args.record:
        record("sim_engine", summary)


if __name__ == "__main__":
    main()
