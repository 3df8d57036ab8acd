"""How long the greedy circuit planner takes, per cluster size.

    python bench/_planner_time.py [--accelerators 1024 8192] [--per-host 8]
                                  [--hosts-per-tor 16] [--ports 16] [--reps 7]

Endpoints are ToRs: accelerators / per-host / hosts-per-tor of them, each with ``--ports`` OCS
ports, any pair wired. Three demands per size: a dense random matrix (every ToR pair), an
all-to-all and a ring all-reduce over every accelerator (1 GiB per member); each planned from
no circuits ("fresh") and again with the fresh plan in place and the demand 1% higher
("replan"). A time is one ``GreedyPlanner().plan()`` call end to end (indexing, greedy,
repair, decision), the median of ``--reps`` with min and max, in ms. Targets: under 100 ms for
1,024 accelerators, under 1 s for 8,192. ``--hosts-per-tor 1`` makes every host an endpoint,
the stress case (8,192 accelerators: 1,024 endpoints, 523,776 pairs).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Mapping

import orchestr
from orchestr.fabric.optical import (
    Circuit,
    GreedyPlanner,
    Installed,
    PlanRequest,
    collective_demand,
)

GiB = float(1 << 30)


def machine() -> str:
    load = os.getloadavg()
    return (
        f"{platform.node()} | {os.cpu_count()} cores | load {load[0]:.2f} {load[1]:.2f} | "
        f"Python {platform.python_version()} | orchestr {orchestr.__version__}"
    )


def demands(tors: list[str], per_tor: int) -> dict[str, dict[tuple[str, str], float]]:
    rng = random.Random(len(tors))
    members = dict.fromkeys(tors, per_tor)
    return {
        "dense random": {(u, v): rng.random() * GiB for u in tors for v in tors if u != v},
        "all_to_all": collective_demand("all_to_all", members, GiB),
        "ring all_reduce": collective_demand("all_reduce", members, GiB),
    }


def timed(req: PlanRequest, reps: int) -> tuple[list[float], int]:
    planner = GreedyPlanner()
    times, circuits = [], 0
    for _ in range(reps):
        start = time.perf_counter()
        plan = planner.plan(req)
        times.append((time.perf_counter() - start) * 1e3)
        circuits = len(plan.target)
    return times, circuits


def row(label: str, times: list[float], circuits: int) -> str:
    return (
        f"  {label:<28} {statistics.median(times):9.2f} ms  "
        f"(min {min(times):.2f}, max {max(times):.2f})  {circuits} circuits"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--accelerators", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--per-host", type=int, default=8)
    parser.add_argument("--hosts-per-tor", type=int, default=16)
    parser.add_argument("--ports", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    out = sys.stdout
    out.write(machine() + "\n")
    for accelerators in args.accelerators:
        per_tor = args.per_host * args.hosts_per_tor
        tors = [f"tor{i:04d}" for i in range(max(1, accelerators // per_tor))]
        out.write(
            f"{accelerators} accelerators: {len(tors)} ToRs x {per_tor} accelerators, "
            f"{args.ports} OCS ports each\n"
        )
        budgets: Mapping[str, int] = dict.fromkeys(tors, args.ports)
        for name, demand in demands(tors, per_tor).items():
            fresh = PlanRequest(
                demand=demand, budgets=budgets, circuit_gbps=400, electrical_gbps=100, now=0.0
            )
            times, circuits = timed(fresh, args.reps)
            out.write(row(f"{name}, fresh", times, circuits) + "\n")
            in_place = GreedyPlanner().plan(fresh).target
            replan = PlanRequest(
                demand={pair: nbytes * 1.01 for pair, nbytes in demand.items()},
                budgets=budgets,
                circuit_gbps=400,
                electrical_gbps=100,
                now=3600.0,
                current=[Installed(Circuit(c.a, c.b), 0.0) for c in in_place],
            )
            times, circuits = timed(replan, args.reps)
            out.write(row(f"{name}, replan", times, circuits) + "\n")


if __name__ == "__main__":
    main()
