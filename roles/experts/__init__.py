"""orchestr.roles.experts: MoE experts on hosts of their own.

- :func:`rebalance` places each layer's experts (with replicas) on expert hosts by measured
  load: ``eplb`` mode is DeepSeek's expert-parallel load balancer, ``stable`` balances as well
  while moving as few experts as it can from the placement now serving. :func:`balancedness`
  and :func:`experts_moved` measure a placement. Sans-IO.
- :class:`ExpertHost` actors hold some experts of some layers of a MoE checkpoint (read
  straight from its safetensors, only those tensors) and run them for generators.
- A generator given ``expert_hosts=`` routes each sparse layer's tokens there:
  :class:`ExpertMap` plans one call per host per layer (replicas take turns), the hosts'
  partial sums are combined back in token order (:func:`attach_experts`); :class:`LoadWindow`
  counts each expert's tokens over recent passes.
"""

from ._dispatch import ExpertMap, LoadWindow, Send, combine, run_experts
from ._host import ExpertHost, ExpertUnavailableError
from ._placement import (
    MODES,
    Placement,
    balancedness,
    experts_moved,
    host_loads,
    rebalance,
)
from ._remote import ExpertClient, attach_experts

__all__ = [
    "MODES",
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
    "host_loads",
    "rebalance",
    "run_experts",
]
