"""A running graph: the async shell that owns every task of one :meth:`Graph.run`.

Each node runs as one task in the run's task group (a stage's calls run in that stage's own
group). Node tasks never raise into the group: the first failure is recorded, every task is
cancelled, and the error goes to whoever reads results, or out of the ``async with`` block.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Iterator
from types import TracebackType
from typing import Any, Protocol

import structlog

from orchestr.errors import ClosedResourceError, ConfigError

from ._channels import Edge, NodeOut, Token, first_error, nap
from ._channelstate import Item, Receiver
from ._graph import Graph, GraphNode
from ._items import Versioned
from ._stage import StageRunner, send_back

__all__ = ["GraphRun"]

log = structlog.get_logger("orchestr.graph")


class _Runner(Protocol):
    node: GraphNode

    async def run(self) -> None: ...


class _SourceRunner:
    def __init__(self, node: GraphNode, out: NodeOut) -> None:
        self.node = node
        self.out = out

    async def run(self) -> None:
        items = self.node.items
        if hasattr(items, "__aiter__"):
            await self._pull_async(aiter(items))
        else:
            await self._pull_sync(iter(items))
        self.out.close()

    async def _pull_async(self, it: AsyncIterator[Any]) -> None:
        try:
            while True:
                await self.out.wait_room()  # pulled only when every consumer has room
                try:
                    value = await anext(it)
                except StopAsyncIteration:
                    return
                self.out.put_nowait(*_token(value))
        finally:
            close = getattr(it, "aclose", None)
            if close is not None:
                await close()

    async def _pull_sync(self, it: Iterator[Any]) -> None:
        try:
            while True:
                await self.out.wait_room()
                try:
                    value = next(it)
                except StopIteration:
                    return
                self.out.put_nowait(*_token(value))
                await asyncio.sleep(0)  # a long iterable must not hold the event loop
        finally:
            close = getattr(it, "close", None)
            if inspect.isgenerator(it) and close is not None:
                close()


def _token(value: Any) -> tuple[Token, int | None]:
    if isinstance(value, Versioned):
        return Token(value.value), value.version
    return Token(value), None


class _MergeRunner:
    def __init__(self, node: GraphNode, inputs: list[Edge], out: NodeOut) -> None:
        self.node = node
        self.inputs = inputs
        self.out = out

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for edge in self.inputs:
                tg.create_task(self._forward(edge))
        self.out.close()

    async def _forward(self, edge: Edge) -> None:
        while (item := await edge.take()) is not None:
            await self.out.emit(item.value, item.version)
            edge.ack(item.seq)


class GraphRun:
    """A running graph, from :meth:`Graph.run`; use it as ``async with g.run(ctx) as run``.

    Entering starts every node and returns at once. Exiting cancels whatever still runs and
    waits for it (no task outlives the block); it raises the graph's failure unless that was
    already raised to the block by :meth:`results`, :meth:`collect` or :meth:`wait`. A
    failure (a remote error, an item that could not be delivered, a source that raised)
    cancels the whole graph and wakes every reader with the error; code in the block that
    reads no results learns of it when the block ends.

    Every output buffers up to its node's ``capacity`` items: an output nobody reads stalls
    the graph (backpressure) until the block ends.
    """

    def __init__(self, graph: Graph, ctx: Any) -> None:
        if not graph.nodes:
            raise ConfigError(f"graph {graph.name!r} has no nodes; add a source and stages")
        self.graph = graph
        self.events = ctx.events
        #: The consumers' version that staleness bounds are measured against.
        self.version = 0
        self._error: BaseException | None = None
        self._raised = False
        self._finished = False
        self._exited = False
        self._readers: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._tg: asyncio.TaskGroup | None = None
        self._wake = asyncio.Event()  # readers of outputs wait on it
        self._edges: list[Edge] = []
        self._outputs: dict[str, Edge] = {}
        self._runners: list[_Runner] = []
        self._stages: dict[GraphNode, StageRunner] = {}
        self._checks: dict[str, Receiver] = {}  # the outputs with a staleness bound
        self._build()

    def _build(self) -> None:
        wakes = {node: asyncio.Event() for node in self.graph.nodes}
        outs: dict[GraphNode, list[Edge]] = {node: [] for node in self.graph.nodes}
        ins: dict[GraphNode, list[Edge]] = {node: [] for node in self.graph.nodes}
        for node in self.graph.nodes:
            for inlet in node.inputs:
                src = inlet.node
                edge = Edge(src.name, node.name, src.capacity, wakes[src], wakes[node])
                outs[src].append(edge)
                ins[node].append(edge)
        bounded: list[tuple[GraphNode, Edge]] = []
        for name, node in self.graph.outputs.items():
            edge = Edge(node.name, f"output:{name}", node.capacity, wakes[node], self._wake)
            outs[node].append(edge)
            self._outputs[name] = edge
            staleness = self.graph.output_staleness.get(name)
            if staleness is not None:
                self._checks[name] = Receiver(ordered=False, staleness=staleness)
                if staleness.policy == "requeue":
                    bounded.append((node, edge))
        for node in self.graph.nodes:
            self._edges += ins[node]
            out = NodeOut(outs[node], wakes[node])
            if node.kind == "source":
                self._runners.append(_SourceRunner(node, out))
            elif node.kind == "merge":
                self._runners.append(_MergeRunner(node, ins[node], out))
            else:
                stage = StageRunner(self, node, ins[node][0], out, wakes[node])
                self._stages[node] = stage
                self._runners.append(stage)
                if node.staleness is not None and node.staleness.policy == "requeue":
                    stage.producer = self._stages[node.inputs[0].node]
                    stage.producer.requeue_edges.append(stage.in_edge)
        for node, edge in bounded:  # an output's reader sends stale values back
            self._stages[node].requeue_edges.append(edge)
        self._edges += self._outputs.values()

    async def __aenter__(self) -> GraphRun:
        """Start every node's task. Raises :class:`ConfigError` when the graph is running already;
        blocks on nothing, so there is nothing to cancel."""
        if self.graph.running:
            raise ConfigError(f"graph {self.graph.name!r} is running already; one run at a time")
        self.events.record("graph", name=self.graph.name, description=self.graph.describe())
        self.graph.running = True
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        for runner in self._runners:
            task = self._tg.create_task(self._guard(runner), name=f"graph:{runner.node.name}")
            self._tasks.append(task)
        log.info("graph started", graph=self.graph.name, nodes=len(self._runners))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Cancel what is still running and wait for every task to end; then raises the graph's
        failure when the block itself did not raise. Blocks until the tasks have ended."""
        for task in self._tasks:
            task.cancel()
        try:
            if self._tg is not None:
                await self._tg.__aexit__(None, None, None)
        finally:
            self.graph.running = False
            self._exited = True
            error = None if self._error is None else f"{type(self._error).__name__}"
            self.events.record("graph_end", name=self.graph.name, stats=self.stats(), error=error)
            self._wake.set()
        if exc_type is None and self._error is not None and not self._raised:
            self._raised = True
            raise self._error

    async def _guard(self, runner: _Runner) -> None:
        try:
            await runner.run()
        except Exception as exc:
            self.fail(first_error(exc), runner.node.name)
        finally:
            if all(t.done() or t is asyncio.current_task() for t in self._tasks):
                self._finished = True
                self._wake.set()

    def fail(self, exc: BaseException, where: str) -> None:
        """Internal: the graph failed at node ``where``; the first failure wins."""
        if self._error is not None:
            return
        exc.add_note(f"(in graph {self.graph.name!r}, node {where!r})")
        self._error = exc
        log.error("graph failed", graph=self.graph.name, node=where, error=repr(exc))
        for task in self._tasks:
            task.cancel()
        self._wake.set()

    def _check(self) -> None:
        if self._error is not None:
            self._raised = True
            raise self._error

    def set_version(self, version: int) -> None:
        """Set the consumers' current version (for example, the trainer's policy version):
        an input item older than ``version - eta`` of a stage's staleness bound is dropped
        or sent back. Never blocks; idempotent."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise ConfigError(f"a version is an integer, got {version!r}")
        self.version = version
        for stage in self._stages.values():
            stage.set_version(version)
        for check in self._checks.values():
            check.set_version(version)

    def results(self, output: GraphNode | str, *, versioned: bool = False) -> ResultStream:
        """The values of ``output`` (an output node or its output name) as they come out; with
        ``versioned``, ``(value, version)`` pairs. Iterating blocks until the next value or the
        output's end, and raises the graph's failure. One reader per output."""
        name = self._output_name(output)
        if name in self._readers:
            raise ConfigError(f"output {name!r} already has a reader; an output has one")
        self._readers.add(name)
        return ResultStream(self, name, versioned)

    def _output_name(self, output: GraphNode | str) -> str:
        names = {n: node for n, node in self.graph.outputs.items()}
        if isinstance(output, str) and output in names:
            return output
        for name, node in names.items():
            if node is output:
                return name
        what = output if isinstance(output, str) else output.name
        raise ConfigError(
            f"{what!r} is not an output of graph {self.graph.name!r} (outputs: "
            f"{', '.join(names)}); mark it with g.output(node) before g.run"
        )

    async def wait(self) -> None:
        """Block until every node has finished (every source exhausted, every item through);
        outputs must be read meanwhile. Raises the graph's failure.

        Cancel-safe: cancelling the wait leaves the graph running."""
        while not self._finished and self._error is None:
            await nap(self._wake)
        self._check()

    async def collect(self) -> dict[str, list[Any]]:
        """Read every output to its end, then wait for the graph to finish.

        Blocks until the graph has finished; raises the graph's failure (the first node's).
        Not cancel-safe: results read before a cancellation are lost to the caller."""
        out: dict[str, list[Any]] = {}

        async def read(name: str) -> None:
            out[name] = [value async for value in self.results(name)]

        await asyncio.gather(*(read(name) for name in self.graph.outputs))
        await self.wait()
        return {name: out[name] for name in self.graph.outputs}

    def stats(self) -> dict[str, dict[str, int]]:
        """Per edge (``"producer->consumer"``, ``"node->output:name"``): ``sent``,
        ``delivered``, ``duplicates``, ``dropped_stale``, ``requeued``, ``redelivered``,
        ``queue_depth`` (waiting to be taken) and ``in_window`` (sent, not yet committed)."""
        return {edge.name: edge.snapshot() for edge in self._edges}

    @property
    def failed(self) -> BaseException | None:
        """The error that failed the graph, if one has."""
        return self._error


class ResultStream:
    """An async iterator over one output of a :class:`GraphRun`."""

    def __init__(self, run: GraphRun, name: str, versioned: bool) -> None:
        self._run = run
        self._edge = run._outputs[name]
        self._versioned = versioned
        self._check = run._checks.get(name)
        node = run.graph.outputs[name]
        self._producer = run._stages.get(node)

    def __aiter__(self) -> ResultStream:
        return self

    async def __anext__(self) -> Any:
        edge = self._edge
        while True:
            self._run._check()
            if self._run._exited and not edge.closed:
                raise ClosedResourceError(
                    f"the run of graph {self._run.graph.name!r} was stopped before this output "
                    f"ended; read results inside `async with g.run(ctx)`"
                )
            item = edge.take_nowait()
            if item is not None and self._check is not None:
                item = self._fresh(item)
                if item is None:
                    continue  # dropped or sent back: take the next one
            if item is not None:
                edge.ack(item.seq)
                value = item.value.value
                return (value, item.version) if self._versioned else value
            if edge.closed:
                raise StopAsyncIteration
            await nap(self._run._wake)

    def _fresh(self, item: Item) -> Item | None:
        """``item`` if it is within the output's staleness bound; else it is dropped or sent
        back (counted on the output's edge) and ``None`` is returned."""
        check, edge = self._check, self._edge
        assert check is not None
        dropped = check.dropped
        fresh = check.receive(item)
        if check.dropped > dropped:
            edge.stats.dropped_stale += check.dropped - dropped
            edge.ack(item.seq, delivered=False)
        for stale in check.take_requeued():
            send_back(stale, edge, self._producer, self._run.graph.name, edge.name)
        if not fresh:
            return None
        check.commit(item.seq)
        return item
