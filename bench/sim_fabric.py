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

**Calibrated, at idle, before the sequences:**

- ``goodput``: one flow alone on the static network; its rate over the shaped one is the share
  the links carry (the shaping counts each packet's headers; the payload is what arrives).
- ``sharing``: 1, 2, ... N-1 flows of an all-to-all's size leaving one host at once (one token
  bucket); what they carry together over what one carries alone. TCP flows through one bucket
  back off at its drops, and leave part of it unused.
- ``reverse_sharing``: one host exchanging a flow each way with 1, 2, ... N-1 others at once;
  the rate its link carries out over one flow's alone. The link then carries data out and the
  acknowledgements of the flows coming in, which wait behind the data in its bucket's queue.
- ``read_s``: one read of the ``netns`` switch's state (its links and their labels).
- The reconfiguration cost is the emulation's own measurement (a fixed part and a part per OCS
  port changed, each timed over a whole hint, the switch's reads included).

**Simulated:** the real ``FabricManager`` (the same cabling plan, policy and measured
``ReconfigCost``; its OCS a ``SimOcs`` whose reads take ``read_s`` and whose programs take the
rest of the measured cost: a committed hint's, for the ports it changes, less the reads such a
hint makes) and the flow model (``orchestr.sim.FlowNet``) carrying
every step's flows, max-min fair with the measured sharing, on the links the emulation
shapes: each host's way to the bridge at the electrical rate (a ToR's uplink here: each host
is alone under its ToR), each circuit at the circuit rate, both at the goodput share. Ingress
is not shaped in the emulation; in these phases no host receives more than its senders may
send, so the flow model's ingress links at the electrical rate change nothing.

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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _fabric_flows import Flow, digest_of, run_flows  # noqa: E402
from _fabric_phases import (  # noqa: E402
    PHASES,
    all_to_all_flows,
    demand,
    phase_steps,
    topology_dict,
    tor_names,
)
from _fabric_report import PhaseRun  # noqa: E402
from _sim_compare import compare, table  # noqa: E402

import fabric as emulation  # noqa: E402  (bench/fabric.py)
from orchestr._log import configure_logging  # noqa: E402
from orchestr.fabric.optical import (  # noqa: E402
    FabricManager,
    Hint,
    NetnsFabric,
    NetnsOcs,
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
    """A simulated OCS priced as the ``netns`` driver measured: ``read_s`` a read of its state,
    and a program what is left of a committed hint's measured cost (``cost``: a fixed part and
    a part for each port changed) once the ``reads`` such a hint makes are taken off."""

    def __init__(self, radix: int, cost: ReconfigCost, read_s: float, reads: int) -> None:
        super().__init__(radix, latency=0.0, rng=0, read_s=read_s)
        self.cost, self.reads_s = cost, reads * read_s

    async def program(
        self, generation: int, connect: Sequence[Any], disconnect: Sequence[Any]
    ) -> None:
        ports = {p for c in (*connect, *disconnect) for p in c}
        whole = self.cost.fixed_s + self.cost.per_change_s * len(ports)
        await asyncio.sleep(max(0.0, whole - self.reads_s))
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


def plan_of(n: int, e_gbps: float, c_gbps: float, cost: ReconfigCost) -> Any:
    latency = {"control_ms": cost.fixed_s * 1e3, "switch_ms": cost.per_change_s * 1e3,
               "settle_ms": 0.0, "concurrency": 1}  # fmt: skip
    return topology_from_dict(topology_dict(n, e_gbps, c_gbps, latency))


def reads_in_a_commit(n: int) -> int:
    """How many times a committed hint reads the switch back: one circuit made on virtual
    time by the real manager, over a switch whose reads take a second and programs none."""
    tors = tor_names(n)
    with Simulation() as sim:

        async def one() -> float:
            fm = FabricManager(plan_of(n, 1.0, 8.0, ReconfigCost(0.0, 0.0)),
                               {"ocs0": SimOcs(n, latency=0.0, rng=0, read_s=1.0)},
                               RecordingRouter(), policy=emulation.POLICY,
                               reconfig_cost=ReconfigCost(0.0, 0.0))  # fmt: skip
            record = await fm.hint(Hint("count", "one", {(tors[0], tors[1]): 1e9}))
            if record.status != "applied":
                raise RuntimeError(f"counting the reads: {record.status}: {record.reason}")
            return sim.engine.seconds

        return round(sim.run(one()))


def simulate(n: int, nbytes: int, e_gbps: float, c_gbps: float, cost: ReconfigCost,
             calibrated: dict[str, Any], managed: bool) -> list[PhaseRun]:  # fmt: skip
    """Two cycles of the phases on virtual time, with the manager if ``managed``."""
    tors = tor_names(n)
    goodput, read_s = calibrated["goodput"], calibrated["read_s"]
    plan = plan_of(n, e_gbps, c_gbps, cost)
    links = flow_topology(n, e_gbps * goodput, c_gbps * goodput)
    with Simulation() as sim:
        net = FlowNet.of_topology(sim.engine, links, ecmp=False, sharing=calibrated["sharing"],
                                  reverse_sharing=calibrated["reverse_sharing"])  # fmt: skip

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
                ocs = PricedOcs(n, cost, read_s, calibrated["reads_in_a_commit"])
                fm = FabricManager(plan, {"ocs0": ocs}, RecordingRouter(),
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


def per_run(runs: list[PhaseRun], managed: bool) -> list[dict[str, float]]:
    """The phases' times as one row of metrics per cycle (each phase occurs once a cycle)."""
    rows: list[dict[str, float]] = []
    for phase in dict.fromkeys(PHASES):
        mine = [r for r in runs if r.phase == phase]
        if not rows:
            rows = [{} for _ in mine]
        for row, r in zip(rows, mine, strict=True):
            row[f"{phase}_s"] = r.transfer_s
            if managed:
                row[f"{phase}_reconfig_s"] = r.reconfig_s
    return rows


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


async def sharing_probe(setup: Any, reps: int = 3) -> tuple[list[float], float]:
    """1, 2, ... N-1 of the all-to-all's flows leaving ``tors[0]`` at once: the rate they carry
    together over the rate of one alone (medians of ``reps``); and that one's rate."""
    mine = [f for f in all_to_all_flows(setup.tors, setup.nbytes) if f.src == setup.tors[0]]
    rates = []
    for k in range(1, len(mine) + 1):
        flows = mine[:k]
        got = []
        for _ in range(reps):
            seconds = await run_flows(setup.fabric, flows, setup.payload,
                                      [setup.digests[f] for f in flows],
                                      10 * k * flows[0].nbytes / setup.electrical_bps + 60)  # fmt: skip
            got.append(sum(f.nbytes for f in flows) / seconds)
        rates.append(statistics.median(got))
    return [min(1.0, r / rates[0]) for r in rates], rates[0]


async def reverse_probe(setup: Any, rate_one: float, reps: int = 3) -> list[float]:
    """``tors[0]`` exchanging a flow of the all-to-all's size each way with 1, 2, ... N-1 of
    the other hosts at once: the rate its link carries out over ``rate_one``, one flow's alone
    (medians of ``reps``). Its link then carries k flows out and the acknowledgements of k
    flows in, from k senders, as an all-to-all's links do; the others carry one each way."""
    hub, block = setup.tors[0], setup.nbytes // len(setup.tors)
    out = []
    for k in range(1, len(setup.tors)):
        peers = setup.tors[1 : k + 1]
        flows = [f for j, p in enumerate(peers, 1)
                 for f in (Flow(hub, p, j * block, block), Flow(p, hub, j * block, block))]  # fmt: skip
        digests = [digest_of(setup.payload, f) for f in flows]
        got = []
        for _ in range(reps):
            seconds = await run_flows(setup.fabric, flows, setup.payload, digests,
                                      20 * k * block / setup.electrical_bps + 60)  # fmt: skip
            got.append(k * block / seconds)
        out.append(min(1.0, statistics.median(got) / rate_one))
    return out


async def read_probe(setup: Any, reads: int = 20) -> float:
    """One read of the ``netns`` switch's state (median of ``reads``)."""
    ocs = NetnsOcs(setup.fabric, setup.tors)
    took = []
    for _ in range(reads):
        began = time.monotonic()
        await ocs.circuits()
        took.append(time.monotonic() - began)
    await ocs.aclose()
    return statistics.median(took)


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="sequences per fabric")
    parser.add_argument("--hosts", type=int, default=4, help="namespace hosts (even, 4-16)")
    parser.add_argument("--mib", type=int, default=32, help="weights in MiB")
    parser.add_argument("--calibrate", type=int, default=3, help="reconfiguration rounds")
    parser.add_argument("--electrical-mbit", type=float, default=50.0)
    parser.add_argument("--circuit-mbit", type=float, default=400.0)
    parser.add_argument("--save", default=None, help="also write the JSON here")
    add_record_flag(parser)
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

        async def both() -> tuple[dict[str, Any], dict[str, Any]]:
            log("goodput: one flow alone on the static network")
            share = await goodput_probe(setup)
            log(f"goodput: {share:.3f} of the shaped rate")
            log("sharing: 1.. flows leaving one host at once")
            sharing, rate_one = await sharing_probe(setup)
            log(f"sharing: {', '.join(f'{x:.3f}' for x in sharing)}")
            log("reverse sharing: one host exchanging a flow each way with 1.. others")
            reverse = await reverse_probe(setup, rate_one)
            log(f"reverse sharing: {', '.join(f'{x:.3f}' for x in reverse)}")
            read_s = await read_probe(setup)
            log(f"a read of the switch: {read_s * 1e3:.1f} ms")
            calibrated = {"goodput": share, "sharing": sharing, "reverse_sharing": reverse,
                          "read_s": read_s}  # fmt: skip
            return calibrated, await emulation.emulate(setup, args.reps, args.calibrate)

        calibrated, real = asyncio.run(both())
    cost = real["cost"]
    calibrated["reads_in_a_commit"] = reads_in_a_commit(args.hosts)
    log(f"simulating (reconfiguration {cost.fixed_s:.3f} s + {cost.per_change_s:.3f} s a port, "
        f"{calibrated['reads_in_a_commit']} reads of the switch in it)")  # fmt: skip
    out: dict[str, Any] = {"goodput": round(calibrated["goodput"], 4),
                           "sharing": [round(x, 4) for x in calibrated["sharing"]],
                           "reverse_sharing": [round(x, 4) for x in calibrated["reverse_sharing"]],
                           "read_s": round(calibrated["read_s"], 5),
                           "reads_in_a_commit": calibrated["reads_in_a_commit"],
                           "reconfig_cost": {"fixed_s": cost.fixed_s,
                                             "per_change_s": cost.per_change_s}}  # fmt: skip
    for fabric, managed in (("static", False), ("circuits", True)):
        sim = per_run(simulate(args.hosts, nbytes, e_gbps, c_gbps, cost, calibrated, managed),
                      managed)  # fmt: skip
        medians = {m: statistics.median(row[m] for row in sim) for m in sim[0]}
        out[fabric] = compare(per_run(real[fabric], managed), medians, digits=4)
    out["_meta"] = {"hosts": args.hosts, "weights_mib": args.mib, "reps": args.reps,
                    "electrical_mbit": args.electrical_mbit, "circuit_mbit": args.circuit_mbit}  # fmt: skip
    table({f: out[f] for f in ("static", "circuits")}, 10)
    line = json.dumps(out)
    if args.save:
        Path(args.save).write_text(line + "\n", encoding="utf-8")
    print(line)
    if args.record:  # the probes' shares keyed by their flows: a list here is not repeats
        probes = {k: {f"{i + 1}_flows": x for i, x in enumerate(out[k])}
                  for k in ("sharing", "reverse_sharing")}  # fmt: skip
        record("sim_fabric", {**out, **probes})


if __name__ == "__main__":
    main()
