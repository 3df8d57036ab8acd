"""Compiled graphs: a step graph wired once and executed many times.

A step graph starts from ``g.input()`` and chains ``map`` and ``fanout`` stages; each stage
takes the value its input produced in the same step. Compiling opens every connection and
packs every message head ahead (:class:`~._callplan.FanoutPlan`), so a step costs what its
calls cost and nothing else: no task, no per-member future, one deadline. ``execute`` returns
the step's future at once and chains the stages with callbacks, so the controller dispatches
step N+1 while step N runs; calls from this controller to one actor run in the order sent, so
the steps reach every actor in order.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import TYPE_CHECKING, Any

import structlog

from orchestr._call._client import current_client
from orchestr.errors import ClosedResourceError, ConfigError

from ._callplan import FanoutPlan

if TYPE_CHECKING:
    from ._graph import Graph, GraphNode

__all__ = ["CompiledGraph", "compile_graph"]

log = structlog.get_logger("orchestr.graph")


class _Stage:
    """One stage, wired: a plan over all members (fanout) or one per member (map)."""

    def __init__(self, node: GraphNode, timeout: float | None) -> None:
        assert node.endpoint is not None
        client = current_client()
        ep = node.endpoint
        mesh = ep.mesh
        self.node = node
        self.name = node.name
        self.input = node.inputs[0].node.name
        self.fan = node.kind == "fanout"
        members = [(m.address, m.actor_id, mesh.label(m)) for m in mesh.members]
        deadline = timeout if timeout is not None else ep.timeout
        if self.fan:
            self.plans = [FanoutPlan(client, members, ep.name, deadline, mesh.retry)]
        else:
            self.plans = [FanoutPlan(client, [m], ep.name, deadline, mesh.retry) for m in members]
        self.actor_ids = [m[1] for m in members]
        self.choice = node.choice
        self._turn = itertools.count()

    async def open(self) -> None:
        await asyncio.gather(*(p.open() for p in self.plans))

    def pick(self, value: Any) -> int:
        n = len(self.plans)
        if n == 1:
            return 0
        if callable(self.choice):
            index = self.choice(value, n)
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
                raise ConfigError(
                    f"stage {self.name!r}: the choice function returned {index!r}; it must "
                    f"return a member index from 0 to {n - 1}"
                )
            return index
        start = next(self._turn) % n
        if self.choice == "round_robin":
            return start
        inflight = current_client().inflight
        return min(range(n), key=lambda i: (inflight(self.actor_ids[(start + i) % n]), i))

    def call(self, value: Any) -> asyncio.Future[Any]:
        """The stage's call for one step, on the step's value."""
        if self.fan:
            return self.plans[0].submit((value,), {})
        return _first(self.plans[self.pick(value)].submit((value,), {}))


def _first(future: asyncio.Future[list[Any]]) -> asyncio.Future[Any]:
    """A one-member plan's result, unwrapped from its list."""
    out: asyncio.Future[Any] = future.get_loop().create_future()

    def unwrap(done: asyncio.Future[list[Any]]) -> None:
        if out.done():
            return
        if done.cancelled():
            out.cancel()
        elif (exc := done.exception()) is not None:
            out.set_exception(exc)
        else:
            out.set_result(done.result()[0])

    future.add_done_callback(unwrap)
    return out


class CompiledGraph:
    """A step graph wired ahead (from :meth:`Graph.compile`). ``async with`` closes it."""

    def __init__(self, graph: Graph, stages: list[_Stage], outputs: dict[str, str]) -> None:
        self.graph = graph
        self.stages = stages
        self.outputs = outputs  # output name -> node name
        self.steps = 0
        self.inflight = 0
        self._closed = False

    async def __aenter__(self) -> CompiledGraph:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Refuse further steps; steps in flight finish on their own. Idempotent."""
        self._closed = True

    def execute(self, value: Any) -> asyncio.Future[Any]:
        """Start one step on ``value`` and return its future at once: it resolves to the
        graph's output value (a dict by output name when it has several), or to the first
        error of the step (a remote error with its traceback, a death, a deadline). Raises
        :class:`ClosedResourceError` after :meth:`aclose`. Not idempotent: each call is a step."""
        if self._closed:
            raise ClosedResourceError(f"compiled graph {self.graph.name!r} was closed")
        client = current_client()
        loop = client.loop
        self.steps += 1
        self.inflight += 1
        values: dict[str, asyncio.Future[Any]] = {}
        head: asyncio.Future[Any] = loop.create_future()
        head.set_result(value)
        values[self.graph_input] = head
        for stage in self.stages:
            source = values[stage.input]
            if source.done() and source.exception() is None:
                values[stage.name] = stage.call(source.result())
            else:
                values[stage.name] = _chain(source, stage)
        result = self._result(values)
        started = time.time()

        def finished(done: asyncio.Future[Any]) -> None:
            self.inflight -= 1
            ok = not done.cancelled() and done.exception() is None
            client.step_span(started, self.graph.name, ok)

        result.add_done_callback(finished)
        return result

    graph_input = "input"

    def _result(self, values: dict[str, asyncio.Future[Any]]) -> asyncio.Future[Any]:
        if len(self.outputs) == 1:
            return values[next(iter(self.outputs.values()))]
        names = list(self.outputs)
        gathered = asyncio.gather(*(values[self.outputs[n]] for n in names))
        out: asyncio.Future[Any] = gathered.get_loop().create_future()

        def collect(done: asyncio.Future[list[Any]]) -> None:
            if done.cancelled():
                out.cancel()
            elif (exc := done.exception()) is not None:
                out.set_exception(exc)
            else:
                out.set_result(dict(zip(names, done.result(), strict=True)))

        gathered.add_done_callback(collect)
        return out


def _chain(source: asyncio.Future[Any], stage: _Stage) -> asyncio.Future[Any]:
    """``stage``'s future for a value that is not there yet: called when it is."""
    out: asyncio.Future[Any] = source.get_loop().create_future()

    def fire(done: asyncio.Future[Any]) -> None:
        if done.cancelled():
            out.cancel()
            return
        if (exc := done.exception()) is not None:
            out.set_exception(exc)
            return
        try:
            call = stage.call(done.result())
        except Exception as err:  # the value could not be sent: the step fails with it
            out.set_exception(err)
            return

        def copy(result: asyncio.Future[Any]) -> None:
            if result.cancelled():
                out.cancel()
            elif (exc := result.exception()) is not None:
                out.set_exception(exc)
            else:
                out.set_result(result.result())

        call.add_done_callback(copy)

    source.add_done_callback(fire)
    return out


async def compile_graph(graph: Graph, ctx: Any, step_timeout_s: float | None) -> CompiledGraph:
    timeout = step_timeout_s
    if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
        raise ConfigError(f"step_timeout_s must be a positive number, got {timeout!r}")
    inputs = [n for n in graph.nodes if n.kind == "input"]
    if len(inputs) != 1:
        raise ConfigError(
            f"graph {graph.name!r} needs exactly one g.input() to be compiled, has {len(inputs)}"
        )
    stages: list[_Stage] = []
    for node in graph.nodes:
        if node.kind == "input":
            continue
        if node.kind not in ("map", "fanout"):
            raise ConfigError(
                f"graph {graph.name!r}: a compiled graph is an input and map/fanout stages; "
                f"{node.name!r} is a {node.kind} (run streaming graphs with g.run)"
            )
        inlet = node.inputs[0]
        if inlet.count is not None or inlet.timeout_s is not None:
            raise ConfigError(
                f"graph {graph.name!r}: stage {node.name!r} batches its input; a step has one "
                f"value per stage (batch inside the step's value instead)"
            )
        if node.staleness is not None:
            raise ConfigError(
                f"graph {graph.name!r}: stage {node.name!r} has a staleness bound, which a "
                f"step graph does not use (every stage sees the step's own value)"
            )
        stages.append(_Stage(node, timeout))
    outputs = {name: node.name for name, node in graph.outputs.items()}
    if not outputs:
        raise ConfigError(f"graph {graph.name!r} has no stage to compile")
    graph.running = True  # no more nodes: the wiring is fixed
    await asyncio.gather(*(s.open() for s in stages))
    compiled = CompiledGraph(graph, stages, outputs)
    compiled.graph_input = inputs[0].name
    events = getattr(ctx, "events", None)
    if events is not None:
        events.record("graph", name=graph.name, compiled=True, description=graph.describe())
    log.info("graph compiled", graph=graph.name, stages=len(stages))
    return compiled
