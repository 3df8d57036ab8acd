"""Serving: ``orchestr serve`` and ``vllm serve`` on one checkpoint, driven by vLLM's own
benchmark client (``vllm bench serve``, through ``bench/vllm_bench_serve.py``) for every
system, on this machine's cores.

    python bench/serving.py [--quick] [--checkpoint DIR] [--vllm-python PY] [--systems ...]

The checkpoint is ``bench/generation.py``'s model (Llama family, 8 layers, hidden 512, about
24M parameters, float32), made locally unless ``--checkpoint`` names one. Systems:

- **orchestr**: ``orchestr serve`` with 2 generators (paged engine, one thread each:
  ``--torch-threads 1``, which the steps' thread takes too), the KV-aware router (``--router kv``) and a
  KV store of 2,048 blocks behind both generators (``--kv-store-blocks``: blocks offloaded,
  stored prefixes onboarded, the store's blocks in the router's cost).
- **orchestr_rr**: the same with round-robin routing and no store.
- **vllm**: vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``: the
  ``vllm`` command does not start under the CPU build) from its own venv (``bench/.venvs/vllm``
  or ``--vllm-python``), eager, float32, blocks of 32, prefix caching on, two OpenMP threads.

Workloads: **random** prompts (input 256, output 128, ``ignore_eos``) at request rates up to
saturation (``inf``), and **shared prefix** (vLLM's ``prefix_repetition`` dataset: system
prompts of 1024 tokens, each shared by a group of requests, own suffixes of 64 tokens, 64
output tokens, at 4 requests/s: about what two generators sustain, so the prefill a cache
saves shows in the goodput; at 2/s every system keeps up). Goodput counts requests with TTFT <= 1 s and TPOT <= 100 ms.
``prefix_hit_rate`` is the servers' own prompt-token counters (``vllm:prefix_cache_hits`` /
``queries``) over the workload. It also measures what HTTP adds to the time to first token
(``bench/_serving_overhead.py``): the paged engine called in process, the front door in
process, and HTTP through uvicorn.

It prints a table with ratios and ends with one JSON line ``{"orchestr": {...},
"orchestr_rr": {...}, "vllm": {...}, "overhead": {...}}``; each system's numbers are
``output_tokens_per_s``, ``ttft_ms_p50``, ``ttft_ms_p99``, ``tpot_ms_p50``,
``goodput_req_per_s`` and ``failed`` of the random workload at the rate with the most
goodput, and the shared-prefix workload's under ``prefix``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _venvs import VLLM_PRE, VLLM_REMOVE, VLLM_REQUIREMENTS, ensure_venv  # noqa: E402

SYSTEMS = ("orchestr", "orchestr_rr", "vllm")
MODEL = {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1376}
SLO = {"ttft": 1000, "tpot": 100}  # milliseconds
KEYS = ("output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "goodput_req_per_s")


def log(message: str) -> None:
    print(f"[serving] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(system: str, folder: str, port: int, vllm_python: str) -> subprocess.Popen[bytes]:
    if system == "vllm":
        cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
               "--served-model-name", "tiny", "--dtype", "float32", "--enforce-eager",
               "--block-size", "32", "--max-model-len", "2048", "--enable-prefix-caching",
               "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="2", VLLM_CPU_KVCACHE_SPACE="1")
    else:
        kv = system == "orchestr"
        cmd = [sys.executable, "-m", "orchestr.cli", "serve", folder, "--generators", "2",
               "--router", "kv" if kv else "round_robin", "--torch-threads", "1",
               "--served-model-name", "tiny", "--port", str(port),
               *(["--kv-store-blocks", "2048"] if kv else [])]  # fmt: skip
        env = dict(os.environ)  # --torch-threads 1: one thread per generator's steps
    log(f"starting {system}: {' '.join(cmd[:4])} ...")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT a server (it stops as on Ctrl-C), then kill it if it lingers past 60 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it served")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy in {timeout_s} s")


def prefix_counters(url: str) -> tuple[float, float]:
    """The server's prompt tokens looked up in and found in its prefix caches."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()

    def total(name: str) -> float:
        pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$"
        return sum(float(m) for m in re.findall(pattern, text, re.M))

    return total("vllm:prefix_cache_queries_total"), total("vllm:prefix_cache_hits_total")


def client(
    vllm_python: str, url: str, folder: str, args: list[str], slo: dict[str, float] = SLO
) -> dict[str, Any]:
    cmd = [vllm_python, str(HERE / "vllm_bench_serve.py"), "--backend", "openai",
           "--base-url", url, "--endpoint", "/v1/completions", "--model", "tiny",
           "--tokenizer", folder, "--seed", "0", "--percentile-metrics", "ttft,tpot",
           "--metric-percentiles", "50,99",
           "--goodput", f"ttft:{slo['ttft']}", f"tpot:{slo['tpot']}", *args]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    results = [json.loads(x[7:]) for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not results:
        raise RuntimeError(f"the client failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return results[-1]


def numbers(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "output_tokens_per_s": r["output_throughput"],
        "ttft_ms_p50": r["p50_ttft_ms"],
        "ttft_ms_p99": r["p99_ttft_ms"],
        "tpot_ms_p50": r["p50_tpot_ms"],
        "goodput_req_per_s": r.get("request_goodput", 0.0),
        "failed": r["failed"],
        "completed": r["completed"],
    }


def run_system(system: str, folder: str, vllm_python: str, quick: bool) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(system, folder, port, vllm_python)
    try:
        wait_healthy(url, proc)
        n = 24 if quick else 96
        rates = ["inf"] if quick else ["2", "4", "8", "inf"]
        by_rate = {}
        for rate in rates:
            log(f"{system}: random, rate {rate}")
            r = client(vllm_python, url, folder, [
                "--dataset-name", "random", "--random-input-len", "256",
                "--random-output-len", "128", "--num-prompts", str(n), "--request-rate", rate,
            ])  # fmt: skip
            by_rate[rate] = numbers(r)
        best = max(
            by_rate.values(), key=lambda x: (x["goodput_req_per_s"], x["output_tokens_per_s"])
        )
        log(f"{system}: shared prefix")
        q0, h0 = prefix_counters(url)
        r = client(vllm_python, url, folder, [
            "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
            "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "4",
            "--prefix-repetition-output-len", "64", "--num-prompts", str(16 if quick else 64),
            "--request-rate", "4",
        ])  # fmt: skip
        q1, h1 = prefix_counters(url)
        prefix = numbers(r)
        prefix["prefix_hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
        return {**best, "by_rate": by_rate, "prefix": prefix}
    finally:
        stop(proc)


def overhead(folder: str, quick: bool) -> dict[str, Any]:
    log("overhead of HTTP on the time to first token")
    out = subprocess.run(
        [sys.executable, str(HERE / "_serving_overhead.py"), folder, "--prompt-len", "16",
         "--requests", "30" if quick else "100"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"the overhead run failed:\n{out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    result["http_minus_engine_ms_p50"] = result["http"]["p50_ms"] - result["engine"]["p50_ms"]
    return result


def table(results: dict[str, Any]) -> None:
    have = [s for s in SYSTEMS if results.get(s)]
    print(
        f"{'random (best goodput rate)':<28}"
        + "".join(f"{s:>14}" for s in have)
        + "   orchestr/vllm"
    )
    for key in (*KEYS, "failed"):
        row = [results[s][key] for s in have]
        ratio = ""
        if "orchestr" in have and "vllm" in have and results["vllm"][key]:
            ratio = f"{results['orchestr'][key] / results['vllm'][key]:>10.2f}x"
        print(f"{key:<28}" + "".join(f"{v:>14.2f}" for v in row) + "   " + ratio)
    print(f"{'shared prefix':<28}" + "".join(f"{s:>14}" for s in have) + "   orchestr/rr")
    for key in (*KEYS, "prefix_hit_rate", "failed"):
        row = [results[s]["prefix"][key] for s in have]
        ratio = ""
        if "orchestr" in have and "orchestr_rr" in have and results["orchestr_rr"]["prefix"][key]:
            ratio = f"{results['orchestr']['prefix'][key] / results['orchestr_rr']['prefix'][key]:>10.2f}x"
        print(f"{key:<28}" + "".join(f"{v:>14.3f}" for v in row) + "   " + ratio)
    o = results.get("overhead")
    if o:
        print(
            f"TTFT p50 (16-token prompts): engine in process {o['engine']['p50_ms']:.2f} ms, "
            f"front door in process {o['frontdoor']['p50_ms']:.2f} ms, HTTP "
            f"{o['http']['p50_ms']:.2f} ms: HTTP adds {o['http_minus_engine_ms_p50']:.2f} ms"
        )


def common_args(parser: argparse.ArgumentParser) -> None:
    """The options every serving benchmark takes (see :func:`prepared`)."""
    parser.add_argument("--quick", action="store_true", help="fewer requests, one rate")
    parser.add_argument("--checkpoint", help="a checkpoint folder to use instead of a new one")
    parser.add_argument("--vllm-python", help="a python with vllm-cpu (default: its bench venv)")


@contextlib.contextmanager
def prepared(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """The python with vLLM's client (``--vllm-python``, else the bench venv, made if
    missing) and the checkpoint folder (``--checkpoint``, else :data:`MODEL` made in a
    temporary folder removed afterwards)."""
    vllm_python = args.vllm_python or str(
        ensure_venv("vllm", VLLM_REQUIREMENTS, pre=VLLM_PRE, remove=VLLM_REMOVE)
    )
    from orchestr.roles import models

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.checkpoint or models.make_tiny(
            "llama", Path(tmp) / "llama", max_positions=4096, **MODEL
        )
        yield vllm_python, str(Path(folder).resolve())


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(parser)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    add_record_flag(parser)
    args = parser.parse_args()
    systems = args.systems.split(",")
    with prepared(args) as (vllm_python, folder):
        results: dict[str, Any] = {
            s: run_system(s, folder, vllm_python, args.quick) for s in systems
        }
        results["overhead"] = overhead(folder, args.quick)
    table(results)
    print(json.dumps(results))
    if args.record:
        record("serving", results, peers=["vllm-cpu"])


if __name__ == "__main__":
    main()
