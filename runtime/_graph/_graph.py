"""Dataflow graphs over meshes: declare the stages, then let the job controller drive them::

    g = oc.Graph("rl")
    prompts = g.source("prompts", items)
    gen = g.map("generate", generators.generate, prompts, capacity=16)
    scored = g.map("score", rewarders.score, gen.batch(count=8, timeout_s=0.05))
    async with g.run(ctx) as run:
        async for value in run.results(scored):
            ...

Execution is controller-driven: the driver calls a stage's endpoint once per item (or batch),
so a graph needs nothing from the actors and plain calls keep working beside it.

Here are the declarations and their validation, with no I/O. A node can only take nodes
that already exist as inputs, so a graph cannot have a cycle. Execution is in
:mod:`._run` and :mod:`._stage`, rendering in :mod:`._dot`, and the dry-run
context of ``orchestr graph`` in :mod:`._dry`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from orchestr._call._mesh import Endpoint
from orchestr.errors import ConfigError

from . import _dot as _graphdot
from ._channelstate import Staleness
from ._checks import check_int, check_name, check_seconds, check_staleness
from ._items import Batched, GraphCaptured

if TYPE_CHECKING:
    from ._compiled import CompiledGraph
    from ._run import GraphRun

__all__ = ["Graph", "GraphNode"]

CHOICES = ("least_loaded", "round_robin")
DEFAULT_CAPACITY = 16

Choice = Literal["least_loaded", "round_robin"] | Callable[[Any, int], int]
Kind = Literal["source", "input", "map", "fanout", "merge"]


@dataclasses.dataclass(eq=False)
class GraphNode:
    """One node of a :class:`Graph`; made by the graph's ``source``/``map``/``fanout``/``merge``."""

    graph: Graph
    name: str
    kind: Kind
    #: The inputs, each a node with an optional batching of its output.
    inputs: tuple[Batched, ...] = ()
    endpoint: Endpoint | None = None
    items: Any = None
    capacity: int = DEFAULT_CAPACITY
    ordered: bool = True
    choice: Choice = "least_loaded"
    staleness: Staleness | None = None
    inflight_per_member: int = 2
    retries: int = 3
    retry_timeout_s: float = 30.0
    version_of: Callable[[Any], int] | None = None

    def batch(self, *, count: int | None = None, timeout_s: float | None = None) -> Batched:
        """This node's output grouped into lists of ``count`` items, or of what arrived within
        ``timeout_s`` seconds of a batch's first item (whichever comes first); the end of the
        stream flushes a partial batch. Use as a stage's input."""
        if count is None and timeout_s is None:
            raise ConfigError(
                f"batch of {self.name!r} needs count=, timeout_s= or both; with neither it "
                f"would never be full"
            )
        if count is not None:
            check_int(count, "batch count", 1)
            if count > self.capacity:
                raise ConfigError(
                    f"a batch of {count} from {self.name!r} can never fill: its output holds at "
                    f"most capacity={self.capacity} items; raise that node's capacity or lower "
                    f"count"
                )
        if timeout_s is not None:
            check_seconds(timeout_s, "batch timeout_s")
        return Batched(self, count, timeout_s)

    @property
    def mesh_size(self) -> int:
        return len(self.endpoint.mesh) if self.endpoint is not None else 0

    def __repr__(self) -> str:
        return f"<GraphNode {self.graph.name}.{self.name} ({self.kind})>"


class Graph:
    """A dataflow graph over meshes. Declaring never blocks or talks to actors; the checks
    raise :class:`ConfigError` at once. Run it with :meth:`run` or :meth:`collect`."""

    def __init__(self, name: str) -> None:
        check_name(name, "a graph")
        self.name = name
        self._nodes: dict[str, GraphNode] = {}
        self._outputs: dict[str, GraphNode] = {}
        #: The staleness bound of each output that has one (see :meth:`output`).
        self.output_staleness: dict[str, Staleness] = {}
        self.running = False

    @property
    def nodes(self) -> tuple[GraphNode, ...]:
        """The nodes in declaration order (which is a topological order)."""
        return tuple(self._nodes.values())

    @property
    def outputs(self) -> dict[str, GraphNode]:
        """The outputs by name: those marked with :meth:`output`, or, if none is, every node
        that no other node consumes."""
        if self._outputs:
            return dict(self._outputs)
        consumed = {i.node for n in self._nodes.values() for i in n.inputs}
        return {n.name: n for n in self._nodes.values() if n not in consumed}

    def source(self, name: str, items: Any, *, capacity: int = DEFAULT_CAPACITY) -> GraphNode:
        """A stream of ``items``: a sync or async iterable, pulled only when every consumer
        has room. Items may be :class:`Versioned`."""
        if not (hasattr(items, "__iter__") or hasattr(items, "__aiter__")):
            raise ConfigError(
                f"source {name!r} needs an iterable or an async iterable, got "
                f"{type(items).__name__}"
            )
        return self._add(GraphNode(self, name, "source", items=items, capacity=capacity))

    def map(
        self,
        name: str,
        endpoint: Endpoint,
        input: GraphNode | Batched,
        *,
        choice: Choice = "least_loaded",
        capacity: int = DEFAULT_CAPACITY,
        ordered: bool = True,
        staleness: Staleness | None = None,
        inflight_per_member: int = 2,
        retries: int = 3,
        retry_timeout_s: float = 30.0,
        version_of: Callable[[Any], int] | None = None,
    ) -> GraphNode:
        """Call ``endpoint`` on one member per input item (a list per batch): the member
        ``choice`` picks, ``"least_loaded"`` (fewest of this graph's calls in flight),
        ``"round_robin"``, or ``f(value, n_members) -> index``. At most
        ``inflight_per_member`` calls per member at once. ``ordered`` outputs leave in input
        order, else as they finish; at most ``capacity`` outputs wait downstream.

        When a member dies during a call the item is sent again (to the same member after a
        backoff, or to another one), up to ``retries`` times within ``retry_timeout_s``;
        then the graph fails with :class:`ActorDiedError`; any other call error fails it at
        once. An output keeps its input's version unless the endpoint returns a
        :class:`Versioned` or ``version_of(result)`` (run in the controller) gives one.

        ``staleness`` bounds the input's age: an item whose version is below the run's
        version (:meth:`GraphRun.set_version`) minus ``eta`` is dropped (policy ``"drop"``)
        or, with ``"requeue"``, sent back through the map or fan-out that made it, which calls
        its endpoint again on the same input to make a fresh one; an item still stale after
        3 requeues is dropped. Both are counted in :meth:`GraphRun.stats`."""
        if not callable(choice) and choice not in CHOICES:
            raise ConfigError(
                f"stage {name!r}: unknown choice {choice!r}; use one of {', '.join(CHOICES)} "
                f"or a function (value, n_members) -> member index"
            )
        return self._stage(
            "map",
            name,
            endpoint,
            input,
            capacity,
            ordered,
            staleness,
            inflight_per_member,
            retries,
            retry_timeout_s,
            choice,
            version_of,
        )

    def fanout(
        self,
        name: str,
        endpoint: Endpoint,
        input: GraphNode | Batched,
        *,
        capacity: int = DEFAULT_CAPACITY,
        ordered: bool = True,
        staleness: Staleness | None = None,
        inflight_per_member: int = 1,
        retries: int = 3,
        retry_timeout_s: float = 30.0,
        version_of: Callable[[Any], int] | None = None,
    ) -> GraphNode:
        """Call ``endpoint`` on every member of its mesh per input item; the output item is
        the list of their results in rank order (fan-in). Options as for :meth:`map`; a
        member that died is retried on that member only; ``version_of`` applies to each
        member's result, and the output's version is their oldest."""
        return self._stage(
            "fanout",
            name,
            endpoint,
            input,
            capacity,
            ordered,
            staleness,
            inflight_per_member,
            retries,
            retry_timeout_s,
            "least_loaded",
            version_of,
        )

    def input(self, name: str = "input") -> GraphNode:
        """The value each step of a compiled graph starts from (see :meth:`compile`): a
        graph with an input repeats per step instead of streaming from sources."""
        return self._add(GraphNode(self, name, "input", capacity=1))

    async def compile(self, ctx: Any, *, step_timeout_s: float | None = None) -> CompiledGraph:
        """Wire a step graph (an :meth:`input`, then ``map`` and ``fanout`` stages) ahead:
        connections to every member are opened and their handshakes done, each call's message
        head is packed once. ``execute(value)`` then starts a step and returns its future at
        once, so step N+1 is dispatched while step N runs. ``step_timeout_s`` is each step's
        deadline (default: the endpoints' own, ``Config.call_timeout`` unless set). Raises :class:`ConfigError` for a graph that does
        not repeat per step (sources, merges, batches).

        Blocks on opening a connection to every member. Cancel-safe: a cancelled compile leaves
        no plan, only connections the call client reuses."""
        if getattr(ctx, "orchestr_dry_run", False):
            raise GraphCaptured(self)
        from ._compiled import compile_graph

        return await compile_graph(self, ctx, step_timeout_s)

    def merge(self, name: str, *inputs: GraphNode, capacity: int = DEFAULT_CAPACITY) -> GraphNode:
        """One stream of the items of every input, interleaved as they arrive."""
        if len(inputs) < 2:
            raise ConfigError(f"merge {name!r} needs at least two inputs, got {len(inputs)}")
        for node in inputs:
            if isinstance(node, Batched):
                raise ConfigError(
                    f"merge {name!r} takes nodes, not batches; batch the stage after the merge"
                )
            self._own(node, name)
        if len(set(map(id, inputs))) != len(inputs):
            raise ConfigError(f"merge {name!r} lists the same input twice")
        batched = tuple(Batched(n, None, None) for n in inputs)
        return self._add(GraphNode(self, name, "merge", inputs=batched, capacity=capacity))

    def output(
        self, node: GraphNode, name: str | None = None, *, staleness: Staleness | None = None
    ) -> GraphNode:
        """Mark ``node`` as an output named ``name`` (default: the node's name), to read with
        :meth:`GraphRun.results` and to collect. Once any node is marked, only marked nodes
        are outputs; the other ends of the graph are drained.

        ``staleness`` bounds the age of what the reader takes, as a stage's bound does its
        input, but checked as each value is read: a trainer reading its next batch gets
        nothing older than ``set_version``'s version minus ``eta``. With ``"requeue"`` a stale
        value goes back through the map or fan-out ``node`` to be made again."""
        self._check_open()
        self._own(node, "output")
        name = node.name if name is None else name
        check_name(name, "an output")
        if name in self._outputs:
            raise ConfigError(f"graph {self.name!r} already has an output named {name!r}")
        if staleness is not None:
            check_staleness(f"output {name!r}", staleness, node)
            self.output_staleness[name] = staleness
        self._outputs[name] = node
        return node

    def describe(self) -> str:
        """The graph as text: one line per node, with its inputs and options."""
        return _graphdot.describe(self)

    def to_dict(self) -> dict[str, Any]:
        """The graph as JSON-able data (what ``orchestr graph --json`` prints)."""
        return _graphdot.to_dict(self)

    def to_dot(self) -> str:
        """The graph in Graphviz's DOT language."""
        return _graphdot.to_dot(self)

    def render(self, prefix: str | Path) -> tuple[Path, Path]:
        """Write ``prefix.dot`` and ``prefix.svg`` (with Graphviz's ``dot -Tsvg``); returns
        both paths. Blocks on ``dot``. Raises :class:`ConfigError` when Graphviz is not
        installed or fails (the ``.dot`` file is written anyway)."""
        return _graphdot.render(self, prefix)

    def run(self, ctx: Any) -> GraphRun:
        """Run the graph in the job of ``ctx`` (a :class:`JobContext`): an async context
        manager whose exit cancels whatever still runs. See :class:`GraphRun`."""
        if getattr(ctx, "orchestr_dry_run", False):
            raise GraphCaptured(self)
        if any(n.kind == "input" for n in self._nodes.values()):
            raise ConfigError(
                f"graph {self.name!r} has an input, so it runs step by step: compile it with "
                f"`await g.compile(ctx)` and call `execute(value)` per step"
            )
        from ._run import GraphRun

        return GraphRun(self, ctx)

    async def collect(self, ctx: Any) -> dict[str, list[Any]]:
        """Run the graph to completion and return every output's values in the order they
        came out. Blocks until every source is exhausted and every item is through; raises
        the graph's failure. Cancel-safe: cancelling stops the whole graph."""
        async with self.run(ctx) as run:
            return await run.collect()

    def __repr__(self) -> str:
        return f"<Graph {self.name} nodes={list(self._nodes)}>"

    # -- validation ---------------------------------------------------------------------

    def _stage(
        self,
        kind: Kind,
        name: str,
        endpoint: Endpoint,
        input: GraphNode | Batched,
        capacity: int,
        ordered: bool,
        staleness: Staleness | None,
        inflight: int,
        retries: int,
        retry_timeout_s: float,
        choice: Choice,
        version_of: Callable[[Any], int] | None,
    ) -> GraphNode:
        if not isinstance(endpoint, Endpoint):
            what = getattr(endpoint, "__qualname__", type(endpoint).__name__)
            raise ConfigError(
                f"stage {name!r} needs a mesh endpoint such as `mesh.generate` (from "
                f"ctx.spawn), got {what!r}"
            )
        if not endpoint.mesh.members:
            raise ConfigError(f"stage {name!r}: mesh {endpoint.mesh.name!r} has no members")
        inlet = input if isinstance(input, Batched) else Batched(input, None, None)
        self._own(inlet.node, name)
        if not isinstance(ordered, bool):
            raise ConfigError(f"stage {name!r}: ordered is True or False, got {ordered!r}")
        if staleness is not None:
            check_staleness(f"stage {name!r}", staleness, inlet.node)
        if version_of is not None and not callable(version_of):
            raise ConfigError(
                f"stage {name!r}: version_of is a function (result) -> version, got {version_of!r}"
            )
        check_int(inflight, f"stage {name!r}: inflight_per_member", 1)
        check_int(retries, f"stage {name!r}: retries", 0)
        check_seconds(retry_timeout_s, f"stage {name!r}: retry_timeout_s")
        node = GraphNode(
            self,
            name,
            kind,
            (inlet,),
            endpoint,
            None,
            capacity,
            ordered,
            choice,
            staleness,
            inflight,
            retries,
            float(retry_timeout_s),
            version_of,
        )
        return self._add(node)

    def _add(self, node: GraphNode) -> GraphNode:
        self._check_open()
        check_name(node.name, "a node")
        if node.name in self._nodes:
            raise ConfigError(
                f"graph {self.name!r} already has a node named {node.name!r}; names are unique"
            )
        check_int(node.capacity, f"{node.name!r}: capacity", 1)
        self._nodes[node.name] = node
        return node

    def _own(self, node: Any, user: str) -> None:
        if not isinstance(node, GraphNode):
            raise ConfigError(
                f"{user!r} takes nodes of this graph as inputs (from g.source/map/fanout/merge "
                f"or node.batch()), got {type(node).__name__}"
            )
        if node.graph is not self or self._nodes.get(node.name) is not node:
            raise ConfigError(
                f"{user!r}: node {node.name!r} belongs to graph {node.graph.name!r}, not "
                f"{self.name!r}; a graph only connects its own nodes"
            )

    def _check_open(self) -> None:
        if self.running:
            raise ConfigError(
                f"graph {self.name!r} is running; declare every node before g.run/g.collect"
            )
