"""orchestr.sim: orchestr's own control code on virtual time.

- :class:`Engine`: the discrete-event core; virtual time in integer nanoseconds, a heap of
  callbacks ordered by time and then by scheduling order, one seeded random source, an
  optional trace. The same scheduling and seed give the same trace, bit for bit.
- :class:`VirtualLoop`: asyncio's loop on the engine's clock; where it would wait it runs the
  engine's next event, so async control code (the fabric manager, the reconfiguration
  transaction, the RL jobs) runs unchanged and time jumps instead of passing.
- :class:`Simulation` / :func:`run`: both, with :mod:`orchestr.clock` (the seam every clock
  reading of the control code goes through) reading virtual time during a run.
- :class:`FlowNet`: the network at flow level, links shared max-min fairly, over a cabling
  plan's links (and optical circuits); :func:`collective` moves a collective's schedule over it
  (:func:`collective_time`: alone on a topology), which on free links gives the cost model's
  closed forms.
- :class:`SimGenerator`: the generator's own scheduler (``orchestr.roles.generator``) on the
  engine's clock, each step timed by a :class:`StepTimeModel` (:func:`fit_step_model` fits one
  to measured steps).
- :class:`SimCluster` / :class:`SimContext`: a topology's hosts in the head's own placement,
  role models (:class:`Role`) as their actors, and a job context whose meshes are real mesh
  handles calling those models; a job's own ``main(ctx)`` runs against it unchanged. With
  ``cpus``, each host's cores are shared by the roles' compute (``_cpu``); :func:`one_host`
  is one machine on its own, as the live jobs' embedded cluster.
- :func:`simulate_grpo`: the GRPO job's own code (``orchestr.roles.rl``: sync, stream,
  stream+skew) on a simulated cluster, its roles costed by :class:`RLCosts` and its output
  lengths drawn by :class:`OutputLengths`.
- :func:`simulate_serving`: the front door's own router (``orchestr.roles.serving.Router``)
  over simulated generators, co-located or with prefill and decode apart, for a workload of
  :class:`ServingRequest`.
- :func:`simulate_layouts`: a generation pool at a static tensor-parallel degree or re-picking
  it as the RL job's policy says (:func:`orchestr.roles.rl.choose_layout`, OrchestrRL's
  adaptive compute scheduler), its all-reduces priced on the flow network
  (:func:`pool_costs`).
- :func:`simulate_pipeline`: a pipeline-parallel step (``orchestr.roles.pipeline``'s
  schedules) with its activations and gradients as flows between the ranks' hosts.
- :func:`load_scenario` / :func:`run_scenario`: a TOML scenario (``orchestr sim run``);
  :func:`roofline`: a step-time profile from an accelerator's published figures.

Everything from :class:`SimGenerator` on is loaded on first use: it imports the roles (and
torch).
"""

from typing import TYPE_CHECKING, Any

from ._collectives import KINDS, collective, collective_time
from ._engine import Engine, Event, SimulationError, ns
from ._flows import Flow, FlowNet, max_min_rates
from ._loop import VirtualClock, VirtualLoop
from ._run import Simulation, run

if TYPE_CHECKING:
    from ._calibrate import fit_step_model
    from ._cluster import Role, SimCluster, SimContext, one_host
    from ._generation import RequestTimes, SimGenerator, StepTimeModel
    from ._layouts import LayoutRun, pool_costs, simulate_layouts
    from ._pipeline import simulate_pipeline
    from ._profiles import roofline
    from ._rl import RLRun, simulate_grpo
    from ._rlroles import OracleRanker, OutputLengths, RandomRanker, RLCosts
    from ._scenario import load_scenario, run_scenario
    from ._serving import ServingRequest, ServingRun, simulate_serving

_LAZY = {
    "RequestTimes": "_generation",
    "SimGenerator": "_generation",
    "StepTimeModel": "_generation",
    "fit_step_model": "_calibrate",
    "Role": "_cluster",
    "SimCluster": "_cluster",
    "SimContext": "_cluster",
    "one_host": "_cluster",
    "OutputLengths": "_rlroles",
    "RLCosts": "_rlroles",
    "OracleRanker": "_rlroles",
    "RandomRanker": "_rlroles",
    "RLRun": "_rl",
    "simulate_grpo": "_rl",
    "ServingRequest": "_serving",
    "ServingRun": "_serving",
    "simulate_serving": "_serving",
    "load_scenario": "_scenario",
    "run_scenario": "_scenario",
    "roofline": "_profiles",
    "simulate_pipeline": "_pipeline",
    "LayoutRun": "_layouts",
    "pool_costs": "_layouts",
    "simulate_layouts": "_layouts",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "KINDS",
    "Engine",
    "Event",
    "Flow",
    "FlowNet",
    "LayoutRun",
    "OracleRanker",
    "OutputLengths",
    "RLCosts",
    "RLRun",
    "RandomRanker",
    "RequestTimes",
    "Role",
    "ServingRequest",
    "ServingRun",
    "SimCluster",
    "SimContext",
    "SimGenerator",
    "Simulation",
    "SimulationError",
    "StepTimeModel",
    "VirtualClock",
    "VirtualLoop",
    "collective",
    "collective_time",
    "fit_step_model",
    "load_scenario",
    "max_min_rates",
    "ns",
    "one_host",
    "pool_costs",
    "roofline",
    "run",
    "run_scenario",
    "simulate_grpo",
    "simulate_layouts",
    "simulate_pipeline",
    "simulate_serving",
]
