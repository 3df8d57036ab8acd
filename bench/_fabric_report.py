"""The tables and the JSON object of ``bench/fabric.py``."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from _fabric_phases import PHASES, broadcast_floor_s, phase_steps

TARGET_MS = {1024: 100.0, 8192: 1000.0}


@dataclasses.dataclass
class PhaseRun:
    """One phase of one sequence: transfer seconds, hint (plan and apply) seconds before its
    steps, the shaping's limit with the circuits that were live, the plan records."""

    phase: str
    transfer_s: float = 0.0
    reconfig_s: float = 0.0
    limit_s: float = 0.0
    plans: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def total_s(self) -> float:
        return self.transfer_s + self.reconfig_s


def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def _fmt(xs: Sequence[float]) -> str:
    return f"{_med(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value


def _pairs(rows: Sequence[Sequence[Any]]) -> str:
    return ",".join(f"{a}-{b}" + (f"x{n}" if n != 1 else "") for a, b, n in rows) or "-"


def _phase_table(static: list[PhaseRun], circuits: list[PhaseRun], setup: Any) -> dict[str, Any]:
    count = len([r for r in static if r.phase == PHASES[0]])
    print(
        f"{'seconds, median [min-max], n=' + str(count):28s}{'static':>20s}{'circuits':>20s}"
        f"{'reconfig':>20s}{'circuits+reconfig':>20s}{'ratio':>7s}"
        f"{'limit static':>13s}{'limit circ.':>12s}{'of limit s/c':>14s}"
    )
    out: dict[str, Any] = {"static": {}, "circuits": {}, "ratios": {}, "limits": {}}
    for phase in dict.fromkeys(PHASES):
        s = [r.transfer_s for r in static if r.phase == phase]
        c = [r.transfer_s for r in circuits if r.phase == phase]
        o = [r.reconfig_s for r in circuits if r.phase == phase]
        t = [r.total_s for r in circuits if r.phase == phase]
        ls = _med([r.limit_s for r in static if r.phase == phase])
        lc = _med([r.limit_s for r in circuits if r.phase == phase])
        ratio = _med(s) / _med(t)
        steps = len(phase_steps(phase, setup.tors, setup.nbytes))
        label = f"{phase} ({steps} step{'s' if steps > 1 else ''})"
        print(
            f"{label:28s}{_fmt(s):>20s}{_fmt(c):>20s}{_fmt(o):>20s}{_fmt(t):>20s}"
            f"{ratio:>6.2f}x{ls:>13.2f}{lc:>12.2f}"
            f"{f'{ls / _med(s):.2f} / {lc / _med(c):.2f}':>14s}"
        )
        out["static"][f"{phase}_s"] = _med(s)
        out["circuits"][f"{phase}_s"] = _med(c)
        out["circuits"][f"{phase}_reconfig_s"] = _med(o)
        out["circuits"][f"{phase}_total_s"] = _med(t)
        out["ratios"][phase] = ratio
        out["ratios"][f"{phase}_transfer_only"] = _med(s) / _med(c)
        out["limits"][f"static_{phase}_s"] = ls
        out["limits"][f"circuits_{phase}_s"] = lc
    floor = broadcast_floor_s(setup.nbytes, setup.electrical_bps)
    ws_total = out["circuits"]["weight_sync_total_s"]
    out["limits"]["static_broadcast_floor_s"] = floor
    out["ratios"]["weight_sync_vs_static_floor"] = floor / ws_total
    print(
        "ratio: static / (circuits + reconfig), medians. limit: what the shaping alone allows "
        "(busiest host egress or circuit end,\nwith the circuits that were live); of limit: "
        "limit / measured, static and circuit transfers."
    )
    print(
        f"weight_sync floor on the static fabric for any broadcast (trainer egress carries S "
        f"once, a pipelined chain): {floor:.2f} s;\ncircuits+reconfig beat it "
        f"{floor / ws_total:.2f}x."
    )
    # per cycle (a weight_sync and the all_to_all after it)
    cycles = [
        circuits[i].reconfig_s + circuits[i + 1].reconfig_s for i in range(0, len(circuits), 2)
    ]
    applied = [p["wall_s"] for r in circuits for p in r.plans if p["status"] == "applied"]
    out["circuits"]["reconfig_overhead_s"] = _med(cycles)
    out["circuits"]["per_reconfiguration_s"] = _med(applied) if applied else 0.0
    out["circuits"]["reconfigurations_per_cycle"] = len(applied) / len(cycles)
    print(
        f"reconfiguration overhead per cycle (weight_sync + all_to_all): {_fmt(cycles)} s; "
        f"{len(applied) / len(cycles):.1f} reconfigurations per cycle, "
        f"{_fmt(applied) if applied else '-'} s each"
    )
    return out


def _plans(circuits: list[PhaseRun]) -> list[dict[str, Any]]:
    first = [p for r in circuits[: len(PHASES)] for p in r.plans]
    print()
    print("hints of the first sequence with the manager (wall: hint to routes on the circuits):")
    for p in first:
        steps = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in p["timings"].items())
        print(
            f"  {p['phase']:<15s}{p['status']:<9s}wall {p['wall_s'] * 1e3:.0f} ms"
            + (f" ({steps} ms)" if steps else "")
        )
        print(
            f"  {'':15s}add {_pairs(p['add'])}; remove {_pairs(p['remove'])}; "
            f"live after {_pairs([(*c, 1) for c in p['live']])}"
        )
        print(
            f"  {'':15s}model: {p['predicted_s_static']:.2f} s static, "
            f"{p['predicted_s_with']:.2f} s with the plan; {p['reason']}"
        )
    return first


def _planner(rows: list[dict[str, Any]]) -> dict[str, Any]:
    print()
    print(
        "planner: GreedyPlanner().plan, ms median [min-max]; 8 accelerators a host, 16 OCS ports a ToR"
    )
    out: dict[str, Any] = {}
    for r in rows:
        label = (
            f"{r['accelerators']} acc, {r['endpoints']} ToRs ({r['hosts_per_tor']} hosts each), "
            f"{r['demand']}, {r['case']}"
        )
        print(
            f"  {label:62s}{r['median_ms']:9.2f} [{r['min_ms']:.2f}-{r['max_ms']:.2f}]  "
            f"{r['circuits']} circuits"
        )
    for acc, target in TARGET_MS.items():
        mine = [r for r in rows if r["accelerators"] == acc]
        worst = max(mine, key=lambda r: r["median_ms"])
        typical = max((r for r in mine if r["hosts_per_tor"] != 1), key=lambda r: r["median_ms"])
        out[f"ms_{acc}"] = worst["median_ms"]
        out[f"ms_{acc}_typical"] = typical["median_ms"]
        out[f"target_ms_{acc}"] = target
        verdict = "met" if worst["median_ms"] < target else "MISSED"
        print(
            f"  {acc} accelerators: worst median {worst['median_ms']:.1f} ms ({worst['demand']}, "
            f"{worst['endpoints']} endpoints), target under {target:.0f} ms: {verdict}"
        )
    return out


def report(
    config: dict[str, Any], result: dict[str, Any], planner: list[dict[str, Any]], setup: Any
) -> dict[str, Any]:
    """Print the tables; return the JSON object (rounded)."""
    cost, calibration = result["cost"], result["calibration"]
    n = len(setup.tors)
    print(
        f"fabric: {n} namespace hosts ({', '.join(setup.tors)}), each alone under its ToR; eth0 "
        f"egress {config['electrical_mbit']:g} Mbit/s, circuits {config['circuit_mbit']:g} "
        f"Mbit/s, one OCS port a ToR; weights {config['weights_mib']} MiB; "
        f"{config['reps']} rep(s) x 2 cycles"
    )
    print(
        f"reconfiguration cost, measured ({calibration['rounds']} round(s)): one circuit "
        f"{calibration['one_circuit_s']:.3f} s, swap to two {calibration['swap_to_two_s']:.3f} s "
        f"-> ReconfigCost(fixed_s={cost.fixed_s:.3f}, per_change_s={cost.per_change_s:.3f}); "
        f"policy hysteresis {config['policy']['hysteresis']:g}, min_dwell_s "
        f"{config['policy']['min_dwell_s']:g}"
    )
    print()
    out = _phase_table(result["static"], result["circuits"], setup)
    plans = _plans(result["circuits"])
    out["planner"] = _planner(planner)
    config = {
        **config,
        "reconfig_cost": {"fixed_s": cost.fixed_s, "per_change_s": cost.per_change_s},
        "calibration": calibration,
    }
    ordered = {
        "static": out["static"],
        "circuits": out["circuits"],
        "planner": out["planner"],
        "ratios": out["ratios"],
        "limits": out["limits"],
        "config": config,
        "plans": [
            {k: p[k] for k in ("phase", "status", "add", "remove", "live", "wall_s", "reason")}
            for p in plans
        ],
    }
    return _round(ordered)  # type: ignore[no-any-return]
