"""What travels on a graph's edges besides plain values: :class:`Versioned` values, the
``Batched`` items a batching stage hands its endpoint, and the dry run's signal."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from orchestr._call._registry import register
from orchestr.errors import ConfigError

if TYPE_CHECKING:
    from ._graph import Graph, GraphNode

__all__ = ["Batched", "GraphCaptured", "Versioned"]


@register
@dataclasses.dataclass(frozen=True)
class Versioned:
    """A value with the version it was made with (for example, the policy version of a
    rollout). A source item or an endpoint's result may be one; staleness bounds use it."""

    __module__ = "orchestr"  # its name on the wire and in the head's store (pinned)

    value: Any
    version: int

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int):
            raise ConfigError(f"a version is an integer, got {self.version!r}")


class GraphCaptured(BaseException):
    """Internal: a dry-run job reached ``g.run``/``g.collect``; carries the graph. A
    ``BaseException`` so that a job's ``except Exception`` does not swallow it."""

    def __init__(self, graph: Graph) -> None:
        super().__init__(f"graph {graph.name!r} captured")
        self.graph = graph


@dataclasses.dataclass(frozen=True, eq=False)
class Batched:
    """A node's output grouped into lists (see :meth:`GraphNode.batch`)."""

    node: GraphNode
    count: int | None
    timeout_s: float | None
