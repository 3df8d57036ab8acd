"""Dispatch and combine for experts on other hosts, and the load they see. No I/O here.

A MoE layer routes each token to its top-k experts with weights. :meth:`ExpertMap.plan`
turns one layer's routing ``experts [n, k]``, ``weights [n, k]`` into one :class:`Send` per
host: the rows of the tokens it needs (each once, ascending) and, per (token, expert) pair it
runs, the token's position among those rows, the expert and its weight. A logical expert with
several replicas has its pairs dealt over them in turn (the j-th pair routed to it goes to
replica ``j mod replicas``), so each replica takes an equal share of each batch.
:func:`run_experts` is what a host does with a send (the weighted sum of its experts' outputs
per token, experts in ascending order, as the model's own :class:`SparseMoE` does), and
:func:`combine` adds the hosts' partial sums back in token order.

:class:`LoadWindow` counts the tokens routed to each expert of each layer over the last
``window`` forward passes: the load a placement (:func:`~._placement.rebalance`) balances.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ExpertMap", "LoadWindow", "Send", "combine", "run_experts"]


@dataclass(frozen=True)
class Send:
    """One layer's work for one host: ``x[rows]`` goes, and pair ``j`` asks for expert
    ``experts[j]`` of token ``rows[slot[j]]`` with weight ``weights[j]``."""

    host: int
    rows: torch.Tensor
    slot: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor


class ExpertMap:
    """Which hosts hold which experts: ``holders[layer][expert]`` lists the hosts with a
    replica (a host may appear once per replica it holds; an expert may have none, which
    :meth:`holes` names and :meth:`plan` refuses)."""

    def __init__(self, holders: Mapping[int, Sequence[Sequence[int]]]) -> None:
        self.holders = {layer: [list(h) for h in row] for layer, row in holders.items()}
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, row in self.holders.items():
            widest = max(1, *(len(hosts) for hosts in row))
            table = torch.tensor([[*hosts, *[-1] * (widest - len(hosts))] for hosts in row])
            self._tables[layer] = (table, torch.tensor([len(hosts) for hosts in row]))

    @classmethod
    def of_hosts(
        cls,
        hosted: Sequence[Mapping[int, Sequence[int]]],
        experts: int,
        layers: Sequence[int] = (),
    ) -> ExpertMap:
        """The map from what each host says it holds (``hosted[host][layer]``: experts), with
        an entry for every layer in ``layers`` too. Raises ``ValueError`` for an expert out of
        range."""
        holders: dict[int, list[list[int]]] = {
            layer: [[] for _ in range(experts)] for layer in layers
        }
        for host, held_layers in enumerate(hosted):
            for layer, held in held_layers.items():
                row = holders.setdefault(int(layer), [[] for _ in range(experts)])
                for e in held:
                    if not 0 <= e < experts:
                        raise ValueError(f"host {host} says it holds expert {e} of {experts}")
                    row[e].append(host)
        return cls(holders)

    def holes(self, layers: Sequence[int], experts: int) -> list[tuple[int, int]]:
        """``(layer, expert)`` of ``layers`` that no host holds."""
        out = []
        for layer in layers:
            row = self.holders.get(layer, [])
            out += [(layer, e) for e in range(experts) if e >= len(row) or not row[e]]
        return out

    def without(self, hosts: set[int]) -> ExpertMap:
        """This map with ``hosts`` holding nothing."""
        if not hosts:
            return self
        return ExpertMap(
            {
                layer: [[h for h in held if h not in hosts] for held in row]
                for layer, row in self.holders.items()
            }
        )

    @property
    def layers(self) -> list[int]:
        return sorted(self.holders)

    def plan(self, layer: int, experts: torch.Tensor, weights: torch.Tensor) -> list[Send]:
        """One :class:`Send` per host that has work, in host order."""
        table, counts = self._tables[layer]
        n, k = experts.shape
        flat = experts.reshape(-1)
        if flat.numel() and int(counts[flat].min()) == 0:
            orphan = int(flat[counts[flat] == 0][0])
            raise ValueError(f"layer {layer}: no host holds expert {orphan}")
        token = torch.arange(n).repeat_interleave(k)
        # the j-th pair routed to expert e (in token order) goes to its replica j mod count
        order = torch.argsort(flat, stable=True)
        per_expert = torch.bincount(flat, minlength=len(counts))
        starts = torch.cumsum(per_expert, 0) - per_expert
        nth = torch.empty_like(flat)
        nth[order] = torch.arange(flat.numel()) - starts[flat[order]]
        host = table[flat, nth % counts[flat]]
        sends = []
        flat_w = weights.reshape(-1)
        for h in torch.unique(host).tolist():
            mask = host == h
            rows, slot = torch.unique(token[mask], return_inverse=True)
            sends.append(Send(h, rows, slot, flat[mask], flat_w[mask]))
        return sends


def run_experts(
    modules: Mapping[int, nn.Module],
    x: torch.Tensor,
    slot: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """Per row of ``x``, the weighted sum of the outputs of the experts its pairs name
    (``modules[expert]``), experts in ascending order. Raises ``KeyError`` naming an expert
    ``modules`` lacks."""
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        module = modules.get(e)
        if module is None:
            raise KeyError(e)
        pairs = (experts == e).nonzero(as_tuple=True)[0]
        rows = slot[pairs]
        y = module(x[rows]) * weights[pairs, None]
        out.index_add_(0, rows, y.to(out.dtype))
    return out


def combine(
    x: torch.Tensor, sends: Sequence[Send], outputs: Sequence[torch.Tensor]
) -> torch.Tensor:
    """The hosts' partial sums added back into ``[n, hidden]`` in token order."""
    out = torch.zeros_like(x)
    for send, y in zip(sends, outputs, strict=True):
        out.index_add_(0, send.rows, y.to(out.dtype))
    return out


class LoadWindow:
    """Tokens routed to each expert of each MoE layer over the last ``window`` forward
    passes (each call of :meth:`add` for a layer is one pass of that layer)."""

    def __init__(self, layers: Sequence[int], experts: int, window: int = 64) -> None:
        if window < 1:
            raise ValueError(f"the load window must hold at least one pass, not {window}")
        self.experts = experts
        self._passes = {layer: deque[torch.Tensor](maxlen=window) for layer in layers}
        self._totals = {layer: torch.zeros(experts, dtype=torch.int64) for layer in layers}

    def add(self, layer: int, experts: torch.Tensor) -> torch.Tensor:
        """Count one pass of ``layer`` routed as ``experts``; returns its counts per expert."""
        counts = torch.bincount(experts.reshape(-1), minlength=self.experts)
        passes = self._passes[layer]
        if len(passes) == passes.maxlen:
            self._totals[layer] -= passes[0]
        passes.append(counts)
        self._totals[layer] += counts
        return counts

    def of(self, layer: int) -> list[int]:
        """Tokens per expert of ``layer`` over the window."""
        return self._totals[layer].tolist()

    def load(self) -> dict[int, list[int]]:
        """``{layer: tokens per expert}`` over the window."""
        return {layer: total.tolist() for layer, total in self._totals.items()}
