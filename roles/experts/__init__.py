"""orchestr.roles.experts: MoE experts on hosts of their own.

- :func:`rebalance` places each layer's experts (with replicas) on expert hosts by measured
  load: ``eplb`` mode is DeepSeek's expert-parallel load balancer, ``stable`` balances as well
  while moving as few experts as it can from the placement now serving. :func:`balancedness`
  and :func:`experts_moved` measure a placement. Sans-IO.
"""

from ._placement import (
    MODES,
    Placement,
    balancedness,
    experts_moved,
    host_loads,
    rebalance,
)

__all__ = [
    "MODES",
    "Placement",
    "balancedness",
    "experts_moved",
    "host_loads",
    "rebalance",
]
