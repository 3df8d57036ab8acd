"""A generator's expert routing, exported through the head's ``GET /metrics``
(:mod:`orchestr.metrics`), tagged ``engine`` (the generator, ``mesh[rank]``):

=====================================  =========  ==============================================
name                                   kind       meaning
=====================================  =========  ==============================================
``orchestr:expert_tokens``             counter    (token, expert) pairs routed, by ``layer`` and
                                                  ``expert``
``orchestr:expert_load``               gauge      those pairs over the load window
``orchestr:expert_balancedness``       gauge      mean over max pairs per host over the window,
                                                  by ``layer``, under the map routing now
``orchestr:expert_hosts_lost``         counter    hosts whose call failed and left the map
``orchestr:expert_pairs_resent``       counter    pairs sent again after such a failure
=====================================  =========  ==============================================

Recorded on the actor's event loop (never from the engine's thread), once per MoE layer
pass.
"""

from __future__ import annotations

import torch

from orchestr import metrics

from ._dispatch import ExpertMap

__all__ = ["ExpertMetrics", "map_balancedness"]


def map_balancedness(holders: list[list[int]], load: list[int]) -> float:
    """Mean over max of the pairs each host would take of ``load`` (pairs per expert), an
    expert's pairs split evenly over ``holders[expert]`` (1.0 with no load or no hosts)."""
    per_host: dict[int, float] = {}
    for e, hosts in enumerate(holders):
        for h in hosts:
            per_host[h] = per_host.get(h, 0.0) + load[e] / len(hosts)
    hosts_seen = {h for hosts in holders for h in hosts}
    if not hosts_seen or max(per_host.values(), default=0) == 0:
        return 1.0
    return sum(per_host.values()) / len(hosts_seen) / max(per_host.values())


class ExpertMetrics:
    def __init__(self, engine: str) -> None:
        self.engine = engine
        per_expert = ("engine", "layer", "expert")
        self._tokens = metrics.Counter(
            "orchestr:expert_tokens", "(token, expert) pairs routed to each expert.", per_expert
        )
        self._load = metrics.Gauge(
            "orchestr:expert_load", "Pairs routed to each expert over the load window.", per_expert
        )
        self._balance = metrics.Gauge(
            "orchestr:expert_balancedness",
            "Mean over max pairs per expert host over the load window.",
            ("engine", "layer"),
        )
        self._lost = metrics.Counter(
            "orchestr:expert_hosts_lost", "Expert hosts whose call failed.", ("engine",)
        )
        self._resent = metrics.Counter(
            "orchestr:expert_pairs_resent", "Pairs sent again after a host failed.", ("engine",)
        )

    def routed(
        self, layer: int, counts: torch.Tensor, window: list[int], current: ExpertMap | None
    ) -> None:
        """One pass of ``layer``: ``counts`` pairs per expert now, ``window`` over the window."""
        for e, (n, w) in enumerate(zip(counts.tolist(), window, strict=True)):
            tags = {"engine": self.engine, "layer": str(layer), "expert": str(e)}
            if n:
                self._tokens.inc(n, tags)
            self._load.set(w, tags)
        if current is not None and layer in current.holders:
            balance = map_balancedness(current.holders[layer], window)
            self._balance.set(balance, {"engine": self.engine, "layer": str(layer)})

    def failed(self, hosts: int, pairs: int) -> None:
        self._lost.inc(hosts, {"engine": self.engine})
        self._resent.inc(pairs, {"engine": self.engine})
