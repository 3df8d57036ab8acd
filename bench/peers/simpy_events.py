"""SimPy on ``bench/sim_events.py``'s workload: each chain a process yielding timeouts.

    bench/.venvs/simpy/bin/python bench/peers/simpy_events.py --events N --chains C

Prints one JSON line: ``{"seconds": ..., "events": ..., "end_time": ...}``."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import simpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _event_workload import delay


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--chains", type=int, default=1000)
    args = parser.parse_args()
    per_chain = args.events // args.chains
    env = simpy.Environment()

    def chain(c: int):  # type: ignore[no-untyped-def]
        for k in range(per_chain):
            yield env.timeout(delay(c, k))

    for c in range(args.chains):
        env.process(chain(c))
    began = time.perf_counter()
    env.run()
    seconds = time.perf_counter() - began
    print(json.dumps({"seconds": seconds, "events": per_chain * args.chains, "end_time": env.now}))


if __name__ == "__main__":
    main()
