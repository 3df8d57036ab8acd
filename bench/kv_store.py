"""The KV store against its limits: how long a longest-prefix ``match`` of a 32k-token prompt
takes inside the store, and how fast ``get_blocks`` moves blocks next to one
``Buffer.read_into`` of the same bytes.

    python bench/kv_store.py [--block-kib 256] [--blocks 256] [--iters 10]

**match.** A :class:`orchestr.roles.kvstore.BlockIndex` holding a 32,768-token prompt in
blocks of 16 tokens (2,048 chained hashes, all stored) among 30,000 other blocks; the median
over 200 calls of ``index.match`` of the prompt's 2,048 hashes (``match_ms_32k``: what the
store spends answering, the issue's target is under 1 ms), and over 20 of the same request
sent to a ``KVStore`` actor holding the prompt (in blocks of 64 bytes) from the controller
(``match_call_ms``: the same plus one actor call and its 2,048 hashes on the wire).

**get.** A ``KVStore`` actor holds ``--blocks`` blocks of ``--block-kib`` KiB in host memory
(written by a writer actor with ``put_blocks``); a reader actor in another worker process
times, per iteration, ``get_blocks`` of all of them into preallocated, pre-faulted tensors
(a lease call, one vectored ``Buffer.read_spans`` of every block, and the lease's release,
sent without waiting when the read ended within the lease; ``get_gbps``) and one
``Buffer.read_into`` of the same blocks, leased, from the lease's buffer into one tensor
(``read_into_gbps``, the data plane's limit for those bytes); medians over ``--iters`` after
one warm-up, and ``get_of_limit`` = get / read_into (the target is >= 0.8).

Prints the machine, a table, and one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import orchestr as oc  # noqa: E402
from orchestr._log import configure_logging  # noqa: E402
from orchestr.roles import KVNamespace, KVStore  # noqa: E402
from orchestr.roles.kvstore import BlockIndex, Tier, get_blocks, put_blocks  # noqa: E402

NS = KVNamespace("bench", block_size=16)
PROMPT_TOKENS = 32768
OTHER_BLOCKS = 30000
MATCH_CALLS = 200


def chain(n: int, tag: str) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def measure_match_in_index() -> dict[str, float]:
    prompt = chain(PROMPT_TOKENS // NS.block_size, "prompt")
    index = BlockIndex([Tier("host", len(prompt) + OTHER_BLOCKS)])
    for hashes in (chain(OTHER_BLOCKS, "other"), prompt):
        index.end_put(index.begin_put(NS, hashes, 0.0).id, 0.0)
    seconds = []
    for _ in range(MATCH_CALLS):
        start = time.perf_counter()
        found = index.match(NS, prompt, 1.0)
        seconds.append(time.perf_counter() - start)
    assert found.tokens == PROMPT_TOKENS, found
    return {"ms": statistics.median(seconds) * 1e3, "min_ms": min(seconds) * 1e3}


class Writer(oc.Actor):
    @oc.endpoint
    async def fill(self, store: Any, n: int, size: int, tag: str = "get") -> int:
        blocks = [torch.full((size,), i % 251, dtype=torch.uint8) for i in range(n)]
        return await put_blocks(store, NS, chain(n, tag), blocks)


class Reader(oc.Actor):
    def __init__(self, n: int, size: int) -> None:
        self.blocks = [torch.ones(size, dtype=torch.uint8) for _ in range(n)]  # pre-faulted
        self.whole = torch.ones(n * size, dtype=torch.uint8)
        self.n, self.size = n, size

    @oc.endpoint
    async def get(self, store: Any) -> float:
        start = time.perf_counter()
        got = await get_blocks(store, NS, chain(self.n, "get"), self.blocks)
        seconds = time.perf_counter() - start
        if got != self.n or int(self.blocks[-1][0]) != (self.n - 1) % 251:
            raise RuntimeError(f"read {got} of {self.n} blocks, or the wrong bytes")
        return seconds

    @oc.endpoint
    async def read_whole(self, store: Any) -> float:
        # a lease's buffer reaches its blocks only: the blocks of one put into an empty store
        # lie end to end, so all of them are one span
        lease = await store.lease.call_one(NS, chain(self.n, "get"))
        try:
            first = min(lease["offsets"])
            if sorted(lease["offsets"]) != list(
                range(first, first + self.whole.numel(), self.size)
            ):
                raise RuntimeError("the blocks do not lie end to end; read_into needs one span")
            start = time.perf_counter()
            await lease["buffer"].read_into(self.whole, offset=first)
            return time.perf_counter() - start
        finally:
            await store.release.call_one(lease["lease"])


async def measure(ctx: oc.JobContext, n: int, size: int, iters: int) -> dict[str, Any]:
    store = await ctx.spawn(KVStore, size, n + 8, high_watermark=1.0, low_watermark=1.0)
    prompt = chain(PROMPT_TOKENS // NS.block_size, "prompt")
    small = await ctx.spawn(KVStore, 64, len(prompt), high_watermark=1.0, low_watermark=1.0)
    writer = await ctx.spawn(Writer)
    reader = await ctx.spawn(Reader, n, size)
    try:
        if await writer.fill.call_one(store, n, size) != n:
            raise RuntimeError("the writer stored fewer blocks than asked")
        await writer.fill.call_one(small, len(prompt), 64, "prompt")  # the 32k prompt, stored
        calls = []
        for _ in range(20):
            start = time.perf_counter()
            found = await small.match.call_one(NS, prompt)
            calls.append(time.perf_counter() - start)
        if found["tokens"] != PROMPT_TOKENS:
            raise RuntimeError(f"the store matched {found['tokens']} of {PROMPT_TOKENS} tokens")
        get, whole = [], []
        for i in range(iters + 1):
            g = await reader.get.call_one(store)
            w = await reader.read_whole.call_one(store)
            if i:
                get.append(g)
                whole.append(w)
        nbytes = n * size
        return {
            "bytes": nbytes,
            "get_gbps": nbytes / statistics.median(get) / 1e9,
            "get_gbps_min_max": [nbytes / max(get) / 1e9, nbytes / min(get) / 1e9],
            "read_into_gbps": nbytes / statistics.median(whole) / 1e9,
            "read_into_gbps_min_max": [nbytes / max(whole) / 1e9, nbytes / min(whole) / 1e9],
            "match_call_ms": statistics.median(calls) * 1e3,
        }
    finally:
        for mesh in (reader, writer, small, store):
            await ctx.stop(mesh)


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--iters", type=int, default=10)
    add_record_flag(parser)
    args = parser.parse_args()
    if min(args.block_kib, args.blocks, args.iters) < 1:
        parser.error("--block-kib, --blocks and --iters must be at least 1")
    configure_logging(json=False, level="WARNING")
    load = os.getloadavg()
    print(
        f"{platform.node()} | {os.cpu_count()} cores | load {load[0]:.2f} {load[1]:.2f} | "
        f"Python {platform.python_version()} | orchestr {oc.__version__} | "
        f"torch {torch.__version__}",
        flush=True,
    )
    match = measure_match_in_index()
    size = args.block_kib << 10

    async def job(ctx: oc.JobContext) -> dict[str, Any]:
        return await measure(ctx, args.blocks, size, args.iters)

    got = oc.run(job)
    report = {
        "match_ms_32k": match["ms"],
        "match_ms_32k_min": match["min_ms"],
        **got,
        "get_of_limit": got["get_gbps"] / got["read_into_gbps"],
        "_meta": {"blocks": args.blocks, "block_bytes": size, "iters": args.iters},
    }
    print(f"{'':34s}{'median':>10s}{'min-max':>20s}")
    print(f"{'match, 32k tokens, in the index':34s}{match['ms']:>8.3f}ms{'':>20s}")
    print(f"{'match, one actor call':34s}{got['match_call_ms']:>8.3f}ms")
    lo, hi = got["get_gbps_min_max"]
    print(f"{'get_blocks GB/s':34s}{got['get_gbps']:>10.2f}{f'{lo:.2f}-{hi:.2f}':>20s}")
    lo, hi = got["read_into_gbps_min_max"]
    print(
        f"{'one read_into GB/s (limit)':34s}{got['read_into_gbps']:>10.2f}{f'{lo:.2f}-{hi:.2f}':>20s}"
    )
    print(f"{'get / limit':34s}{report['get_of_limit']:>10.2f}   (target >= 0.8)")
    print(json.dumps(report))
    if args.record:
        record("kv_store", report)


if __name__ == "__main__":
    main()
