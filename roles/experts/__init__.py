"""orchestr.roles.experts: MoE experts on hosts of their own.

- :func:`rebalance` places each layer's experts (with replicas) on expert hosts by measured
  load: ``eplb`` mode is DeepSeek's expert-parallel load balancer, ``stable`` balances as well
  while moving as few experts as it can from the placement now serving. :func:`balancedness`
  and :func:`experts_moved` measure a placement. Sans-IO.
- :class:`ExpertHost` actors hold some experts of some layers of a MoE checkpoint (read
  straight from its safetensors, only those tensors) and run them for generators.
- A generator given ``experts=`` routes each sparse layer's tokens there:
  :class:`ExpertMap` plans one call per host per layer (replicas take turns), the hosts'
  partial sums are combined back in token order (:func:`attach_experts`); a host runs its
  experts with their products packed for the CPU (:func:`packed_experts`); :class:`LoadWindow`
  counts each expert's tokens over recent passes. A host that dies leaves the map and its
  pairs go to other replicas; an expert with none fails the step or waits for a host
  (``on_lost``).
- :func:`rebalance_serving` applies a new placement while the generators serve: new replicas
  loaded first, the switch between two engine steps, old ones dropped last.
"""

from ._dispatch import ExpertMap, LoadWindow, Send, combine, packed_experts, run_experts
from ._host import ExpertHost, ExpertUnavailableError
from ._placement import (
    MODES,
    Placement,
    balancedness,
    experts_moved,
    host_loads,
    rebalance,
)
from ._rebalance import (
    holder_balancedness,
    host_experts,
    placement_of,
    rebalance_serving,
    spawn_expert_hosts,
)
from ._remote import ON_LOST, ExpertClient, attach_experts

__all__ = [
    "MODES",
    "ON_LOST",
    "ExpertClient",
    "ExpertHost",
    "ExpertMap",
    "ExpertUnavailableError",
    "LoadWindow",
    "Placement",
    "Send",
    "attach_experts",
    "balancedness",
    "combine",
    "experts_moved",
    "holder_balancedness",
    "host_experts",
    "host_loads",
    "packed_experts",
    "placement_of",
    "rebalance",
    "rebalance_serving",
    "run_experts",
    "spawn_expert_hosts",
]
