"""Scenarios: a TOML file naming a topology, a step-time profile and either an RL job or a
serving workload; :func:`load_scenario` checks it (an error names the table and field) and
:func:`run_scenario` runs it, writing its metrics, a Perfetto trace of the simulated timeline
and a summary.

.. code-block:: toml

    kind = "rl"                 # or "serving"
    seed = 0

    [topology]                  # fat_tree(k), or one_host = true (serving needs none)
    k = 16
    hosts_per_tor = 8           # k/2 by default; more oversubscribes the ToRs
    nic_gbps = 400.0
    [topology.ocs]              # an optical layer on the ToRs, run by the real fabric manager
    uplinks = 2
    reconfig_ms = 25.0          # one port change, end to end

    [profile]                   # a file from `orchestr sim calibrate`, the terms, or builtin
    builtin = "h100-llama3-8b"  # from published figures (sim/_profiles.py)

    [rl]                        # GRPOConfig's counts, RLCosts, OutputLengths
    mode = "stream+skew"
    generators = 768
    host_cpus = 2               # each host's cores, shared by its roles (unset: unlimited)
    ...
    [rl.costs]                  # RLCosts' fields, over those of a file when one is named:
    file = "rl-costs.json"      # `orchestr sim calibrate-rl`'s (its step_time is a [profile])

    [serving]                   # simulate_serving's arguments and the workload
    generators = 128
    cpus = 2                    # one host's cores for all of it (unset: a core each),
    token_cpu_s = [1.5e-4]      # and the serving path's threads' work on each token
    [serving.workload]
    requests = 100000
    rate = 500.0
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import tomllib
from collections.abc import Mapping
from typing import Any

from orchestr._job._events import EventLog, export_trace
from orchestr.errors import ConfigError, PlacementError

from ._table import REQUIRED, Table, nonneg, pos

__all__ = ["Scenario", "load_scenario", "run_scenario"]

KINDS = ("rl", "serving")


@dataclasses.dataclass
class Scenario:
    """A checked scenario: its kind, seed and tables (defaults filled in)."""

    path: str
    kind: str
    seed: int
    topology: dict[str, Any]
    profile: dict[str, Any]
    body: dict[str, Any]


def load_scenario(path: str) -> Scenario:
    """Read and check the scenario at ``path``. Raises :class:`ConfigError` naming the file,
    table and field of the first problem."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not TOML ({exc})") from None
    top = Table(data, path)
    kind = top.get("kind", str, REQUIRED, check=lambda v: v in KINDS, want=" or ".join(KINDS))
    seed = top.get("seed", int, 0)
    base = os.path.dirname(os.path.abspath(path))
    profile = _profile(top.table("profile"), base)
    topology: dict[str, Any] = {}
    if kind == "rl" or "topology" in data:
        topology = _topology(top.table("topology"))
    body = _rl(top.table("rl"), base) if kind == "rl" else _serving(top.table("serving"))
    top.done()
    return Scenario(path, kind, seed, topology, profile, body)


def _profile(t: Table, base: str) -> dict[str, Any]:
    from ._generation import TERMS, StepTimeModel
    from ._profiles import BUILTIN

    file = t.get("file", str)
    builtin = t.get("builtin", str, check=lambda v: v in BUILTIN, want=" or ".join(BUILTIN))
    if builtin is not None and file is not None:
        raise ConfigError(f"{t.where}: give a file or a builtin profile, not both")
    if builtin is not None:
        model = BUILTIN[builtin]()
    elif file is not None:
        full = file if os.path.isabs(file) else os.path.join(base, file)
        try:
            with open(full, encoding="utf-8") as f:
                data = json.load(f)
            model = StepTimeModel.from_json(data.get("step_time", data))
        except (OSError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{t.where}: file {file!r}: {exc}") from None
    else:
        terms = {name: t.get(name, float, 0.0, check=nonneg, want="seconds >= 0") for name in TERMS}
        if "base_s" not in t.data:
            raise ConfigError(
                f"{t.where}: give a file, a builtin profile or the step-time terms "
                f"({', '.join(TERMS)})"
            )
        model = StepTimeModel(**terms)
    t.done()
    return {"model": model, "file": file, "builtin": builtin}


def _topology(t: Table) -> dict[str, Any]:
    if t.get("one_host", bool, False):  # a machine on its own: no network to model
        one = {"one_host": True, "accelerators": t.get("accelerators", int, 1, check=pos)}
        t.done()
        return one
    k = t.get("k", int, REQUIRED, check=lambda v: v >= 2 and v % 2 == 0, want="an even int >= 2")
    out: dict[str, Any] = {"k": k}
    out["hosts_per_tor"] = t.get("hosts_per_tor", int, None, check=pos)
    out["accelerators_per_host"] = t.get("accelerators_per_host", int, 8, check=pos)
    for key in ("nic_gbps", "tor_agg_gbps", "agg_core_gbps"):
        out[key] = t.get(key, float, 400.0, check=pos)
    if "ocs" in t.data:
        o = t.table("ocs")
        out["ocs"] = {
            "uplinks": o.get("uplinks", int, 1, check=pos),
            "count": o.get("count", int, 1, check=pos),
            "gbps": o.get("gbps", float, 400.0, check=pos),
            "reconfig_ms": o.get("reconfig_ms", float, 625.0, check=pos),
        }
        o.done()
    t.done()
    return out


def _rl(t: Table, base: str) -> dict[str, Any]:
    from orchestr.roles.rl import MODES

    out: dict[str, Any] = {
        "mode": t.get("mode", str, "sync", check=lambda v: v in MODES, want=" or ".join(MODES)),
    }
    for key, default in (
        ("generators", 4),
        ("trainers", 1),
        ("rewards", 1),
        ("steps", 2),
        ("prompts_per_step", 64),
        ("group_size", 8),
        ("eta", 1),
        ("lookahead", 1),
        ("long_generators", 1),
        ("max_batch", 256),
    ):
        out[key] = t.get(key, int, default, check=pos, want="a positive int")
    out["host_cpus"] = t.get("host_cpus", float, None, check=pos)  # cores the roles share
    out["generator_nice"] = t.get(
        "generator_nice", int, 10, check=lambda v: -20 <= v <= 19, want="an int in -20..19"
    )
    for role in ("generator", "trainer"):
        res = t.get(f"{role}_resources", dict, {"gpu": 8})
        if not all(isinstance(v, int | float) and v >= 0 for v in res.values()):
            raise ConfigError(f"{t.where}: {role}_resources maps names to amounts >= 0")
        out[f"{role}_resources"] = res
    c = t.table("costs")
    known = _rl_profile(c, base)  # `orchestr sim calibrate-rl`'s, when named
    out["costs"] = {
        "weight_bytes": int(
            c.get("weight_bytes", float, known.get("weight_bytes", REQUIRED), check=nonneg)
        ),
        **{
            key: c.get(key, float, known.get(key, 0.0), check=nonneg, want="seconds >= 0")
            for key in (
                "train_token_s",
                "train_step_s",
                "load_s",
                "score_s",
                "eval_s",
                "publish_s",
                "call_s",
                "call_item_s",
            )
        },
        "num_blocks": c.get("num_blocks", int, known.get("num_blocks", 1 << 15), check=pos),
        "block_size": c.get("block_size", int, known.get("block_size", 16), check=pos),
        "token_budget": c.get("token_budget", int, known.get("token_budget", 8192), check=pos),
        "engine": c.get(
            "engine",
            str,
            known.get("engine", "paged"),
            check=lambda v: v in ("paged", "recompute"),
            want="paged or recompute",
        ),
    }
    c.done()
    lengths = t.table("lengths")
    out["lengths"] = {
        "per_prompt_token": lengths.get("per_prompt_token", float, 4.0, check=pos),
        "sigma": lengths.get("sigma", float, 0.0, check=nonneg),
        "cap": lengths.get("cap", int, 1 << 15, check=pos),
        "requested": lengths.get("requested", bool, False),
    }
    lengths.done()
    t.done()
    return out


def _rl_profile(c: Table, base: str) -> dict[str, Any]:
    """``[rl.costs] file``'s costs (``orchestr sim calibrate-rl``'s), under the table's own."""
    from ._rlroles import RLCosts

    file = c.get("file", str)
    if file is None:
        return {}
    try:
        costs = RLCosts.load(file if os.path.isabs(file) else os.path.join(base, file))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{c.where}: file {file!r}: {exc}") from None
    return dataclasses.asdict(costs)


def _serving(t: Table) -> dict[str, Any]:
    from orchestr.roles.serving import POLICIES

    out: dict[str, Any] = {
        "generators": t.get("generators", int, 1, check=pos),
        "prefill": t.get("prefill", int, 0, check=nonneg),
        "policy": t.get(
            "policy", str, "kv", check=lambda v: v in POLICIES, want=" or ".join(POLICIES)
        ),
        "min_prefill_tokens": t.get("min_prefill_tokens", int, 64, check=pos),
        "spill_at": t.get("spill_at", int, None, check=pos),
        "kv_bytes_per_token": t.get("kv_bytes_per_token", float, 0.0, check=nonneg),
        "kv_gbps": t.get("kv_gbps", float, 100.0, check=pos),
        "num_blocks": t.get("num_blocks", int, 4096, check=pos),
        "block_size": t.get("block_size", int, 16, check=pos),
        "max_batch": t.get("max_batch", int, 256, check=pos),
        "token_budget": t.get("token_budget", int, 2048, check=pos),
        "ttft_slo_s": t.get("ttft_slo_s", float, None, check=pos),
        "tpot_slo_s": t.get("tpot_slo_s", float, None, check=pos),
        "request_s": t.get("request_s", float, 0.0, check=nonneg),
        "handoff_s": t.get("handoff_s", float, 0.0, check=nonneg),
        "cpus": t.get("cpus", float, None, check=pos),
        "token_cpu_s": t.get("token_cpu_s", list, []),
    }
    if not all(
        isinstance(v, int | float) and not isinstance(v, bool) and v >= 0
        for v in out["token_cpu_s"]
    ) or (out["token_cpu_s"] and out["cpus"] is None):
        raise ConfigError(
            f"{t.where}: token_cpu_s must be seconds >= 0 a token for each "
            f"thread, with cpus set, got {out['token_cpu_s']!r}"
        )
    w = t.table("workload")
    spans = {}
    for key, default in (("prompt_tokens", [32, 1024]), ("output_tokens", [16, 512])):
        span = w.get(key, list, default)
        if not (
            len(span) == 2
            and all(isinstance(v, int) and v > 0 for v in span)
            and span[0] <= span[1]
        ):
            raise ConfigError(f"{w.where}: {key} must be [low, high], positive ints, got {span!r}")
        spans[key] = span
    out["workload"] = {
        "requests": w.get("requests", int, 1000, check=pos),
        "rate": w.get("rate", float, 10.0, check=pos, want="requests/s > 0"),
        "shared_prefixes": w.get("shared_prefixes", int, 0, check=nonneg),
        "shared_prefix_tokens": w.get("shared_prefix_tokens", int, 0, check=nonneg),
        **spans,
    }
    w.done()
    t.done()
    return out


def _fat_tree(topo: Mapping[str, Any]) -> tuple[Any, Any]:
    from orchestr.fabric import optical as o

    if topo.get("one_host"):
        from ._cluster import one_host

        return one_host(accelerators=topo["accelerators"]), None

    layer = None
    if "ocs" in topo:
        c = topo["ocs"]
        latency = o.ReconfigLatency(switch_ms=0.0, settle_ms=0.0, control_ms=c["reconfig_ms"])
        layer = o.OcsLayer(count=c["count"], uplinks=c["uplinks"], gbps=c["gbps"], latency=latency)
    args = {k: v for k, v in topo.items() if k not in ("k", "ocs")}
    topology = o.fat_tree(topo["k"], **args, ocs=layer)
    fabric = None
    if layer is not None:
        # the switch takes what the planner's cost model charges: reconfig_ms, end to end
        seconds = topo["ocs"]["reconfig_ms"] / 1000
        drivers = {x.name: o.SimOcs(x.radix, rng=0, latency=seconds) for x in topology.ocs}
        fabric = o.FabricManager(topology, drivers, o.RecordingRouter())
    return topology, fabric


def run_scenario(scenario: Scenario, out: str | None = None) -> dict[str, Any]:
    """Run ``scenario``; with ``out``, write ``metrics.json`` and ``trace.json`` (Perfetto)
    there. Returns the metrics."""
    if out is not None:
        os.makedirs(out, exist_ok=True)
    if scenario.kind == "rl":
        metrics = _run_rl(scenario, out)
    else:
        metrics = _run_serving(scenario, out)
    metrics = {"scenario": scenario.path, "kind": scenario.kind, "seed": scenario.seed, **metrics}
    if out is not None:
        with open(os.path.join(out, "metrics.json"), "w", encoding="utf-8") as f:
            json.dump(metrics, f, indent=1, default=str)
            f.write("\n")
    return metrics


def _run_rl(s: Scenario, out: str | None) -> dict[str, Any]:
    from orchestr.roles.rl import GRPOConfig, TrainConfig

    from ._rl import simulate_grpo
    from ._rlroles import OutputLengths, RLCosts

    rl = s.body
    topology, fabric = _fat_tree(s.topology)
    tc = dataclasses.replace(
        TrainConfig(),
        seed=s.seed,
        steps=rl["steps"],
        prompts_per_step=rl["prompts_per_step"],
        group_size=rl["group_size"],
        eval_every=max(rl["steps"], 1),
    )
    try:
        config = GRPOConfig(
            train=tc,
            mode=rl["mode"],
            generators=rl["generators"],
            trainers=rl["trainers"],
            rewards=rl["rewards"],
            eta=rl["eta"],
            lookahead=rl["lookahead"],
            long_generators=rl["long_generators"],
            max_batch=rl["max_batch"],
            generator_nice=rl["generator_nice"],
        )
    except ValueError as exc:
        raise ConfigError(f"{s.path}: [rl]: {exc}") from None
    costs = RLCosts(generation=s.profile["model"], **rl["costs"])
    lengths = OutputLengths(**rl["lengths"], seed=s.seed)
    resources = {"generator": rl["generator_resources"], "trainer": rl["trainer_resources"]}
    trace_dir = os.path.join(out, "events") if out is not None else None
    try:
        run = simulate_grpo(
            config,
            topology,
            costs,
            lengths,
            seed=s.seed,
            resources=resources,
            fabric=fabric,
            trace_dir=trace_dir,
            host_cpus=rl["host_cpus"],
        )
    except PlacementError as exc:
        first = str(exc).split(";")[0]  # the head lists every node after it
        raise ConfigError(f"{s.path}: [rl]: the roles do not fit [topology]: {first}") from None
    if out is not None:
        export_trace(os.path.join(run.trace_dir, "events.jsonl"), os.path.join(out, "trace.json"))
    metrics = run.summary()
    metrics["accelerators"] = len(topology.accelerators)
    if fabric is not None:
        metrics["fabric"] = [{"phase": r.phase, "status": r.status} for r in fabric.history]
    return metrics


def _run_serving(s: Scenario, out: str | None) -> dict[str, Any]:
    from ._serving import ServingRequest, simulate_serving

    body = dict(s.body)
    w = body.pop("workload")
    slo = (body.pop("ttft_slo_s"), body.pop("tpot_slo_s"))
    rng = random.Random(s.seed)
    prefixes = [
        [rng.randrange(32000) for _ in range(w["shared_prefix_tokens"])]
        for _ in range(w["shared_prefixes"])
    ]
    requests, at = [], 0.0
    for i in range(w["requests"]):
        at += rng.expovariate(w["rate"])
        own = [rng.randrange(32000) for _ in range(rng.randint(*w["prompt_tokens"]))]
        prompt = [*rng.choice(prefixes), *own] if prefixes else own
        requests.append(ServingRequest(f"r{i}", at, prompt, rng.randint(*w["output_tokens"])))
    try:
        run = simulate_serving(requests, s.profile["model"], seed=s.seed, **body)
    except ValueError as exc:
        raise ConfigError(f"{s.path}: [serving]: {exc}") from None
    if out is not None:
        _serving_trace(run, out)
    metrics = run.summary(*slo)
    metrics["generators"] = body["generators"] + body["prefill"]
    return metrics


def _serving_trace(run: Any, out: str) -> None:
    """Each request as spans on its generator's track: waiting to its first token, then
    decoding to its end."""
    log_path = os.path.join(out, "events.jsonl")
    if os.path.exists(log_path):
        os.remove(log_path)
    log = EventLog(log_path)
    try:
        for s in run.served:
            if math.isnan(s.end):
                continue
            track = s.worker or "front door"
            log.record_span(s.id, s.arrival, s.ttft, track=track, kind="prefill", path=s.path)
            log.record_span(
                s.id,
                s.first_token,
                s.end - s.first_token,
                track=track,
                kind="decode",
                tokens=s.output_tokens,
            )
    finally:
        log.close()
    export_trace(log_path, os.path.join(out, "trace.json"))
