"""The optical fabric manager: cabling plans, circuit planning, reconfiguration, OCS drivers.

A separate system from the data plane beside it (``orchestr.fabric``): it changes which
switches optical circuits join between job phases, while the data plane moves bytes over
whatever the network is. The head runs one :class:`FabricManager` when it starts with a
cabling plan (``orchestr start --head --fabric plan.toml``); jobs send it phase hints.

- **plans**: :class:`Topology` (hosts, NICs, switches, links, OCS ports), read with
  :func:`load_topology` / :func:`topology_from_dict`, checked as it is built;
- **generated plans**: :func:`fat_tree` (with an :class:`OcsLayer` of circuits on top);
- **cost**: :func:`collective_demand` and :class:`ReconfigCost` price a phase's traffic and a
  reconfiguration; :func:`collective_s` and the closed forms it picks from
  (:func:`ring_all_reduce_s`, :func:`reduce_scatter_s`, :func:`all_gather_s`,
  :func:`broadcast_s`, :func:`all_to_all_s`) time a collective on uncongested links;
- **planning**: :class:`GreedyPlanner` turns a :class:`PlanRequest` into a :class:`Plan`;
  :class:`CommitPolicy` says when one is worth its cost;
- **the manager**: :class:`FabricManager` takes :class:`Hint` s (see :func:`hint_demand`) and
  applies plans through the reconfiguration transaction (:class:`Reconfigurator`), leaving a
  :class:`PlanRecord` for each;
- **drivers**: the :class:`OcsDriver` protocol, the in-process :class:`SimOcs` and the
  network-namespace :class:`NetnsOcs` (with :class:`NetnsFabric` and :class:`NetnsRouter`);
  :func:`check_ocs_driver` is the conformance suite an out-of-tree driver passes.
"""

from __future__ import annotations

from ._optical._circuits import Circuit, Installed
from ._optical._conformance import check_ocs_driver
from ._optical._costmodel import (
    ReconfigCost,
    all_gather_s,
    all_to_all_s,
    broadcast_s,
    collective_demand,
    collective_s,
    reduce_scatter_s,
    ring_all_reduce_s,
)
from ._optical._elements import ReconfigLatency, TopologyError
from ._optical._fattree import OcsLayer, fat_tree
from ._optical._manager import FabricManager, Hint, PlanRecord, hint_demand
from ._optical._netns import NetnsError, NetnsFabric, netns_missing
from ._optical._netns_kernel import free_subnets
from ._optical._ocs import (
    InvalidProgramError,
    OcsDriver,
    OcsError,
    PortFailedError,
    StaleGenerationError,
    VerifyError,
)
from ._optical._ocs_netns import NetnsOcs, NetnsRouter
from ._optical._ocs_sim import SimOcs
from ._optical._plan import CommitPolicy, Plan, PlanRequest
from ._optical._planner import GreedyPlanner
from ._optical._reconfig import Changes, InvariantError, Reconfigurator
from ._optical._routing import RecordingRouter, Router
from ._optical._topology import Topology
from ._optical._topology_file import dump_topology, load_topology, topology_from_dict

__all__ = [
    "Changes",
    "Circuit",
    "CommitPolicy",
    "FabricManager",
    "GreedyPlanner",
    "Hint",
    "Installed",
    "InvalidProgramError",
    "InvariantError",
    "NetnsError",
    "NetnsFabric",
    "NetnsOcs",
    "NetnsRouter",
    "OcsDriver",
    "OcsError",
    "OcsLayer",
    "Plan",
    "PlanRecord",
    "PlanRequest",
    "PortFailedError",
    "ReconfigCost",
    "ReconfigLatency",
    "Reconfigurator",
    "RecordingRouter",
    "Router",
    "SimOcs",
    "StaleGenerationError",
    "Topology",
    "TopologyError",
    "VerifyError",
    "all_gather_s",
    "all_to_all_s",
    "broadcast_s",
    "check_ocs_driver",
    "collective_demand",
    "collective_s",
    "dump_topology",
    "fat_tree",
    "free_subnets",
    "hint_demand",
    "load_topology",
    "netns_missing",
    "reduce_scatter_s",
    "ring_all_reduce_s",
    "topology_from_dict",
]
