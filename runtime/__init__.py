"""orchestr: an asyncio actor runtime for disaggregated AI systems.

A job is an async ``main(ctx)``; ``ctx.spawn`` creates meshes of actors, whose endpoints are
called with ``call`` / ``call_one`` / ``choose`` / ``stream`` / ``broadcast``::

    import orchestr as oc

    class Counter(oc.Actor):
        def __init__(self, start: int = 0):
            self.v = start

        @oc.endpoint
        def add(self, n: int) -> int:
            self.v += n
            return self.v

    async def main(ctx: oc.JobContext) -> None:
        counters = await ctx.spawn(Counter, n=4)
        print(await counters.add.call(1))

    oc.run(main)
"""

import os as _os

# Workers are started with fork+exec; gRPC's fork handlers are for fork without exec and only
# print warnings here.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from ._actor import Actor, endpoint
from ._channelstate import Staleness
from ._driver import JobContext, open_local_cluster, run
from ._graph import Graph, GraphNode, Versioned
from ._graphrun import GraphRun
from ._mesh import Endpoint, Mesh
from ._phases import Collective
from ._serde import register
from ._supervise import Failure, RestartPolicy
from .config import Config, load_config
from .errors import (
    ActorDiedError,
    ActorError,
    AuthenticationError,
    BrokenResourceError,
    CallError,
    CallTimeoutError,
    ClosedResourceError,
    ConfigError,
    ControlPlaneError,
    DescriptorError,
    FallbackError,
    MeshError,
    MessageTooLargeError,
    OrchestrError,
    PlacementError,
    ProtocolError,
    SerializationError,
    SpawnError,
    StaleDescriptorError,
    SupervisionError,
    TransportError,
    TransportUnavailableError,
)
from .fabric import Buffer

__version__ = "0.1.0"

__all__ = [
    "Actor",
    "ActorDiedError",
    "ActorError",
    "AuthenticationError",
    "BrokenResourceError",
    "Buffer",
    "CallError",
    "CallTimeoutError",
    "ClosedResourceError",
    "Collective",
    "Config",
    "ConfigError",
    "ControlPlaneError",
    "DescriptorError",
    "Endpoint",
    "Failure",
    "FallbackError",
    "Graph",
    "GraphNode",
    "GraphRun",
    "JobContext",
    "Mesh",
    "MeshError",
    "MessageTooLargeError",
    "OrchestrError",
    "PlacementError",
    "ProtocolError",
    "RestartPolicy",
    "SerializationError",
    "SpawnError",
    "StaleDescriptorError",
    "Staleness",
    "SupervisionError",
    "TransportError",
    "TransportUnavailableError",
    "Versioned",
    "__version__",
    "endpoint",
    "load_config",
    "open_local_cluster",
    "register",
    "run",
]
