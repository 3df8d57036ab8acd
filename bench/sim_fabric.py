"""The fabric simulator against ``bench/fabric.py``'s emulation: the same phases (a binomial-tree
weight sync and an all-to-all, twice) on the static network and with the fabric manager laying
circuits, on network-namespace hosts and on virtual time, with the signed error of each phase
time beside the real runs' spread.

    sudo .venv/bin/python bench/sim_fabric.py [--reps 5] [--hosts 4] [--mib 32]
                                              [--electrical-mbit 50] [--circuit-mbit 400]
                                              [--save PATH]

**Real:** ``bench/fabric.py``'s ``emulate`` (its fabric, phases, manager and policy; see its
docstring): the reconfiguration cost of the ``netns`` OCS driver is measured first, then
``--reps`` sequences on each fabric, every flow a TCP stream of orchestr's transport.

**Calibrated, at idle, before the sequences:** one flow alone on the static network, whose
rate over the shaped one is the ``goodput`` share the links carry (the shaping counts each
packet's headers; the payload is what arrives). The reconfiguration cost is the emulation's own
measurement (a fixed part and a part per OCS port changed).

**Simulated:** the real ``FabricManager`` (the same cabling plan, policy and measured
``ReconfigCost``; its OCS a ``SimOcs`` that takes the measured fixed cost, plus the per-port
cost for each port a program changes) and the flow model (``orchestr.sim.FlowNet``) carrying
every step's flows, max-min fair, on the links the emulation shapes: each host's way to the
bridge at the electrical rate (a ToR's uplink here: each host is alone under its ToR), each
circuit at the circuit rate, both at the goodput share. Ingress is not shaped in the
emulation; in these phases no host receives more than its senders may send, so the flow
model's ingress links at the electrical rate change nothing.

Metrics per fabric and phase, the medians over the sequences' two cycles: the transfer time,
and with circuits the time of the hints before the phase's steps (``reconfig_s``: plan and
apply). ``error`` = sim / real median - 1. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _fabric_flows import Flow, digest_of, run_flows  # noqa: E402
from _fabric_phases import PHASES, demand, phase_steps, topology_dict, tor_names  # noqa: E402
from _fabric_report import PhaseRun  # noqa: E402

import fabric as emulation  # noqa: E402  (bench/fabric.py)
from orchestr._log import configure_logging  # noqa: E402
from orchestr.fabric.optical import (  # noqa: E402
    FabricManager,
    Hint,
    NetnsFabric,
    ReconfigCost,
    RecordingRouter,
    SimOcs,
    netns_missing,
    topology_from_dict,
)
from orchestr.sim import FlowNet, Simulation  # noqa: E402
from orchestr.sim._cluster import circuits_of  # noqa: E402

MiB = 1 << 20


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class PricedOcs(SimOcs):
    """A simulated OCS priced as the ``netns`` driver measured: ``cost.fixed_s`` a program
    (the switch's latency) and ``cost.per_change_s`` for each port it changes."""

    def __init__(self, radix: int, cost: ReconfigCost) -> None:
        super().__init__(radix, latency=cost.fixed_s, rng=0)
        self.per_change_s = cost.per_change_s

    async def program(
        self, generation: int, connect: Sequence[Any], disconnect: Sequence[Any]
    ) -> None:
        ports = {p for c in (*connect, *disconnect) for p in c}
        await asyncio.sleep(self.per_change_s * len(ports))
        await super().program(generation, connect, disconnect)


def host(tor: str) -> str:
    return f"h{tor.removeprefix('tor')}"


def flow_topology(n: int, electrical_gbps: float, circuit_gbps: float) -> Any:
    """The links the emulation shapes, for the flow model: the plan's, with the hosts' NICs
    unshaped (the circuit rate: a circuit is a link of its own there, not through the NIC
    that reaches the bridge)."""
    plan = topology_dict(n, electrical_gbps, circuit_gbps, {})
    for h in plan["hosts"]:
        h["nics"][0]["gbps"] = max(electrical_gbps, circuit_gbps)
    return topology_from_dict(plan)


def simulate(n: int, nbytes: int, e_gbps: float, c_gbps: float, cost: ReconfigCost,
             goodput: float, managed: bool) -> list[PhaseRun]:  # fmt: skip
    """Two cycles of the phases on virtual time, with the manager if ``managed``."""
    tors = tor_names(n)
    latency = {"control_ms": cost.fixed_s * 1e3, "switch_ms": cost.per_change_s * 1e3,
               "settle_ms": 0.0, "concurrency": 1}  # fmt: skip
    plan = topology_from_dict(topology_dict(n, e_gbps, c_gbps, latency))
    links = flow_topology(n, e_gbps * goodput, c_gbps * goodput)
    with Simulation() as sim:
        net = FlowNet.of_topology(sim.engine, links, ecmp=False)

        async def moved(flows: list[Flow]) -> None:
            loop = asyncio.get_running_loop()
            waits = []
            for f in flows:
                done: asyncio.Future[None] = loop.create_future()
                net.send(host(f.src), host(f.dst), f.nbytes, lambda d=done: d.set_result(None))
                waits.append(done)
            await asyncio.gather(*waits)

        async def sequence() -> list[PhaseRun]:
            fm = None
            if managed:
                fm = FabricManager(plan, {"ocs0": PricedOcs(n, cost)}, RecordingRouter(),
                                   policy=emulation.POLICY, reconfig_cost=cost)  # fmt: skip
            runs = []
            for phase in PHASES:
                run = PhaseRun(phase)
                for k, flows in enumerate(phase_steps(phase, tors, nbytes), 1):
                    if fm is not None:
                        began = sim.engine.seconds
                        await fm.hint(Hint("bench", f"{phase}/{k}", demand(flows)))
                        run.reconfig_s += sim.engine.seconds - began
                        net.set_circuits({p: g * goodput for p, g in circuits_of(fm).items()})
                    began = sim.engine.seconds
                    await moved(flows)
                    run.transfer_s += sim.engine.seconds - began
                runs.append(run)
            return runs

        out: list[PhaseRun] = sim.run(sequence())
        return out


def medians(runs: list[PhaseRun], managed: bool) -> dict[str, float]:
    out = {}
    for phase in dict.fromkeys(PHASES):
        mine = [r for r in runs if r.phase == phase]
        out[f"{phase}_s"] = statistics.median(r.transfer_s for r in mine)
        if managed:
            out[f"{phase}_reconfig_s"] = statistics.median(r.reconfig_s for r in mine)
    return out


def spread(runs: list[PhaseRun], managed: bool) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for phase in dict.fromkeys(PHASES):
        mine = [r for r in runs if r.phase == phase]
        metrics = {f"{phase}_s": [r.transfer_s for r in mine]}
        if managed:
            metrics[f"{phase}_reconfig_s"] = [r.reconfig_s for r in mine]
        for name, xs in metrics.items():
            out[name] = {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4),
                         "max": round(max(xs), 4)}  # fmt: skip
    return out


async def goodput_probe(setup: Any, reps: int = 3) -> float:
    """One flow alone on the static network: its rate over the shaped rate (median of
    ``reps``)."""
    flow = Flow(setup.tors[0], setup.tors[1], 0, setup.nbytes)
    shares = []
    for _ in range(reps):
        seconds = await run_flows(setup.fabric, [flow], setup.payload, [setup.digests[flow]],
                                  10 * setup.nbytes / setup.electrical_bps + 60)  # fmt: skip
        shares.append(setup.nbytes / seconds / setup.electrical_bps)
    return statistics.median(shares)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="sequences per fabric")
    parser.add_argument("--hosts", type=int, default=4, help="namespace hosts (even, 4-16)")
    parser.add_argument("--mib", type=int, default=32, help="weights in MiB")
    parser.add_argument("--calibrate", type=int, default=3, help="reconfiguration rounds")
    parser.add_argument("--electrical-mbit", type=float, default=50.0)
    parser.add_argument("--circuit-mbit", type=float, default=400.0)
    parser.add_argument("--save", default=None, help="also write the JSON here")
    args = parser.parse_args()
    if args.hosts < 4 or args.hosts > 16 or args.hosts % 2:
        parser.error("--hosts takes an even number from 4 to 16")
    if min(args.reps, args.mib, args.calibrate) < 1:
        parser.error("--reps, --mib and --calibrate take positive numbers")
    why = netns_missing()
    if why is not None:
        sys.exit(f"bench/sim_fabric.py: {why}; run it as root")
    configure_logging(json=False, level="WARNING")
    nbytes = args.mib * MiB
    tors = tor_names(args.hosts)
    payload = random.Random(7).randbytes(nbytes)
    e_gbps, c_gbps = args.electrical_mbit / 1e3, args.circuit_mbit / 1e3
    fab = NetnsFabric(tors, electrical_mbit=args.electrical_mbit, circuit_mbit=args.circuit_mbit)
    with fab:
        flows = {f for p in set(PHASES) for step in phase_steps(p, tors, nbytes) for f in step}
        setup = emulation.Setup(
            fab, tors, nbytes, payload, {f: digest_of(payload, f) for f in flows},
            args.electrical_mbit * 1e6 / 8, args.circuit_mbit * 1e6 / 8,
        )  # fmt: skip

        async def both() -> tuple[float, dict[str, Any]]:
            log("goodput: one flow alone on the static network")
            share = await goodput_probe(setup)
            log(f"goodput: {share:.3f} of the shaped rate")
            return share, await emulation.emulate(setup, args.reps, args.calibrate)

        goodput, real = asyncio.run(both())
    cost = real["cost"]
    log(f"simulating (reconfiguration {cost.fixed_s:.3f} s + {cost.per_change_s:.3f} s a port)")
    out: dict[str, Any] = {"goodput": round(goodput, 4),
                           "reconfig_cost": {"fixed_s": cost.fixed_s,
                                             "per_change_s": cost.per_change_s}}  # fmt: skip
    for fabric, managed in (("static", False), ("circuits", True)):
        sim = medians(simulate(args.hosts, nbytes, e_gbps, c_gbps, cost, goodput, managed), managed)
        entry: dict[str, Any] = {"real": spread(real[fabric], managed), "sim": {}, "error": {}}
        for metric, value in sim.items():
            entry["sim"][metric] = round(value, 4)
            med = entry["real"][metric]["median"]
            entry["error"][metric] = round(value / med - 1, 4) if med else None
        out[fabric] = entry
    out["_meta"] = {"hosts": args.hosts, "weights_mib": args.mib, "reps": args.reps,
                    "electrical_mbit": args.electrical_mbit, "circuit_mbit": args.circuit_mbit}  # fmt: skip
    print(
        f"{'fabric':<9} {'metric':<24} {'real p50':>9} {'min':>9} {'max':>9} {'sim':>9} {'error':>8}"
    )
    for fabric in ("static", "circuits"):
        for metric, real_m in out[fabric]["real"].items():
            err = out[fabric]["error"][metric]
            print(f"{fabric:<9} {metric:<24} {real_m['median']:>9.3f} {real_m['min']:>9.3f} "
                  f"{real_m['max']:>9.3f} {out[fabric]['sim'][metric]:>9.3f} "
                  f"{'-' if err is None else format(err, '+.1%'):>8}")  # fmt: skip
    line = json.dumps(out)
    if args.save:
        Path(args.save).write_text(line + "\n", encoding="utf-8")
    print(line)


if __name__ == "__main__":
    main()
