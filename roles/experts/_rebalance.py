"""A new placement applied while serving, without stopping a request.

:func:`rebalance_serving` reads the load the generators measured (their sliding windows),
computes a placement (:func:`~._placement.rebalance`), and applies it in three phases:

1. **load**: every host reads the experts it gains, in a thread, while it goes on serving
   (``ExpertHost.load``); the old placement still routes.
2. **switch**: every generator routes by the new map from its next engine step on
   (``Generator.route_experts``, taken under its engine lock, so between two steps).
3. **drop**: hosts let go of what they no longer hold. A generator that missed the switch (a
   race with a restart) gets :class:`ExpertUnavailableError` from the host for a dropped
   expert and asks the hosts afresh, so nothing is lost.

The only pause a request sees is the switch: waiting for the step in progress, which it would
wait for anyway, and swapping a map.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import orchestr as oc
from orchestr.roles._common._hf._config import read_config
from orchestr.roles._common._hf._load import ffn_units

from ._host import ExpertHost
from ._placement import Placement, balancedness, rebalance

__all__ = [
    "holder_balancedness",
    "host_experts",
    "placement_of",
    "rebalance_serving",
    "spawn_expert_hosts",
]


async def spawn_expert_hosts(
    ctx: oc.JobContext,
    checkpoint: str,
    n: int,
    *,
    replicas: int | None = None,
    ffn_shards: int | None = None,
    restarts: int = 3,
    **spawn: Any,
) -> oc.Mesh:
    """``n`` :class:`ExpertHost` actors holding every routed expert of the MoE checkpoint
    ``checkpoint`` (or every layer's MLP of a dense one, cut into ``ffn_shards`` slices,
    default ``n``: one slice of each layer per host): ``replicas`` slots per layer (default
    the fewest that fill whole hosts), placed by :func:`rebalance` for an even load. A host
    that dies is restarted up to ``restarts`` times (with its spawn placement), then left
    dead. ``spawn`` goes to ``ctx.spawn`` (``resources``, ``labels``...). Raises
    :class:`orchestr.ConfigError` for ``ffn_shards`` that does not fit the checkpoint and what
    ``ctx.spawn`` raises."""
    cfg = read_config(checkpoint)
    if n < 1:
        raise oc.ConfigError(f"expert hosts must be 1 or more, got {n}")
    if cfg.moe is None and ffn_shards is None:
        ffn_shards = n
    layers, experts = ffn_units(cfg, ffn_shards, checkpoint)
    slots = replicas or experts
    slots += -slots % n  # whole hosts
    placement = rebalance([[1.0] * experts for _ in layers], slots, 1, 1, n)
    return await ctx.spawn(
        ExpertHost,
        checkpoint,
        n=n,
        name=spawn.pop("name", "experts"),
        placement=host_experts(placement, layers),
        ffn_shards=ffn_shards,
        restart=oc.RestartPolicy(max_restarts=restarts),
        supervise=lambda failure: "restart" if failure.can_restart else "handle",
        **spawn,
    )


def host_experts(placement: Placement, layers: Sequence[int]) -> list[dict[int, list[int]]]:
    """Per host rank, ``{layer: experts}`` under ``placement``, whose rows are ``layers`` in
    order (an expert placed twice on one host is held once)."""
    return [
        {layer: sorted(set(placement.experts_on(i, host))) for i, layer in enumerate(layers)}
        for host in range(placement.num_hosts)
    ]


def placement_of(
    hosted: Sequence[Mapping[int, Sequence[int]]], layers: Sequence[int], experts: int
) -> Placement | None:
    """What the hosts hold as a :class:`Placement`, when each holds as many experts as the
    others of every layer and every expert is held (else ``None``)."""
    rows = []
    for layer in layers:
        held = [sorted(h.get(layer, [])) for h in hosted]
        if len({len(x) for x in held}) != 1:
            return None
        rows.append([e for x in held for e in x])
        if set(rows[-1]) != set(range(experts)):
            return None
    log_to_phy = [
        [[p for p, e in enumerate(row) if e == x] for x in range(experts)] for row in rows
    ]
    replicas = [[len(s) for s in layer] for layer in log_to_phy]
    return Placement(rows, log_to_phy, replicas, len(hosted))


def holder_balancedness(
    hosted: Sequence[Mapping[int, Sequence[int]]],
    load: Mapping[int, Sequence[float]],
) -> float:
    """Mean over max tokens per host, summed over ``load``'s layers, when each expert's
    tokens are split evenly over the hosts holding it."""
    mean = peak = 0.0
    for layer, row in load.items():
        holders = Counter(e for h in hosted for e in h.get(layer, []))
        per_host = [
            sum(row[e] / holders[e] for e in h.get(layer, []) if holders[e]) for h in hosted
        ]
        mean += sum(per_host) / len(per_host)
        peak += max(per_host)
    return 1.0 if peak == 0 else mean / peak


async def rebalance_serving(
    hosts: oc.Mesh,
    generators: oc.Mesh,
    *,
    mode: str = "stable",
    num_replicas: int | None = None,
    num_groups: int = 1,
    num_nodes: int = 1,
    load: Mapping[int, Sequence[float]] | None = None,
) -> dict[str, Any]:
    """Place the experts of ``hosts`` anew for ``load`` (``{layer: tokens per expert}``;
    default the sum of ``generators``' load windows) and apply it while they serve.
    ``num_replicas`` defaults to the replicas held now. Returns what it did:
    ``experts_moved`` (experts hosts loaded), ``experts_dropped``,
    ``balancedness_before``/``_after`` (under that load, routed as the hosts held it and as the
    new placement's replicas take shares), and ``load_s``, ``switch_s``,
    ``drop_s`` (each phase's wall time). Raises ``ValueError`` for a shape
    :func:`rebalance` refuses (nothing changes then). Not cancel-safe: cancelled between
    phases, hosts may hold more experts than the placement needs (never fewer)."""
    hosted: list[dict[int, list[int]]] = await hosts.hosted.call()
    if load is None:
        measured: dict[int, list[float]] = {}
        for stats in await generators.stats.call():
            for layer, row in stats.get("experts", {}).get("load", {}).items():
                total = measured.setdefault(int(layer), [0.0] * len(row))
                for e, n in enumerate(row):
                    total[e] += n
        load = measured
    if not load:
        raise ValueError("no load to balance: the generators have routed no tokens yet")
    layers = sorted(load)
    rows = [list(load[layer]) for layer in layers]
    experts = len(rows[0])
    current = placement_of(hosted, layers, experts)
    slots = num_replicas or sum(len(h.get(layers[0], [])) for h in hosted)
    slots += -slots % len(hosted)  # whole hosts
    new = rebalance(
        rows,
        slots,
        num_groups,
        num_nodes,
        len(hosted),
        mode=mode,
        current=current if current and len(current.phy_to_log[0]) == slots else None,
    )
    target = host_experts(new, layers)
    gain = [_minus(t, h) for t, h in zip(target, hosted, strict=True)]
    lose = [_minus(h, t) for t, h in zip(target, hosted, strict=True)]
    t0 = time.perf_counter()
    await asyncio.gather(*(hosts[i].load.call_one(g) for i, g in enumerate(gain) if g))
    t1 = time.perf_counter()
    # a host placed two replicas of an expert holds it once and takes two shares of it
    holders = {
        layer: [[p // new.slots_per_host for p in new.log_to_phy[i][e]] for e in range(experts)]
        for i, layer in enumerate(layers)
    }
    await generators.route_experts.call(holders)
    t2 = time.perf_counter()
    await asyncio.gather(*(hosts[i].drop.call_one(d) for i, d in enumerate(lose) if d))
    t3 = time.perf_counter()
    by_layer = dict(zip(layers, rows, strict=True))
    return {
        "experts_moved": sum(len(v) for g in gain for v in g.values()),
        "experts_dropped": sum(len(v) for d in lose for v in d.values()),
        "balancedness_before": round(holder_balancedness(hosted, by_layer), 4),
        "balancedness_after": round(balancedness(new, rows), 4),
        "load_s": round(t1 - t0, 4),
        "switch_s": round(t2 - t1, 4),
        "drop_s": round(t3 - t2, 4),
    }


def _minus(a: Mapping[int, Sequence[int]], b: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
    out = {layer: sorted(set(held) - set(b.get(layer, []))) for layer, held in a.items()}
    return {layer: held for layer, held in out.items() if held}
