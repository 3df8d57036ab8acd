"""Weight sync and all-to-all on an emulated fabric, static electrical network vs phase-aware
optical circuits in one run; and the circuit planner's run time for 1,024 and 8,192
accelerators.

    sudo .venv/bin/python bench/fabric.py [--quick] [--hosts N] [--mib S] [--reps R]
                                          [--electrical-mbit E] [--circuit-mbit C]

**Fabric.** ``NetnsFabric``: N (default 4) namespace hosts on a bridge, each ``eth0`` shaped to
``E`` Mbit/s (default 50) egress: the static electrical network. Circuits are direct veth links
shaped to ``C`` Mbit/s (default 400), made by the ``netns`` OCS driver (``NetnsOcs``) and
routed onto by ``NetnsRouter``. The manager's cabling plan (``_fabric_phases.topology_dict``)
puts host ``h_i`` alone under ``tor_i``, the ToRs under one aggregation switch, and OCS port
``i`` on ``tor_i``'s uplink; the namespace hosts are named after the ToRs, so the manager's
switch pairs are the router's host pairs. One OCS port per ToR: at most N/2 circuits at once.

**Phases.** The sequence weight_sync, all_to_all, weight_sync, all_to_all (two cycles) runs
once on the static fabric and once with a ``FabricManager`` that gets a hint before every step
and plans, commits and applies circuits (reserve, drain, program, verify, undrain) itself.

- weight_sync: the trainer (``tor0``) broadcasts S bytes (default 32 MiB; 8 with ``--quick``)
  to the other hosts, the generators, as a **binomial tree**: in step k every host that has the
  weights sends all S to the host 2^k further on (4 hosts: tor0->tor1, then tor0->tor2 and
  tor1->tor3). Each step is a matching, the one shape a one-port-per-ToR OCS can carry whole;
  a parallel fan-out or a pipelined chain puts more than one busy pair on the trainer's ToR,
  where the planner finds no free port and commits nothing. The same tree runs on both fabrics;
  on the static one a pipelined chain would do better (the "floor" limit below), so that floor
  is printed and the circuits are compared with it too.
- all_to_all: every host sends S/N bytes to every other host at once (N(N-1) flows).

Every flow is one ``tcp://`` stream of orchestr's transport between two namespace hosts, each
end in a thread inside its namespace; every receiver's SHA-256 is checked. A phase's time is
the transfers only (from the start of a step's flows to the last end of stream, summed over
steps); its reconfiguration overhead is the wall time of the hints before its steps (plan and
apply; the steps are in the printed plan records). Circuits total = transfer + overhead.

**Decisions.** ``CommitPolicy(hysteresis=0.5, min_dwell_s=0)``: the manager's hysteresis;
no dwell, as the phases alternate within seconds (the default 30 s would freeze the first
circuits). The ``ReconfigCost`` is measured first, not assumed: a manager that commits
anything sets up one circuit (2 ports change) and swaps it for two (4 ports), ``--calibrate``
times (3; 1 with ``--quick``); fixed and per-port costs are fitted through the medians.

**Limits.** What the shaping alone allows: the busiest of each host's bridge egress (one token
bucket for all its flows) and each circuit end, with the circuits that were live; ingress is
not shaped. Static weight_sync also gets the floor of any broadcast, S/E.

**Planner.** ``GreedyPlanner().plan`` on the demands of ``bench/_planner_time.py`` (dense
random, all-to-all, ring all-reduce; fresh and replanned) at 1,024 and 8,192 accelerators, 8
per host, 16 OCS ports per ToR, with 16 hosts per ToR and with 1 (every host its own endpoint,
the stress case); ``ms_1024``/``ms_8192`` are the worst median of them all. Targets: under 100
ms and under 1 s.

Each figure is the median over R reps x 2 cycles (R = 3; 1 with ``--quick``) with min and
max; the load printed before and after says how much else ran. Progress goes to stderr; the
last line of stdout is one JSON object ``{"static": {...}, "circuits": {...}, "planner":
{...}, "ratios": {...}, "limits": {...}, "config": {...}, "plans": [...]}``: ``static`` and
``circuits`` have ``weight_sync_s`` and ``all_to_all_s`` (transfers); ``circuits`` also
``reconfig_overhead_s`` (hint wall time per cycle, a weight_sync and the all_to_all after it),
``per_reconfiguration_s`` (one applied hint) and ``<phase>_reconfig_s`` / ``<phase>_total_s``;
``planner`` has ``ms_1024`` and ``ms_8192``; ``ratios`` are static / (circuits + overhead);
``plans`` are the hints of the first sequence with the manager. Needs root; the namespaces
are deleted at the end, also on errors, SIGTERM and Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import os
import platform
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _fabric_flows import Flow, digest_of, run_flows
from _fabric_phases import (
    PHASES,
    demand,
    limit_s,
    phase_steps,
    topology_dict,
    tor_names,
)
from _fabric_report import PhaseRun, report
from _planner_time import demands, timed

import orchestr as oc
from orchestr._log import configure_logging
from orchestr.fabric.optical import (
    CommitPolicy,
    FabricManager,
    GreedyPlanner,
    Hint,
    Installed,
    NetnsFabric,
    NetnsOcs,
    NetnsRouter,
    PlanRecord,
    PlanRequest,
    ReconfigCost,
    Topology,
    netns_missing,
    topology_from_dict,
)

MiB = 1 << 20
POLICY = CommitPolicy(hysteresis=0.5, min_dwell_s=0.0)


def log(message: str) -> None:
    print(f"[fabric] {message}", file=sys.stderr, flush=True)


def machine() -> str:
    load = os.getloadavg()
    return (
        f"{platform.node()} | {os.cpu_count()} cores | load {load[0]:.2f} {load[1]:.2f} | "
        f"Python {platform.python_version()} | orchestr {oc.__version__} | "
        f"{platform.system()} {platform.release()}"
    )


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # unwinds to the fabric's close


@dataclasses.dataclass(frozen=True)
class Setup:
    fabric: NetnsFabric
    tors: list[str]
    nbytes: int
    payload: bytes
    digests: dict[Flow, str]
    electrical_bps: float
    circuit_bps: float


def _manager(
    setup: Setup, topology: Topology, cost: ReconfigCost, policy: CommitPolicy
) -> FabricManager:
    drivers = {"ocs0": NetnsOcs(setup.fabric, setup.tors)}
    return FabricManager(
        topology,
        drivers,
        NetnsRouter(setup.fabric),
        policy=policy,
        reconfig_cost=cost,
        step_timeout_s=30.0,
    )


def _summary(record: PlanRecord, wall_s: float, live: list[list[str]]) -> dict[str, Any]:
    return {
        "phase": record.phase,
        "commit": record.commit,
        "status": record.status,
        "add": [list(r) for r in record.add],
        "remove": [list(r) for r in record.remove],
        "keep": [list(r) for r in record.keep],
        "live": live,
        "wall_s": wall_s,
        "timings": dict(record.timings),
        "predicted_s_static": record.predicted_s_static,
        "predicted_s_with": record.predicted_s_with,
        "reconfig_cost_s": record.reconfig_cost_s,
        "reason": record.reason,
    }


async def calibrate(setup: Setup, rounds: int) -> tuple[ReconfigCost, dict[str, Any]]:
    """What one reconfiguration of the netns driver costs, hint to routes back on circuits."""
    t = setup.tors
    # rates hardly matter here: at zero cost and no hysteresis any saving commits
    topology = topology_from_dict(topology_dict(len(t), 1.0, 8.0, {}))
    hints = [
        Hint("calibrate", "one", {(t[0], t[1]): 1e9}),
        Hint("calibrate", "swap", {(t[0], t[2]): 1e9, (t[1], t[3]): 1e9}),
    ]
    samples: list[list[tuple[int, float]]] = [[], []]
    eager = CommitPolicy(hysteresis=0.0, min_dwell_s=0.0)
    for _ in range(rounds):
        manager = _manager(setup, topology, ReconfigCost(0.0, 0.0), eager)
        try:
            for hint, out in zip(hints, samples, strict=True):
                changes = manager.plan(hint).port_changes
                start = time.monotonic()
                record = await manager.hint(hint)
                out.append((changes, time.monotonic() - start))
                if record.status != "applied":
                    raise RuntimeError(
                        f"calibration {hint.phase}: {record.status}: {record.reason}"
                    )
        finally:
            await asyncio.to_thread(setup.fabric.disconnect_all)
    (c1, w1), (c2, w2) = ((s[0][0], statistics.median(w for _, w in s)) for s in samples)
    per_change = max(0.0, (w2 - w1) / (c2 - c1))
    fixed = max(0.0, w1 - per_change * c1)
    info = {"one_circuit_s": w1, "swap_to_two_s": w2, "port_changes": [c1, c2], "rounds": rounds}
    return ReconfigCost(fixed_s=fixed, per_change_s=per_change), info


async def run_sequence(
    setup: Setup, manager: FabricManager | None, timeout_s: float
) -> list[PhaseRun]:
    """PHASES once; with ``manager``, a hint (plan and apply) before every step."""
    runs = []
    for phase in PHASES:
        run = PhaseRun(phase)
        for k, flows in enumerate(phase_steps(phase, setup.tors, setup.nbytes), 1):
            live: list[list[str]] = []
            if manager is not None:
                start = time.monotonic()
                record = await manager.hint(Hint("bench", f"{phase}/{k}", demand(flows)))
                wall = time.monotonic() - start
                run.reconfig_s += wall
                live = [[c.a, c.b] for c in manager.circuits()]
                run.plans.append(_summary(record, wall, live))
                if record.commit and record.status != "applied":
                    raise RuntimeError(f"{phase}/{k}: {record.status}: {record.reason}")
            pairs = [(a, b) for a, b in live]
            run.limit_s += limit_s(flows, pairs, setup.electrical_bps, setup.circuit_bps)
            digests = [setup.digests[f] for f in flows]
            run.transfer_s += await run_flows(
                setup.fabric, flows, setup.payload, digests, timeout_s
            )
        runs.append(run)
    return runs


async def emulate(setup: Setup, reps: int, rounds: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(4 * len(setup.tors) + 8))
    fab = setup.fabric
    log(f"calibrating the reconfiguration cost ({rounds} round(s))")
    cost, calibration = await calibrate(setup, rounds)
    log(f"reconfiguration cost: {cost.fixed_s:.3f} s + {cost.per_change_s:.3f} s per port change")
    latency = {"control_ms": cost.fixed_s * 1e3, "switch_ms": cost.per_change_s * 1e3,
               "settle_ms": 0.0, "concurrency": 1}  # fmt: skip
    e_gbps, c_gbps = fab.electrical_mbit / 1e3, fab.circuit_mbit / 1e3
    topology = topology_from_dict(topology_dict(len(setup.tors), e_gbps, c_gbps, latency))
    worst = setup.nbytes * len(setup.tors) / setup.electrical_bps
    timeout_s = 10 * worst + 60
    static: list[PhaseRun] = []
    circuits: list[PhaseRun] = []
    for rep in range(1, reps + 1):
        if await asyncio.to_thread(fab.circuits):
            raise RuntimeError("circuits left over before a static run; routes would differ")
        log(f"rep {rep}/{reps}: static fabric")
        static += await run_sequence(setup, None, timeout_s)
        log(f"rep {rep}/{reps}: with the fabric manager")
        manager = _manager(setup, topology, cost, POLICY)
        try:
            circuits += await run_sequence(setup, manager, timeout_s)
        finally:
            await asyncio.to_thread(fab.disconnect_all)
    return {"static": static, "circuits": circuits, "cost": cost, "calibration": calibration}


def planner_times(reps: int) -> list[dict[str, Any]]:
    """GreedyPlanner run times (ms) on bench/_planner_time.py's demands."""
    rows = []
    for hosts_per_tor in (16, 1):
        for accelerators in (1024, 8192):
            per_tor = 8 * hosts_per_tor
            tors = [f"tor{i:04d}" for i in range(max(1, accelerators // per_tor))]
            budgets = dict.fromkeys(tors, 16)
            for name, dem in demands(tors, per_tor).items():
                fresh = PlanRequest(
                    demand=dem, budgets=budgets, circuit_gbps=400, electrical_gbps=100, now=0.0
                )
                times, count = timed(fresh, reps)
                in_place = [Installed(c, 0.0) for c in GreedyPlanner().plan(fresh).target]
                replan = dataclasses.replace(
                    fresh,
                    demand={pair: b * 1.01 for pair, b in dem.items()},
                    now=3600.0,
                    current=in_place,
                )
                again, _ = timed(replan, reps)
                for case, ms in (("fresh", times), ("replan", again)):
                    rows.append(
                        {
                            "accelerators": accelerators,
                            "endpoints": len(tors),
                            "hosts_per_tor": hosts_per_tor,
                            "demand": name,
                            "case": case,
                            "median_ms": statistics.median(ms),
                            "min_ms": min(ms),
                            "max_ms": max(ms),
                            "circuits": count,
                        }
                    )
            log(f"planner: {accelerators} accelerators, {len(tors)} endpoints done")
    return rows


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 MiB, 1 rep, 1 calibration")
    parser.add_argument("--hosts", type=int, default=4, help="namespace hosts (even, 4-16)")
    parser.add_argument("--mib", type=int, default=None, help="weights in MiB (32; quick 8)")
    parser.add_argument("--reps", type=int, default=None, help="sequences per fabric (3; quick 1)")
    parser.add_argument("--calibrate", type=int, default=None, help="calibration rounds")
    parser.add_argument("--electrical-mbit", type=float, default=50.0)
    parser.add_argument("--circuit-mbit", type=float, default=400.0)
    add_record_flag(parser)
    args = parser.parse_args()
    if args.hosts < 4 or args.hosts > 16 or args.hosts % 2:
        parser.error("--hosts takes an even number from 4 to 16")
    nbytes = (args.mib or (8 if args.quick else 32)) * MiB
    reps = args.reps or (1 if args.quick else 3)
    rounds = args.calibrate or (1 if args.quick else 3)
    if nbytes <= 0 or reps < 1 or rounds < 1:
        parser.error("--mib, --reps and --calibrate take positive numbers")
    why = netns_missing()
    if why is not None:
        sys.exit(f"bench/fabric.py: {why}; run it as root: sudo .venv/bin/python bench/fabric.py")
    configure_logging(json=False, level="WARNING")
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGHUP, _exit_on_signal)

    print(machine(), flush=True)
    started = time.monotonic()
    log("planner run times")
    planner = planner_times(3 if args.quick else 7)
    tors = tor_names(args.hosts)
    payload = random.Random(7).randbytes(nbytes)
    fabric = NetnsFabric(tors, electrical_mbit=args.electrical_mbit, circuit_mbit=args.circuit_mbit)
    with fabric:
        log(f"fabric {fabric.tag}: hosts {', '.join(f'{t} {fabric.address(t)}' for t in tors)}")
        flows = {f for p in set(PHASES) for step in phase_steps(p, tors, nbytes) for f in step}
        setup = Setup(
            fabric,
            tors,
            nbytes,
            payload,
            {f: digest_of(payload, f) for f in flows},
            args.electrical_mbit * 1e6 / 8,
            args.circuit_mbit * 1e6 / 8,
        )
        try:
            result = asyncio.run(emulate(setup, reps, rounds))
        except KeyboardInterrupt:
            fabric.close()
            sys.exit("bench/fabric.py: interrupted; the fabric's namespaces are deleted")
    left = fabric.leftovers()
    if left:
        log(f"namespaces left behind: {left}; delete them with `ip netns del NAME`")
    log(f"done in {time.monotonic() - started:.0f} s")
    print(machine(), flush=True)
    config = {
        "hosts": args.hosts,
        "weights_mib": nbytes // MiB,
        "reps": reps,
        "electrical_mbit": args.electrical_mbit,
        "circuit_mbit": args.circuit_mbit,
        "policy": dataclasses.asdict(POLICY),
    }
    out = report(config, result, planner, setup)
    print(json.dumps(out))
    if args.record:
        record("fabric", out)


if __name__ == "__main__":
    main()
