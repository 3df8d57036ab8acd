"""A prefill/decode handoff read whole after the prefill, streamed layer by layer while it
runs, or copied in place once it is done: how much of the transfer is left on the request's
path (its exposed time), its bandwidth, and the time to the first token.

    python bench/handoff_overlap.py [--rounds N] [--tokens T] [--checkpoint DIR]

The checkpoint is ``bench/serving.py``'s (Llama family, 8 layers, hidden 512, about 24M
parameters, float32), made in a temporary folder unless ``--checkpoint`` names one. Two
generators of one thread each on an embedded cluster (two cores: one each), the paged engine
with 512-token prefill chunks: a prefill generator and two decode generators, one reading
staged (``kv_read="staged"``) and one in place (``"direct"``). Each round sends a
fresh prompt of ``--tokens`` tokens (no prefix reuse) through each mode, in alternating
order:

- **whole**: ``prefill(request)`` returns once the prompt is computed; the decode generator
  then reads its blocks (one ``read_spans``) and computes the first token;
- **streamed**: ``prefill(request, stream=True)`` returns once it is queued; the decode
  generator reads each layer's blocks as the prefill writes them and computes the first
  token after the last read;
- **direct**: streamed too, but the decode generator waits for the prompt to be done, then
  copies its blocks straight from the prefill generator's pool into its own, between steps.

The limit is the prefill alone: the prefill generator computing the same prompt's first token
with nothing to hand over (a transfer hidden entirely costs nothing more). ``exposed_ms`` is
the decode generator's ``orchestr:kv_transfer_exposed_seconds`` per request: reading done
after the prefill had finished (for ``whole`` and ``direct``, all of it); ``gbps`` is the
bytes read over the seconds reading them (``orchestr:kv_transfer_bytes`` and ``_seconds``).

Prints a table with medians and min-max over the rounds, and one JSON line last:
``{"whole": {...}, "streamed": {...}, "direct": {...}, "limit": {...}}`` with ``ttft_ms``,
``exposed_ms``, ``read_ms``, ``reads`` and ``mb`` per request, and ``gbps``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serving import MODEL  # noqa: E402

import orchestr as oc  # noqa: E402
from orchestr.roles import Generator, Request, models  # noqa: E402

MODES = ("whole", "streamed", "direct")
COUNTERS = {
    "exposed_ms": "orchestr:kv_transfer_exposed_seconds",
    "read_ms": "orchestr:kv_transfer_seconds",
    "reads": "orchestr:kv_transfer_reads",
    "mb": "orchestr:kv_transfer_bytes",
}
SCALE = {"exposed_ms": 1e3, "read_ms": 1e3, "reads": 1, "mb": 1e-6}


def prompt(n: int, salt: int) -> list[int]:
    return [(7 * i + 13 * salt + 3) % 380 + 5 for i in range(n)]


async def bench(ctx: oc.JobContext, folder: str, rounds: int, tokens: int) -> dict[str, Any]:
    def spawn(name: str, kv_read: str = "direct") -> Any:
        return ctx.spawn(
            Generator, name=name, checkpoint=folder, torch_threads=1, handoff={"read": kv_read},
            kv={"num_blocks": 2 * (tokens // 16 + 4), "block_size": 16, "token_budget": 512},
        )  # fmt: skip

    pre, staged, direct = (
        await spawn("prefill"),
        await spawn("staged", "staged"),
        await spawn("direct"),
    )
    samples: dict[str, dict[str, list[float]]] = {
        m: {k: [] for k in ("ttft_ms", *COUNTERS)} for m in (*MODES, "limit")
    }
    salt = 0

    async def one(mode: str) -> None:
        nonlocal salt
        salt += 1
        r = Request(f"{mode}-{salt}", prompt(tokens, salt), 1, temperature=0.0)
        dec = direct if mode == "direct" else staged
        before = await dec.stats.call_one()
        started = time.perf_counter()
        if mode == "limit":
            await pre.generate.call_one([r])
        else:
            h = await pre.prefill.call_one(r, stream=mode != "whole")
            await dec.generate.call_one([r], kv_from={r.id: h.sent_from(pre)})
        samples[mode]["ttft_ms"].append((time.perf_counter() - started) * 1e3)
        after = await dec.stats.call_one()
        for key, name in COUNTERS.items():
            samples[mode][key].append((after[name] - before[name]) * SCALE[key])

    for mode in (*MODES, "limit"):  # warm-up: the decode side maps the prefill pool once
        await one(mode)
    samples = {m: {k: [] for k in v} for m, v in samples.items()}
    for i in range(rounds):
        order = [*MODES, "limit"] if i % 2 == 0 else ["limit", *reversed(MODES)]
        for mode in order:
            await one(mode)
    return samples


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=1024, help="prompt tokens (default 1024)")
    parser.add_argument("--checkpoint", help="a checkpoint folder to use instead of a new one")
    add_record_flag(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.checkpoint or models.make_tiny(
            "llama", Path(tmp) / "llama", max_positions=4096, **MODEL
        )
        path = str(Path(folder).resolve())

        async def job(ctx: oc.JobContext) -> dict[str, Any]:
            return await bench(ctx, path, args.rounds, args.tokens)

        samples = oc.run(job)
    result = {m: {k: summary(v) for k, v in s.items() if v and any(v)} for m, s in samples.items()}
    result["limit"] = {"ttft_ms": summary(samples["limit"]["ttft_ms"])}
    for mode in MODES:
        s = samples[mode]
        result[mode]["gbps"] = round(sum(s["mb"]) / sum(s["read_ms"]), 3)
    limit = result["limit"]["ttft_ms"]["median"]
    print(f"{args.tokens}-token prompts, {args.rounds} rounds (median, min-max)")
    print(
        f"{'mode':<10}{'ttft ms':>22}{'x limit':>9}{'exposed ms':>20}{'read ms':>20}"
        f"{'reads':>7}{'GB/s':>8}"
    )
    for mode in MODES:
        r = result[mode]

        def cell(key: str, r: dict[str, Any] = r) -> str:
            v = r[key]
            return f"{v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})"

        ratio = r["ttft_ms"]["median"] / limit
        reads = r["reads"]["median"]
        print(
            f"{mode:<10}{cell('ttft_ms'):>22}{ratio:>9.3f}{cell('exposed_ms'):>20}"
            f"{cell('read_ms'):>20}{reads:>7.0f}{r['gbps']:>8.2f}"
        )
    print(f"{'limit':<10}{limit:>22.2f}  (the prefill alone, nothing handed over)")
    print(json.dumps(result))
    if args.record:  # every round's values, and each mode's bandwidth over all rounds
        each = {m: {k: v for k, v in s.items() if v and any(v)} for m, s in samples.items()}
        record("handoff_overlap", {m: {**result.get(m, {}), **each[m]} for m in each})


if __name__ == "__main__":
    main()
