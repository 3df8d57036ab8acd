"""The simulator's experiments, reproduced in shape, and its scale runs.

    python bench/sim_experiments.py e1|e2|e3|e4|e5|scale|all [--quick]

Each writes ``docs/simulator/<name>.json`` (every number), ``<name>.md`` (the table) and
``<name>.png`` (the plot); ``bench/sim_report.py`` assembles them into docs/simulator.md.

- **e1** (OrchestrRL): one sync GRPO step (Llama 3 8B on H100s) against the fabric's cost, for
  static fat trees with uplinks 1:1, 2:1 and 4:1 oversubscribed, and the oversubscribed ones
  with an optical layer run by the real fabric manager, its reconfiguration taking 10 ms to
  1 s; at 1,024 and 8,192 accelerators. The price table is :data:`PRICES`.
- **e2** (StreamRL): samples/s of sync, stream and stream+skew (its ranker: orchestr's, an
  oracle's, random) as the output lengths' tail grows heavier.
- **e3** (DistServe): goodput (the highest request rate at which 90% of requests meet both the
  TTFT and the TPOT SLO) of prefill/decode apart against co-located, on the same four
  accelerators, as the SLOs tighten and the KV link's bandwidth varies.
- **e4** (OrchestrRL's adaptive compute scheduler): a generation pool (Llama 3 8B on H100s,
  8 to a host) at each static tensor-parallel degree against the RL job's own policy
  re-picking it within and across steps, on 64 and 1,024 accelerators, for a long-tailed
  workload whose bulk is memory-bound and one whose bulk is compute-bound.
- **e5** (pipeline schedules on a network): one training step of Llama 3 70B cut into 8
  stages on 8 hosts under GPipe, 1F1B, interleaved 1F1B and ZB-H1, the activations and
  gradients moved as flows, as the hosts' NICs slow from 3.2 Tb/s to 25 Gb/s: each
  schedule's bubble against its closed form.
- **scale**: one sync GRPO step on fat_tree(16) with an optical layer (8,192 accelerators)
  and 100,000 requests over 1,024 accelerators: wall time, events/s, peak memory. Run it on
  an idle machine: its wall times are the measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import structlog

OUT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "simulator"
GB = 10**9

#: The network price table e1 uses (an assumption, in relative units, not quotes): an
#: electrical switch port with its optics costs 1.0 at 400 Gb/s and scales with its speed
#: (0.25 at 100 Gb/s); an OCS port with its optics 0.6 of a 400 Gb/s electrical port (no
#: packet processing; RFabric and TPU v4 report optical layers cheaper per port than the
#: packet switches they bypass, without one agreed figure).
PRICES = {"electrical_port_per_400g": 1.0, "ocs_port": 0.6}


def _quiet() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))


def _write(name: str, result: dict[str, Any], table: str, plot: Callable[[Any], None]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (OUT / f"{name}.md").write_text(table)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    plot(ax)
    fig.tight_layout()
    fig.savefig(OUT / f"{name}.png", dpi=110)
    plt.close(fig)
    print(table)


def _profile() -> Any:
    from orchestr.sim._profiles import H100_SXM, LLAMA3_8B, roofline

    return roofline(H100_SXM, LLAMA3_8B)


# -- e1 ----------------------------------------------------------------------------------------
def _network_cost(topology: Any) -> float:
    cost = 0.0
    for link in topology.links:
        cost += 2 * PRICES["electrical_port_per_400g"] * link.gbps / 400
    for host in topology.hosts:
        for nic in host.nics:
            cost += PRICES["electrical_port_per_400g"] * nic.gbps / 400  # its ToR port
    for ocs in topology.ocs:
        cost += PRICES["ocs_port"] * len(topology.ocs_wires(ocs.name))
    return cost


def e1(quick: bool) -> dict[str, Any]:
    from orchestr.fabric import optical as o
    from orchestr.roles.rl import GRPOConfig, TrainConfig
    from orchestr.sim import OutputLengths, RLCosts, simulate_grpo

    rows = []
    sizes = [8] if quick else [8, 16]
    for k in sizes:
        hosts = k**3 // 4
        gens, trainers = hosts * 3 // 4, hosts // 4
        tc = dataclasses.replace(TrainConfig(), steps=1, prompts_per_step=trainers * 2,
                                 group_size=16)  # fmt: skip
        config = GRPOConfig(train=tc, mode="sync", generators=gens, trainers=trainers)
        costs = RLCosts(_profile(), weight_bytes=16 * GB, train_token_s=1.5e-6)
        lengths = OutputLengths(per_prompt_token=60, sigma=1.0, cap=8192, sample_sigma=0.3)
        fabrics: list[tuple[str, int, float | None]] = [
            ("1:1 static", 1, None), ("2:1 static", 2, None), ("4:1 static", 4, None),
        ]  # fmt: skip
        for ratio in (2, 4):
            for ms in [10.0, 1000.0] if quick else [10.0, 100.0, 1000.0]:
                fabrics.append((f"{ratio}:1 + OCS {ms:g} ms", ratio, ms))
        for label, ratio, ms in fabrics:
            layer = None
            if ms is not None:
                latency = o.ReconfigLatency(switch_ms=0.0, settle_ms=0.0, control_ms=ms)
                layer = o.OcsLayer(uplinks=2, count=2, latency=latency)
            topo = o.fat_tree(k, tor_agg_gbps=400 / ratio, agg_core_gbps=400 / ratio, ocs=layer)
            fabric = None
            if layer is not None:
                drivers = {x.name: o.SimOcs(x.radix, rng=0, latency=ms / 1000) for x in topo.ocs}
                fabric = o.FabricManager(topo, drivers, o.RecordingRouter())
            run = simulate_grpo(config, topo, costs, lengths, fabric=fabric,
                                resources={"generator": {"gpu": 8}, "trainer": {"gpu": 8}})  # fmt: skip
            s = run.summary()
            rows.append({
                "accelerators": len(topo.accelerators), "fabric": label,
                "network_cost": round(_network_cost(topo), 1),
                "samples_per_s": s["samples_per_s"], "step_s": s["virtual_s"],
                "phase_s": s["phase_s"],
                "circuits_committed": sum(r.commit for r in fabric.history) if fabric else 0,
                "wall_s": s["wall_s"],
            })  # fmt: skip
            print(rows[-1], file=sys.stderr)
    table = "| accelerators | fabric | network cost | samples/s | weight sync s | training s | circuits |\n|---|---|---|---|---|---|---|\n"
    for r in rows:
        table += (f"| {r['accelerators']} | {r['fabric']} | {r['network_cost']:.0f} | "
                  f"{r['samples_per_s']:.1f} | {r['phase_s'].get('weight_sync', 0):.2f} | "
                  f"{r['phase_s'].get('training', 0):.2f} | {r['circuits_committed']} |\n")  # fmt: skip

    def plot(ax: Any) -> None:
        for n in sorted({r["accelerators"] for r in rows}):
            mine = [r for r in rows if r["accelerators"] == n]
            ax.scatter([r["network_cost"] for r in mine], [r["samples_per_s"] for r in mine],
                       label=f"{n} accelerators")  # fmt: skip
            for r in mine:
                ax.annotate(r["fabric"], (r["network_cost"], r["samples_per_s"]), fontsize=6)
        ax.set_xlabel("network cost (relative units)")
        ax.set_ylabel("samples/s")
        ax.set_title("E1: GRPO step throughput against network cost")
        ax.legend()

    result = {"prices": PRICES, "rows": rows}
    _write("e1", result, table, plot)
    return result


# -- e2 ----------------------------------------------------------------------------------------
def e2(quick: bool) -> dict[str, Any]:
    from orchestr.fabric.optical import fat_tree
    from orchestr.roles.rl import GRPOConfig, TrainConfig
    from orchestr.sim import OutputLengths, RLCosts, simulate_grpo

    tc = dataclasses.replace(TrainConfig(), steps=4 if quick else 8, prompts_per_step=64,
                             group_size=8)  # fmt: skip
    costs = RLCosts(_profile(), weight_bytes=16 * GB, train_token_s=1.5e-6)
    arms = [("sync", None), ("stream", None), ("stream+skew", None),
            ("stream+skew", "orchestr.sim:OracleRanker"),
            ("stream+skew", "orchestr.sim:RandomRanker")]  # fmt: skip
    rows = []
    for sigma in (0.0, 0.5, 1.0, 1.5):
        lengths = OutputLengths(per_prompt_token=50, sigma=sigma, cap=16384, sample_sigma=0.2)
        for mode, ranker in arms:
            cfg = GRPOConfig(train=tc, mode=mode, generators=16, trainers=8, long_generators=4,
                             ranker=ranker)  # fmt: skip
            run = simulate_grpo(cfg, fat_tree(8), costs, lengths,
                                resources={"generator": {"gpu": 8}, "trainer": {"gpu": 8}})  # fmt: skip
            s = run.summary()
            name = mode if ranker is None else f"{mode} ({ranker.split(':')[1]})"
            if mode == "stream+skew" and ranker is None:
                name = "stream+skew (orchestr's ranker)"
            rows.append({"sigma": sigma, "arm": name, "samples_per_s": s["samples_per_s"],
                         "version_lag": s["version_lag"], "dropped_groups": s["dropped_groups"],
                         "generator_idle_frac": s["generator_idle_frac"]})  # fmt: skip
    arms_named = list(dict.fromkeys(r["arm"] for r in rows))
    table = (
        "| tail sigma | " + " | ".join(arms_named) + " |\n|---|" + "---|" * len(arms_named) + "\n"
    )
    for sigma in sorted({r["sigma"] for r in rows}):
        cells = [f"{r['samples_per_s']:.1f}" for a in arms_named for r in rows
                 if r["sigma"] == sigma and r["arm"] == a]  # fmt: skip
        table += f"| {sigma} | " + " | ".join(cells) + " |\n"

    def plot(ax: Any) -> None:
        for a in arms_named:
            mine = [r for r in rows if r["arm"] == a]
            ax.plot([r["sigma"] for r in mine], [r["samples_per_s"] for r in mine], "o-", label=a)
        ax.set_xlabel("output-length tail (log-normal sigma per prompt)")
        ax.set_ylabel("samples/s")
        ax.set_title("E2: sync, stream, stream+skew as the tail grows")
        ax.legend(fontsize=7)

    result = {"rows": rows}
    _write("e2", result, table, plot)
    return result


# -- e3 ----------------------------------------------------------------------------------------
def e3(quick: bool) -> dict[str, Any]:
    from orchestr.sim import ServingRequest, simulate_serving
    from orchestr.sim._profiles import LLAMA3_8B

    def workload(rate: float, n: int) -> list[ServingRequest]:
        rng, at, out = random.Random(1), 0.0, []
        for i in range(n):
            at += rng.expovariate(rate)
            prompt = [rng.randrange(32000) for _ in range(rng.randint(256, 2048))]
            out.append(ServingRequest(f"r{i}", at, prompt, rng.randint(64, 512)))
        return out

    model, n = _profile(), 400 if quick else 1000
    rates = [10, 20, 30, 40, 50, 60, 70, 80, 100, 120] if not quick else [20, 40, 60, 80]
    setups = [("co-located 4", {"generators": 4})] + [
        (f"2 prefill + 2 decode, {g:g} Gb/s", {"generators": 2, "prefill": 2, "kv_gbps": g,
         "kv_bytes_per_token": LLAMA3_8B.kv_bytes_per_token, "min_prefill_tokens": 1})
        for g in (10.0, 50.0, 400.0)
    ]  # fmt: skip
    base = (0.25, 0.025)  # TTFT, TPOT seconds at scale 1.0
    scales = [2.0, 1.0, 0.75, 0.5]
    runs: dict[tuple[str, float], Any] = {}
    for name, kw in setups:
        for rate in rates:
            runs[name, rate] = simulate_serving(workload(rate, n), model, num_blocks=32768,
                                                max_batch=128, token_budget=4096, **kw)  # fmt: skip
    rows = []
    for name, _ in setups:
        for scale in scales:
            slo = (base[0] * scale, base[1] * scale)
            met = [r for r in rates if runs[name, r].summary(*slo)["slo_attainment"] >= 0.9]
            rows.append({"setup": name, "slo_scale": scale, "ttft_slo_s": slo[0],
                         "tpot_slo_s": slo[1], "goodput_rate": max(met, default=0)})  # fmt: skip
    table = ("| setup | " + " | ".join(f"SLO x{s:g}" for s in scales)
             + " |\n|---|" + "---|" * len(scales) + "\n")  # fmt: skip
    for name, _ in setups:
        cells = [f"{r['goodput_rate']:g}" for r in rows if r["setup"] == name]
        table += f"| {name} | " + " | ".join(cells) + " |\n"
    table += (f"\nGoodput: the highest rate tried ({', '.join(map(str, rates))} req/s) at which "
              f"90% of {n} requests met TTFT <= {base[0]:g} s x scale and TPOT <= {base[1]:g} s "
              "x scale.\n")  # fmt: skip

    def plot(ax: Any) -> None:
        for name, _ in setups:
            mine = [r for r in rows if r["setup"] == name]
            ax.plot([r["slo_scale"] for r in mine], [r["goodput_rate"] for r in mine], "o-",
                    label=name)  # fmt: skip
        ax.invert_xaxis()
        ax.set_xlabel("SLO scale (tighter to the right)")
        ax.set_ylabel("goodput (req/s at 90% attainment)")
        ax.set_title("E3: prefill/decode apart against co-located")
        ax.legend(fontsize=7)

    detail = {f"{name} @ {rate}": runs[name, rate].summary(*base) for name, rate in runs}
    result = {"rows": rows, "rates": rates, "requests": n, "runs": detail}
    _write("e3", result, table, plot)
    return result


# -- e4 ----------------------------------------------------------------------------------------
#: E4's assumptions: all-reduces on 450 GB/s NVLink with 2 us a ring round, and each doubling
#: of the degree keeping 85% of the ideal speedup (smaller products run further from peak)
E4_LINK = {"link_gbps": 3600.0, "alpha_s": 2e-6, "scaling": 0.85, "reshard_s": 2.0}


def e4_workload(rng: random.Random, requests: int, sigma: float) -> list[tuple[int, int]]:
    """GRPO's shape: groups of 16 samples of a prompt, each prompt's median output length
    log-normal around 665 tokens, its samples log-normal (``sigma``) around it, capped at
    16,384; prompts of 512 tokens."""
    import math

    out = []
    for _ in range(requests // 16):
        median = rng.lognormvariate(6.5, 0.6)
        for _ in range(16):
            n = rng.lognormvariate(math.log(median), sigma)
            out.append((512, int(min(16384, max(16, n)))))
    return out


def e4(quick: bool) -> dict[str, Any]:
    from orchestr.sim import pool_costs, simulate_layouts
    from orchestr.sim._profiles import H100_SXM, LLAMA3_8B

    costs = pool_costs(H100_SXM, LLAMA3_8B, device_bytes=80e9, **E4_LINK)
    # (name, accelerators, requests per accelerator, steps)
    cases = [("memory-bound bulk", 64, 128, 3), ("compute-bound bulk", 64, 512, 3),
             ("memory-bound bulk", 1024, 64, 2)]  # fmt: skip
    if quick:
        cases = [("memory-bound bulk", 64, 64, 2), ("compute-bound bulk", 16, 512, 2)]
    rows = []
    for name, n, per, count in cases:
        rng = random.Random(7)
        history = [t for _, t in e4_workload(rng, n * per, 1.0)]
        steps = [e4_workload(rng, n * per, 1.0) for _ in range(count)]
        arms: dict[str, Any] = {}
        for policy in (1, 2, 4, 8, "adaptive"):
            run = simulate_layouts(costs, n, steps, policy=policy, history=history,
                                   link_gbps=E4_LINK["link_gbps"], restart_s=1.0)  # fmt: skip
            arms[str(policy)] = run
        best = max((k for k in arms if k != "adaptive"), key=lambda k: arms[k].samples_per_s)
        adaptive = arms["adaptive"]
        rows.append({
            "case": name, "accelerators": n, "requests_per_step": n * per, "steps": count,
            **{f"tp{k}_samples_per_s": arms[k].samples_per_s for k in arms if k != "adaptive"},
            "adaptive_samples_per_s": adaptive.samples_per_s,
            "best_static": f"tp{best}",
            "adaptive_over_best_static": adaptive.samples_per_s / arms[best].samples_per_s,
            "changes": adaptive.changes, "change_s": adaptive.change_s,
            "degrees": [(round(t, 1), d) for t, d in adaptive.degrees],
        })  # fmt: skip
    table = ("| case | accelerators | requests/step | tp1 | tp2 | tp4 | tp8 | adaptive | "
             "adaptive / best static | changes |\n|---|---|---|---|---|---|---|---|---|---|\n")  # fmt: skip
    for r in rows:
        table += (f"| {r['case']} | {r['accelerators']} | {r['requests_per_step']} | "
                  + " | ".join(f"{r[f'tp{d}_samples_per_s']:.1f}" for d in (1, 2, 4, 8))
                  + f" | {r['adaptive_samples_per_s']:.1f} | {r['adaptive_over_best_static']:.2f}"
                  f" ({r['best_static']}) | {r['changes']} |\n")  # fmt: skip
    table += ("\nSamples/s of generation (the step's end is its last request's). Assumptions: "
              f"{E4_LINK}.\n")  # fmt: skip

    def plot(ax: Any) -> None:
        labels = [f"{r['case']}\n{r['accelerators']}" for r in rows]
        xs = range(len(rows))
        for i, d in enumerate((1, 2, 4, 8)):
            ax.bar([x + i * 0.15 for x in xs], [r[f"tp{d}_samples_per_s"] for r in rows], 0.15,
                   label=f"tp{d}")  # fmt: skip
        ax.bar([x + 0.6 for x in xs], [r["adaptive_samples_per_s"] for r in rows], 0.15,
               label="adaptive")  # fmt: skip
        ax.set_xticks([x + 0.3 for x in xs], labels, fontsize=7)
        ax.set_ylabel("samples/s")
        ax.set_title("E4: static degrees against the adaptive policy")
        ax.legend(fontsize=7)

    result = {"assumptions": E4_LINK, "rows": rows}
    _write("e4", result, table, plot)
    return result


# -- e5 ----------------------------------------------------------------------------------------
#: E5's setting (assumptions): Llama 3 70B cut into 8 stages of 10 layers, a stage a host of 8
#: H100s (tensor-parallel inside), 32 micro-batches of 4,096 tokens, passes at 40% of the dense
#: BF16 peak, 10 us to start a send; a micro-batch's activation (or its gradient) is
#: 4,096 x 8,192 BF16 values between neighbouring stages.
E5 = {"stages": 8, "microbatches": 32, "tokens": 4096, "mfu": 0.4, "latency_s": 1e-5}
#: The hosts' NIC speeds swept, in Gb/s: 8 x 400 (one NIC a GPU) down to one 25 Gb/s port.
E5_NICS = (3200.0, 400.0, 100.0, 25.0)


def e5(quick: bool) -> dict[str, Any]:
    from orchestr.fabric.optical import fat_tree
    from orchestr.roles.pipeline import SCHEDULES, Cost, bubble_theory, build
    from orchestr.sim import simulate_pipeline
    from orchestr.sim._profiles import H100_SXM, LLAMA3_70B

    p, m = E5["stages"], 16 if quick else E5["microbatches"]
    # a stage's forward over one micro-batch: 2 FLOPs a parameter a token, on 8 devices
    f = 2 * LLAMA3_70B.params / p * E5["tokens"] / (8 * H100_SXM.dense_flops * E5["mfu"])
    hidden = LLAMA3_70B.heads * LLAMA3_70B.head_dim
    item = E5["tokens"] * hidden * LLAMA3_70B.dtype_bytes
    rows = []
    for gbps in E5_NICS:
        # every stage's host on one top-of-rack switch: each hop is a NIC's speed
        tree = fat_tree(4, hosts_per_tor=8, nic_gbps=gbps, tor_agg_gbps=gbps)
        hosts = [h.name for h in tree.hosts[:p]]
        for kind in SCHEDULES:
            v = 2 if kind == "interleaved_1f1b" else 1
            # a rank's v chunks split its layers: each chunk's passes take 1/v of the time
            cost = Cost(f=f / v, b=2 * f / v, bi=f / v, bw=f / v, latency=E5["latency_s"])
            timing = simulate_pipeline(build(kind, p, m, v), cost, topology=tree, hosts=hosts,
                                       item_bytes=item)  # fmt: skip
            ideal = 3 * f * m  # a rank's own passes, nothing waited for
            rows.append({
                "nic_gbps": gbps, "schedule": kind, "chunks": v,
                "bubble_sim": timing.bubble, "bubble_theory": bubble_theory(kind, p, m, v),
                "step_s": timing.makespan, "step_over_compute": timing.makespan / ideal,
                "item_ms": item * 8 / (gbps * 1e9) * 1e3,
            })  # fmt: skip
    table = ("| NIC | one item's transfer | schedule | bubble (closed form) | bubble (simulated) "
             "| step s | step / compute |\n|---|---|---|---|---|---|---|\n")  # fmt: skip
    for r in rows:
        table += (f"| {r['nic_gbps']:g} Gb/s | {r['item_ms']:.2f} ms | {r['schedule']} | "
                  f"{r['bubble_theory']:.3f} | {r['bubble_sim']:.3f} | {r['step_s']:.2f} | "
                  f"{r['step_over_compute']:.2f} |\n")  # fmt: skip
    table += (f"\nOne forward pass of a stage takes {f * 1e3:.1f} ms; an item is "
              f"{item / 2**20:.0f} MiB. Assumptions: {E5}.\n")  # fmt: skip

    def plot(ax: Any) -> None:
        for kind in SCHEDULES:
            mine = [r for r in rows if r["schedule"] == kind]
            ax.plot([r["nic_gbps"] for r in mine], [r["bubble_sim"] for r in mine], marker="o",
                    label=kind)  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("NIC Gb/s")
        ax.set_ylabel("bubble (simulated)")
        ax.set_title("E5: pipeline bubbles as the network slows")
        ax.legend(fontsize=7)

    result = {"assumptions": E5, "forward_s": f, "item_bytes": item, "rows": rows}
    _write("e5", result, table, plot)
    return result


# -- scale -------------------------------------------------------------------------------------
def scale(quick: bool) -> dict[str, Any]:
    from orchestr.fabric import optical as o
    from orchestr.roles.rl import GRPOConfig, TrainConfig
    from orchestr.sim import OutputLengths, RLCosts, ServingRequest, simulate_grpo, simulate_serving

    k = 8 if quick else 16
    layer = o.OcsLayer(uplinks=2, count=2, latency=o.ReconfigLatency(control_ms=100.0))
    topo = o.fat_tree(k, ocs=layer)
    drivers = {x.name: o.SimOcs(x.radix, rng=0, latency=0.1) for x in topo.ocs}
    fabric = o.FabricManager(topo, drivers, o.RecordingRouter())
    hosts = len(topo.hosts)
    tc = dataclasses.replace(TrainConfig(), steps=1, prompts_per_step=hosts, group_size=16)
    # sync: the step holds the whole of its generation's tail, its all-reduce and its sync
    config = GRPOConfig(train=tc, mode="sync", generators=hosts * 3 // 4, trainers=hosts // 4)
    costs = RLCosts(_profile(), weight_bytes=16 * GB, train_token_s=1.5e-6)
    lengths = OutputLengths(per_prompt_token=60, sigma=1.0, cap=16384, sample_sigma=0.3)
    rl = simulate_grpo(config, topo, costs, lengths, fabric=fabric,
                       resources={"generator": {"gpu": 8}, "trainer": {"gpu": 8}})  # fmt: skip
    rl_row = {"accelerators": len(topo.accelerators), **rl.summary()}
    rng, at, requests = random.Random(0), 0.0, []
    prefixes = [[rng.randrange(32000) for _ in range(512)] for _ in range(16)]
    n = 10_000 if quick else 100_000
    for i in range(n):
        at += rng.expovariate(500.0)
        prompt = [
            *rng.choice(prefixes),
            *(rng.randrange(32000) for _ in range(rng.randint(32, 1024))),
        ]
        requests.append(ServingRequest(f"r{i}", at, prompt, rng.randint(16, 512)))
    serving = {}
    for policy in ("kv", "least_loaded"):
        run = simulate_serving(requests, _profile(), generators=128, policy=policy,
                               num_blocks=32768)  # fmt: skip
        serving[policy] = {"accelerators": 128 * 8, **run.summary()}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    table = ("| run | accelerators | wall s | events | events/s | peak memory (process) |\n"
             "|---|---|---|---|---|---|\n"
             f"| one sync GRPO step ({hosts * 16:,} samples, {rl_row['virtual_s']:.0f} virtual "
             f"s) | {rl_row['accelerators']} | {rl_row['wall_s']:.1f} | {rl_row['events']} | "
             f"{rl_row['events_per_s']:.0f} | {rl_row['peak_rss_bytes'] / 2**30:.2f} GiB |\n")  # fmt: skip
    for policy, s in serving.items():
        table += (f"| {n} requests, router {policy} | {s['accelerators']} | {s['wall_s']:.1f} | "
                  f"{s['events']} | {s['events_per_s']:.0f} | {peak / 2**30:.2f} GiB |\n")  # fmt: skip

    def plot(ax: Any) -> None:
        labels = ["RL step", *(f"serving ({p})" for p in serving)]
        ax.bar(labels, [rl_row["wall_s"], *(s["wall_s"] for s in serving.values())])
        ax.axhline(60, color="red", linestyle="--", label="60 s target")
        ax.set_ylabel("wall seconds (one core)")
        ax.set_title("Simulation wall time at scale")
        ax.legend()

    result = {"rl": rl_row, "serving": serving, "peak_rss_bytes": peak}
    _write("scale", result, table, plot)
    return result


def main() -> int:
    from _record import add_record_flag, record

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["e1", "e2", "e3", "e4", "e5", "scale", "all"])
    p.add_argument("--quick", action="store_true", help="smaller sweeps, for a quick look")
    add_record_flag(p)
    args = p.parse_args()
    _quiet()
    names = ["e1", "e2", "e3", "e4", "e5", "scale"] if args.what == "all" else [args.what]
    funcs = {"e1": e1, "e2": e2, "e3": e3, "e4": e4, "e5": e5, "scale": scale}
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        started = time.perf_counter()
        results[name] = funcs[name](args.quick)
        print(f"{name}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    if args.record:
        record("sim_experiments", record_figures(results))
    return 0


def record_figures(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each experiment's rows keyed by what they vary (its rows are settings, not repeats)."""
    out: dict[str, Any] = {}
    for name, result in results.items():
        if name == "e1":
            keep = ("samples_per_s", "step_s", "network_cost", "circuits_committed", "phase_s")
            out[name] = {f"{r['accelerators']} {r['fabric']}": {k: r[k] for k in keep}
                         for r in result["rows"]}  # fmt: skip
        elif name == "e2":
            keep = ("samples_per_s", "version_lag", "dropped_groups", "generator_idle_frac")
            out[name] = {f"sigma {r['sigma']} {r['arm']}": {k: r[k] for k in keep}
                         for r in result["rows"]}  # fmt: skip
        elif name == "e4":
            keep = ("adaptive_samples_per_s", "adaptive_over_best_static", "changes")
            out[name] = {f"{r['case']} {r['accelerators']}": {k: r[k] for k in keep}
                         for r in result["rows"]}  # fmt: skip
        elif name == "e5":
            keep = ("bubble_sim", "bubble_theory", "step_s")
            out[name] = {f"{r['nic_gbps']:g} {r['schedule']}": {k: r[k] for k in keep}
                         for r in result["rows"]}  # fmt: skip
        elif name == "e3":
            out[name] = {f"{r['setup']} x{r['slo_scale']}": {"goodput_rate": r["goodput_rate"]}
                         for r in result["rows"]}  # fmt: skip
        else:
            out[name] = result
    return out


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
