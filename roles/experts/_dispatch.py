"""Dispatch and combine for experts on other hosts, and the load they see. No I/O here.

A MoE layer routes each token to its top-k experts with weights. :meth:`ExpertMap.plan`
turns one layer's routing ``experts [n, k]``, ``weights [n, k]`` into one :class:`Send` per
host: the rows of the tokens it needs (each once, ascending) and, per (token, expert) pair it
runs, the token's position among those rows, the expert and its weight. A logical expert with
several replicas has its pairs dealt over them in turn (the j-th pair routed to it goes to
replica ``j mod replicas``), so each replica takes an equal share of each batch.
:func:`run_experts` is what a host does with a send (the weighted sum of its experts' outputs
per token, experts in ascending order, as the model's own :class:`SparseMoE` does; a host's
experts packed for the CPU: :func:`packed_experts`), and
:func:`combine` adds the hosts' partial sums back in token order.

:class:`LoadWindow` counts the tokens routed to each expert of each layer over the last
``window`` forward passes: the load a placement (:func:`~._placement.rebalance`) balances.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from orchestr.roles._common._hf._layers import MLP
from orchestr.roles._common._packed import can_pack, check, multiply, pack

Key = TypeVar("Key", bound=Hashable)

__all__ = [
    "ExpertMap",
    "LoadWindow",
    "PackedExpert",
    "Send",
    "combine",
    "packed_experts",
    "run_experts",
]


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


Expert = Callable[[torch.Tensor], torch.Tensor]


class PackedExpert:
    """One SwiGLU expert (or FFN slice: an :class:`MLP`) with its products packed for the
    CPU (:mod:`orchestr.roles._common._packed`): gate and up as one product, then down. A host
    multiplies a few rows per expert per call, where a product's time is its weight's read;
    packed, the read runs at about twice ``F.linear``'s speed."""

    __slots__ = ("down", "gate_up", "width")

    def __init__(self, mlp: MLP) -> None:
        self.width = mlp.gate_proj.out_features
        self.gate_up = pack(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        self.down = pack(mlp.down_proj.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        both = multiply(x, self.gate_up)
        return multiply(F.silu(both[:, : self.width]) * both[:, self.width :], self.down)


def packed_experts(modules: Mapping[Key, MLP]) -> dict[Key, Expert]:
    """``modules`` as :class:`PackedExpert` where packing runs here (float32 on the CPU, no
    biases; the first is checked against ``F.linear``), else as they are."""
    out: dict[Key, Expert] = {}
    checked = False
    for key, mlp in modules.items():
        weights = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if can_pack(mlp.gate_proj.weight) or any(m.bias is not None for m in weights):
            out[key] = mlp
            continue
        expert = out[key] = PackedExpert(mlp)
        if not checked:
            check(mlp.down_proj.weight, None, expert.down)
            checked = True
    return out


def run_experts(
    modules: Mapping[int, Expert],
    x: torch.Tensor,
    slot: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """Per row of ``x``, the weighted sum of the outputs of the experts its pairs name
    (``modules[expert]``), experts in ascending order and each expert's pairs in their order.
    Raises ``KeyError`` naming an expert ``modules`` lacks (before any runs)."""
    out = torch.zeros_like(x)
    if not len(experts):
        return out
    order = torch.argsort(experts, stable=True)  # the pairs grouped by expert, in one pass
    ids, counts = torch.unique_consecutive(experts[order], return_counts=True)
    ids_list = ids.tolist()
    for e in ids_list:
        if e not in modules:
            raise KeyError(e)
    rows, scale = slot[order], weights[order, None]
    start = 0
    for e, n in zip(ids_list, counts.tolist(), strict=True):
        at = slice(start, start + n)
        y = modules[e](x[rows[at]]) * scale[at]
        out.index_add_(0, rows[at], y.to(out.dtype))
        start += n
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
