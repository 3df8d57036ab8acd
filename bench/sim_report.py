"""Writes docs/simulator.md: the simulator's validation (L0 and L1 computed here and now, L2
and the experiments from the results their commands saved under docs/simulator/).

    python bench/sim_generation.py --save docs/simulator/l2_generation.json   # L2 (minutes)
    python bench/sim_serving.py --save docs/simulator/l2_serving.json         # L2 (minutes)
    python bench/sim_rl.py --save docs/simulator/l2_rl.json                   # L2 (minutes)
    python bench/sim_rl.py --demo --save docs/simulator/l2_rl_demo.json       # L2 (30 min)
    sudo .venv/bin/python bench/sim_fabric.py --save docs/simulator/l2_fabric.json  # L2
    python bench/sim_experiments.py all                                        # E1-E5, scale
    python bench/sim_report.py                                                 # this page

A result not yet produced is said to be missing on the page, never left out quietly.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DATA = DOCS / "simulator"
B = 400e9 / 8


def l0() -> str:
    from orchestr.fabric.optical import (
        all_gather_s,
        all_to_all_s,
        broadcast_s,
        fat_tree,
        reduce_scatter_s,
        ring_all_reduce_s,
    )  # fmt: skip
    from orchestr.sim import collective_time

    tree = fat_tree(4, hosts_per_tor=8)
    members = [f"p0-t0-h{i}" for i in range(8)]
    closed = {
        "all_reduce": lambda n, s: ring_all_reduce_s(n, s, B),
        "reduce_scatter": lambda n, s: reduce_scatter_s(n, s, B),
        "all_gather": lambda n, s: all_gather_s(n, s, B),
        "all_to_all": lambda n, s: all_to_all_s(n, s, B),
        "broadcast": lambda n, s: broadcast_s(n, s, B, chunk_bytes=1 << 20),
    }
    rows = ["| collective | members | bytes | flow model s | closed form s | difference |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for kind, formula in closed.items():
        for n, size in ((2, 1e6), (8, 1e9)):
            flow = collective_time(tree, kind, members[:n], size, ecmp=False)
            want = formula(n, size)
            rows.append(f"| {kind} | {n} | {size:.0e} | {flow:.9f} | {want:.9f} | "
                        f"{flow - want:+.1e} s |")  # fmt: skip
    return "\n".join(rows) + "\n"


async def _hints() -> list[tuple[Any, ...]]:
    from orchestr.fabric.optical import (
        CommitPolicy,
        FabricManager,
        Hint,
        ReconfigCost,
        RecordingRouter,
        SimOcs,
        load_topology,
    )  # fmt: skip

    ocs = SimOcs(8, latency=1e-3, rng=1)
    fm = FabricManager(
        load_topology(ROOT / "examples" / "fabric" / "small.toml"), {"ocs0": ocs},
        RecordingRouter(), policy=CommitPolicy(hysteresis=0.5, min_dwell_s=1.5),
        reconfig_cost=ReconfigCost(fixed_s=0.01, per_change_s=0.0),
    )  # fmt: skip
    gb = 1e9
    await fm.hint(Hint("j", "a", {("tor0", "tor1"): 50 * gb}))
    await fm.hint(Hint("j", "b", {("tor0", "agg0"): 80 * gb}))
    await asyncio.sleep(1.6)
    await fm.hint(Hint("j", "c", {("tor0", "agg0"): 80 * gb}))
    ocs.fail_next_program()
    await fm.hint(Hint("j", "d", {("tor1", "agg0"): 80 * gb}))
    await fm.hint(Hint("j", "e", {("tor1", "agg0"): 80 * gb}))
    return [(r.phase, r.commit, r.status, len(r.add), len(r.remove)) for r in fm.history]


def l1() -> str:
    from orchestr.sim import Simulation

    wall = asyncio.run(_hints())
    with Simulation() as sim:
        virtual = sim.run(_hints())
    rows = ["| hint | wall clock: commit, status, +circuits, -circuits | virtual time | same |",
            "|---|---|---|---|"]  # fmt: skip
    for w, v in zip(wall, virtual, strict=True):
        rows.append(f"| {w[0]} | {w[1]}, {w[2]}, {w[3]}, {w[4]} | {v[1]}, {v[2]}, {v[3]}, {v[4]} "
                    f"| {'yes' if w == v else '**no**'} |")  # fmt: skip
    return "\n".join(rows) + "\n"


def l2(name: str = "generation") -> str:
    """The table of ``docs/simulator/l2_<name>.json`` (``bench/sim_<name>.py --save``)."""
    path = DATA / f"l2_{name}.json"
    if not path.exists():
        return f"*Not produced yet: run `python bench/sim_{name}.py --save " \
               f"docs/simulator/l2_{name}.json`.*\n"  # fmt: skip
    data = json.loads(path.read_text())
    rows = [f"Profile: `{data['profile']['machine']}`, fit error median "
            f"{data['profile']['fit_median_abs_error']:.1%}; real runs: {data.get('runs', '?')} "
            "each.", "",
            "| workload | metric | real median (min-max) | simulated | signed error | target |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for workload, entry in data.items():
        if not isinstance(entry, dict) or "real" not in entry:
            continue
        for metric, real in entry["real"].items():
            err = entry["error"][metric]
            limit = 0.05 if "tokens_per_s" in metric else 0.10
            verdict = "met" if abs(err) <= limit else "**missed**"
            rows.append(f"| {workload} | {metric} | {real['median']} ({real['min']}-{real['max']}) | "
                        f"{entry['sim'][metric]} | {err:+.1%} | {verdict} (±{limit:.0%}) |")  # fmt: skip
    return "\n".join(rows) + "\n"


def l2_rl(name: str = "l2_rl", flags: str = "") -> str:
    """The table of ``docs/simulator/<name>.json`` (``bench/sim_rl.py [flags] --save``)."""
    path = DATA / f"{name}.json"
    if not path.exists():
        return (
            f"*Not produced yet: run `python bench/sim_rl.py {flags}--save "
            f"docs/simulator/{name}.json`.*\n"
        )
    data = json.loads(path.read_text())
    meta, costs, call = data["_meta"], data["costs"], data.get("call_path", {})
    rows = [f"Config: `{meta['config']}` ({meta['steps']} batches), {meta['runs']} real runs of "
            f"each mode on {meta['cores']} cores. Calibrated: `{data['calibration']['machine']}`, "
            f"generation step fit error median "
            f"{data['calibration']['generation_median_abs_error']:.1%}; a trainer step "
            f"{costs['train_step_s'] * 1e3:.1f} ms + {costs['train_token_s'] * 1e6:.1f} µs a "
            f"token; calls {call.get('call_s', 0) * 1e3:.2f} ms + "
            f"{call.get('call_item_s', 0) * 1e6:.1f} µs an item.", "",
            "| mode | metric | real median (min-max) | simulated | signed error | target |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for mode in meta["modes"]:
        entry = data[mode]
        for metric, real in entry["real"].items():
            err = entry["error"][metric]
            if metric == "samples_per_s":
                shown = f"{err:+.1%}"
                verdict = "met (±5%)" if abs(err) <= 0.05 else "**missed** (±5%)"
            elif err is None:
                shown, verdict = "-", "reported"
            else:
                shown = f"{err:+.1%}" if metric == "version_lag" else f"{err:+.3f} (points)"
                verdict = "reported"
            rows.append(f"| {mode} | {metric} | {real['median']} ({real['min']}-{real['max']}) | "
                        f"{entry['sim'][metric]} | {shown} | {verdict} |")  # fmt: skip
    return "\n".join(rows) + "\n"


def l2_fabric() -> str:
    """The table of ``docs/simulator/l2_fabric.json`` (``bench/sim_fabric.py --save``)."""
    path = DATA / "l2_fabric.json"
    if not path.exists():
        return (
            "*Not produced yet: run `sudo .venv/bin/python bench/sim_fabric.py --save "
            "docs/simulator/l2_fabric.json`.*\n"
        )
    data = json.loads(path.read_text())
    meta, cost = data["_meta"], data["reconfig_cost"]
    sharing = ""
    if "sharing" in data:

        def rates(xs: list[float]) -> str:
            return ", ".join(f"{x:.3f}" for x in xs)

        sharing = (f"; 1-{len(data['sharing'])} flows out of one host carry "
                   f"{rates(data['sharing'])} of one flow's rate, and one host exchanging a "
                   f"flow each way with 1-{len(data.get('reverse_sharing', []))} others "
                   f"{rates(data.get('reverse_sharing', []))}; a read of the switch "
                   f"{data['read_s'] * 1e3:.1f} ms ({data['reads_in_a_commit']} in a committed "
                   "hint)")  # fmt: skip
    rows = [f"{meta['hosts']} namespace hosts, {meta['weights_mib']} MiB of weights, "
            f"{meta['electrical_mbit']:g} Mbit/s electrical and {meta['circuit_mbit']:g} Mbit/s "
            f"circuits; {meta['reps']} sequences of two cycles on each fabric. Calibrated: "
            f"goodput {data['goodput']:.3f} of the shaped rate{sharing}; a reconfiguration "
            f"{cost['fixed_s'] * 1e3:.0f} ms + {cost['per_change_s'] * 1e3:.0f} ms a port "
            "changed.", "",
            "| fabric | metric | real median (min-max) | simulated | signed error | target |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for fabric in ("static", "circuits"):
        entry = data[fabric]
        for metric, real in entry["real"].items():
            err = entry["error"][metric]
            limit = 0.10 if "reconfig" in metric else 0.05
            verdict = "met" if err is not None and abs(err) <= limit else "**missed**"
            shown = "-" if err is None else f"{err:+.1%}"
            rows.append(f"| {fabric} | {metric} | {real['median']} ({real['min']}-{real['max']}) | "
                        f"{entry['sim'][metric]} | {shown} | {verdict} (±{limit:.0%}) |")  # fmt: skip
    return "\n".join(rows) + "\n"


def table(name: str) -> str:
    path = DATA / f"{name}.md"
    if not path.exists():
        return f"*Not produced yet: run `python bench/sim_experiments.py {name}`.*\n"
    return path.read_text() + f"\n![{name}](simulator/{name}.png)\n"


def main() -> None:
    page = (ROOT / "bench" / "sim_report_page.md").read_text()
    filled = page.format(l0=l0(), l1=l1(), l2=l2(), l2_serving=l2("serving"), l2_rl=l2_rl(),
                         l2_rl_demo=l2_rl("l2_rl_demo", "--demo "),
                         l2_fabric=l2_fabric(), e1=table("e1"), e2=table("e2"), e3=table("e3"),
                         e4=table("e4"), e5=table("e5"), scale=table("scale"))  # fmt: skip
    (DOCS / "simulator.md").write_text(filled)
    print(f"wrote {DOCS / 'simulator.md'}")


if __name__ == "__main__":
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    main()
