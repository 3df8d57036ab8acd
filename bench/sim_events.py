"""How fast the simulator's clock turns: events per second of ``orchestr.sim`` against a bare
heap (the limit), asyncio's own timers and SimPy, on one workload.

    python bench/sim_events.py [--events N] [--chains C] [--peers simpy|none]

The workload (``bench/peers/_event_workload.py``): ``C`` chains (default 1,000) of timed
waits, ``N`` waits in all (default 1,000,000); each wait's end schedules the chain's next.
Every system runs the same delays (exponential, mean 1 ms) on one core:

- **heap** (the limit): ``heapq`` of ``(time_ns, seq, chain, k)`` tuples and a call per event,
  nothing else;
- **engine**: :class:`orchestr.sim.Engine`, a callback per event (``Engine.at``);
- **loop_timers**: ``call_at`` chains on :class:`orchestr.sim.VirtualLoop` (asyncio's timer
  handles on the engine);
- **loop_tasks**: one asyncio task per chain awaiting ``asyncio.sleep`` on the virtual loop
  (what async control code costs per wait);
- **asyncio_timers**: ``call_at`` chains on asyncio's own loop, every instant already past so
  nothing waits (its timer heap and loop turns alone);
- **simpy** (``--peers simpy``, the default): SimPy 4 processes yielding timeouts, in a venv
  of its own (``bench/.venvs/simpy``).

Measured here (one run, 1,000,000 events): heap 0.48 s per million, engine 0.90 (0.54x the
heap, 1.07x SimPy's speed), loop_timers 2.49, loop_tasks 5.74, asyncio_timers 1.46, SimPy
0.96. The engine's events are lists compared in C (objects with a Python ``__lt__`` ran 1.79 s
per million); the virtual loop's cost is asyncio's own handles and tasks.

Prints seconds per million events and ratios, then one JSON line
``{"heap": {...}, "engine": {...}, ..., "_meta": {...}}`` with ``seconds``, ``events``,
``events_per_s`` and ``s_per_million`` for each.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))

from _event_workload import DELAYS, MASK  # noqa: E402
from _venvs import SIMPY_REQUIREMENTS, ensure_venv  # noqa: E402

from orchestr.sim import Engine, Simulation, ns  # noqa: E402

DELAYS_NS = [ns(d) for d in DELAYS]


def heap(events: int, chains: int) -> float:
    per = events // chains
    q: list[tuple[int, int, int, int]] = []
    seq = 0
    for c in range(chains):
        seq += 1
        q.append((DELAYS_NS[(c * 31) & MASK], seq, c, 0))
    heapq.heapify(q)

    def tick(now: int, c: int, k: int) -> None:
        nonlocal seq
        if k + 1 < per:
            seq += 1
            heapq.heappush(q, (now + DELAYS_NS[(c * 31 + k + 1) & MASK], seq, c, k + 1))

    began = time.perf_counter()
    while q:
        now, _, c, k = heapq.heappop(q)
        tick(now, c, k)
    return time.perf_counter() - began


def engine(events: int, chains: int) -> float:
    per = events // chains
    e = Engine()

    def tick(c: int, k: int) -> None:
        if k + 1 < per:
            e.at(e.now + DELAYS_NS[(c * 31 + k + 1) & MASK], tick, c, k + 1)

    for c in range(chains):
        e.at(DELAYS_NS[(c * 31) & MASK], tick, c, 0)
    began = time.perf_counter()
    e.run()
    return time.perf_counter() - began


def timers(loop: asyncio.AbstractEventLoop, events: int, chains: int, base: float) -> float:
    per = events // chains
    done = loop.create_future()
    left = [chains]

    def tick(when: float, c: int, k: int) -> None:
        if k + 1 < per:
            nxt = when + DELAYS[(c * 31 + k + 1) & MASK]
            loop.call_at(nxt, tick, nxt, c, k + 1)
            return
        left[0] -= 1
        if not left[0]:
            done.set_result(None)

    for c in range(chains):
        when = base + DELAYS[(c * 31) & MASK]
        loop.call_at(when, tick, when, c, 0)
    began = time.perf_counter()
    loop.run_until_complete(done)
    return time.perf_counter() - began


def loop_timers(events: int, chains: int) -> float:
    with Simulation() as sim:
        return timers(sim.loop, events, chains, 0.0)


def asyncio_timers(events: int, chains: int) -> float:
    loop = asyncio.new_event_loop()
    try:
        # every instant a day in the past: each timer is due at once, in heap order
        return timers(loop, events, chains, loop.time() - 86_400.0)
    finally:
        loop.close()


def loop_tasks(events: int, chains: int) -> float:
    per = events // chains

    async def chain(c: int) -> None:
        for k in range(per):
            await asyncio.sleep(DELAYS[(c * 31 + k) & MASK])

    async def main() -> None:
        await asyncio.gather(*(chain(c) for c in range(chains)))

    with Simulation() as sim:
        began = time.perf_counter()
        sim.run(main())
        return time.perf_counter() - began


def simpy(events: int, chains: int) -> float:
    python = ensure_venv("simpy", SIMPY_REQUIREMENTS)
    out = subprocess.run(
        [str(python), str(HERE / "peers" / "simpy_events.py"), "--events", str(events),
         "--chains", str(chains)],
        capture_output=True, text=True, check=True, timeout=1800,
    )  # fmt: skip
    seconds: float = json.loads(out.stdout.strip().splitlines()[-1])["seconds"]
    return seconds


SYSTEMS = {
    "heap": heap,
    "engine": engine,
    "loop_timers": loop_timers,
    "loop_tasks": loop_tasks,
    "asyncio_timers": asyncio_timers,
    "simpy": simpy,
}


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--chains", type=int, default=1000)
    parser.add_argument("--peers", default="simpy", choices=("simpy", "none"))
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of each system; its figures are the median's"
    )
    add_record_flag(parser)
    args = parser.parse_args()
    if args.events < args.chains or args.chains < 1 or args.repeats < 1:
        parser.error("--events must be at least --chains, which must be 1 or more, as --repeats")
    events = args.events // args.chains * args.chains
    out: dict[str, Any] = {}
    for name, run in SYSTEMS.items():
        if name == "simpy" and args.peers == "none":
            continue
        each = [run(events, args.chains) for _ in range(args.repeats)]
        seconds = statistics.median(each)
        out[name] = {
            "seconds": round(seconds, 4),
            "events": events,
            "events_per_s": round(events / seconds),
            "s_per_million": round(seconds * 1e6 / events, 3),
        }
        if args.repeats > 1:  # every run's, beside the median's
            out[name]["s_per_million_values"] = [round(s * 1e6 / events, 3) for s in each]
            out[name]["events_per_s_values"] = [round(events / s) for s in each]
        print(f"[sim_events] {name}: {out[name]['s_per_million']} s per million events",
              file=sys.stderr, flush=True)  # fmt: skip
    limit = out["heap"]["seconds"]
    print(f"{'system':<16}{'s/million':>11}{'events/s':>12}{'vs heap':>9}{'vs simpy':>10}")
    for name, r in out.items():
        vs_simpy = f"{out['simpy']['seconds'] / r['seconds']:9.2f}x" if "simpy" in out else "-"
        print(f"{name:<16}{r['s_per_million']:>11}{r['events_per_s']:>12}"
              f"{limit / r['seconds']:>8.2f}x{vs_simpy:>10}")  # fmt: skip
    print("vs heap: the bare heap's time over the system's (1.00x is the limit); vs simpy: how "
          "many times faster than SimPy")  # fmt: skip
    out["_meta"] = {
        "chains": args.chains,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    print(json.dumps(out))
    if args.record:
        record("sim_events", out, peers=["simpy"] if "simpy" in out else [])


if __name__ == "__main__":
    main()
