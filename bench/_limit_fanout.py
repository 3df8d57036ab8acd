"""The limit for a fan-out/fan-in step on this machine: no runtime at all.

N echo servers, each its own process (``_limit_echo.py serve``: uvloop, length-prefixed
msgpack ``[id, value]`` frames), and one controller on uvloop with a TCP connection to each.
A step writes one small frame to every connection and resolves a single future when the N-th
reply has been decoded (a counter, not N futures). That is the least any runtime that keeps
actors in processes of their own can do per step: N frames out, N wake-ups, N frames back.

    python bench/_limit_fanout.py CASES REPS   # CASES like 64:200,256:50 (N:steps); one JSON line

Each repetition times STEPS back-to-back steps (after one warm-up repetition); the figure is
wall time per step in µs. Groups grow in ascending size: the servers started for 64 are the
first 64 of the 256.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import uvloop
from _limit_echo import _Framed

ECHO = Path(__file__).resolve().parent / "_limit_echo.py"


class _Fanin:
    """One step's replies: a count down to a single future."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.results: list[Any] = []
        self.done: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()

    def arrive(self, value: Any) -> None:
        self.results.append(value)
        self.left -= 1
        if not self.left:
            self.done.set_result(self.results)


class _Conn(_Framed):
    def __init__(self) -> None:
        super().__init__()
        self.step: _Fanin | None = None

    def frame(self, msg: Any) -> None:
        assert self.step is not None
        self.step.arrive(msg[1])


def _start_servers(count: int) -> list[tuple[subprocess.Popen[str], int]]:
    procs = [
        subprocess.Popen([sys.executable, str(ECHO), "serve"], stdout=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    out = []
    for proc in procs:
        assert proc.stdout is not None
        out.append((proc, int(proc.stdout.readline())))
    return out


def _rss(pid: int) -> tuple[int, int]:
    """VmRSS and Pss of a process, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/smaps_rollup") as f:
        pss = next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    return rss * 1024, pss * 1024


async def _measure(ports: list[int], steps: int, reps: int) -> list[float]:
    loop = asyncio.get_running_loop()
    conns: list[_Conn] = []
    for port in ports:
        _, conn = await loop.create_connection(_Conn, "127.0.0.1", port)
        conns.append(conn)

    async def step(i: int) -> list[Any]:
        fanin = _Fanin(len(conns))
        for c in conns:
            c.step = fanin
            c.send([i, i])
        return await fanin.done

    async def once() -> float:
        start = time.perf_counter()
        for i in range(steps):
            await step(i)
        return (time.perf_counter() - start) / steps * 1e6

    if await step(7) != [7] * len(conns):
        raise RuntimeError("an echo server answered with the wrong value")
    await once()  # warm-up
    samples = [await once() for _ in range(reps)]
    for c in conns:
        c.transport.close()
    return samples


def main() -> None:
    cases = sorted(tuple(int(v) for v in c.split(":")) for c in sys.argv[1].split(","))
    reps = int(sys.argv[2])
    servers: list[tuple[subprocess.Popen[str], int]] = []
    out: dict[str, Any] = {}
    try:
        for n, steps in cases:
            servers += _start_servers(n - len(servers))
            rss = [_rss(p.pid) for p, _ in servers[:n]]
            samples = uvloop.run(_measure([port for _, port in servers[:n]], steps, reps))
            out[str(n)] = {
                "median": statistics.median(samples),
                "min": min(samples),
                "max": max(samples),
                "worker_rss": statistics.median(r for r, _ in rss),
                "worker_pss": statistics.median(p for _, p in rss),
                "steps": steps,
                "reps": reps,
            }
            print(f"limit N={n}: {out[str(n)]['median']:,.0f} us/step", file=sys.stderr)
    finally:
        for proc, _ in servers:
            proc.kill()
        for proc, _ in servers:
            proc.wait()
    out["_versions"] = {
        "uvloop": uvloop.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
