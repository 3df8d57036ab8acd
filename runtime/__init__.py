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

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from . import clock as clock
    from . import fabric as fabric
    from . import metrics as metrics
    from . import protos as protos
    from . import sim as sim
    from ._actor._actor import Actor, endpoint
    from ._call._mesh import Endpoint, Mesh
    from ._call._registry import register
    from ._control._convert import ActorInfo, NodeInfo
    from ._graph._channelstate import Staleness
    from ._graph._graph import Graph, GraphNode
    from ._graph._items import Versioned
    from ._graph._run import GraphRun
    from ._job._context import JobContext
    from ._job._phases import Collective
    from ._job._policy import Failure, RestartPolicy
    from ._job._reservation import Reservation
    from ._job._session import connect, open_local_cluster, run
    from .fabric import Buffer

__version__ = "0.1.0"

__all__ = [
    "Actor",
    "ActorDiedError",
    "ActorError",
    "ActorInfo",
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
    "NodeInfo",
    "OrchestrError",
    "PlacementError",
    "ProtocolError",
    "Reservation",
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
    "connect",
    "endpoint",
    "load_config",
    "open_local_cluster",
    "register",
    "run",
]

# The rest of the API loads on first use (PEP 562): a worker process imports ``orchestr`` on
# its way to ``orchestr._cluster._worker`` and should not pay for the driver, the head and the graph
# modules it never runs. Which module defines each name:
_LAZY = {
    "Actor": "._actor._actor",
    "endpoint": "._actor._actor",
    "ActorInfo": "._control._convert",
    "NodeInfo": "._control._convert",
    "Staleness": "._graph._channelstate",
    "JobContext": "._job._context",
    "connect": "._job._session",
    "open_local_cluster": "._job._session",
    "run": "._job._session",
    "Graph": "._graph._graph",
    "GraphNode": "._graph._graph",
    "Versioned": "._graph._items",
    "GraphRun": "._graph._run",
    "Endpoint": "._call._mesh",
    "Mesh": "._call._mesh",
    "Collective": "._job._phases",
    "Reservation": "._job._reservation",
    "register": "._call._registry",
    "Failure": "._job._policy",
    "RestartPolicy": "._job._policy",
    "Buffer": ".fabric",
}
#: Subpackages reachable as attributes without an import of their own (``oc.fabric``,
#: ``oc.sim``...); fabric, metrics and protos are what ``import orchestr`` once loaded itself.
_SUBPACKAGES = ("clock", "fabric", "metrics", "protos", "sim")


if not TYPE_CHECKING:  # mypy reads the imports above, and still flags a misspelt name

    def __getattr__(name: str) -> object:
        import importlib

        if name in _SUBPACKAGES:
            return importlib.import_module(f".{name}", __name__)
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBPACKAGES})
