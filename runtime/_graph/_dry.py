"""The dry run behind ``orchestr graph job.py``: a job's ``main(ctx)`` runs against a stand-in
context until it reaches its first ``g.run(ctx)`` or ``g.collect(ctx)``, which hands over
the graph and stops the job. Nothing starts: ``spawn`` imports and checks the actor class
and returns a mesh of placeholder members; calling an endpoint is an error, since no actor
exists to answer it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any

from orchestr._actor._actor import Actor, class_path, endpoints_of, load_actor_class
from orchestr._call._mesh import Endpoint, Member, Mesh
from orchestr._cluster._records import validate_resources
from orchestr._job._policy import RestartPolicy, SuperviseHook, check_spawn_options
from orchestr.config import Config, load_config
from orchestr.errors import ConfigError, SpawnError

from ._graph import Graph
from ._items import GraphCaptured

__all__ = ["DryContext", "DryRunError", "NoGraphError", "capture_graph"]


class DryRunError(ConfigError):
    """The job did what a dry run cannot: called an actor before its first graph."""


class NoGraphError(ConfigError):
    """The job's ``main`` ended without running a graph."""


def _refuse(mesh: str, endpoint: str) -> DryRunError:
    return DryRunError(
        f"the job calls {mesh}.{endpoint} before its first graph; `orchestr graph` runs the "
        f"job without a cluster and stops at its first g.run/g.collect, so calls before it "
        f"cannot run. Build the graph before calling actors, or run the job with `orchestr run`"
    )


class DryEndpoint(Endpoint):
    """An endpoint of a placeholder mesh: every way of calling it raises :class:`DryRunError`."""

    def _send(self, member: Member, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise _refuse(self.mesh.name, self.name)

    def choose(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(self.mesh.name, self.name)

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse(self.mesh.name, self.name)

    def options(self, *, timeout: float | None = None, fallback: str | None = None) -> Endpoint:
        plain = super().options(timeout=timeout, fallback=fallback)
        return DryEndpoint(plain.mesh, plain.name, plain.timeout, plain.fallback)


class DryMesh(Mesh):
    """A mesh of placeholder members (no actor behind them)."""

    def __getitem__(self, key: int | slice) -> Mesh:
        plain = super().__getitem__(key)
        return DryMesh(plain.mesh_id, plain.name, plain.class_path, plain.members, plain.endpoints)

    def __getattr__(self, name: str) -> Endpoint:
        plain = super().__getattr__(name)
        return DryEndpoint(self, plain.name, None)


class _NoEvents:
    def record(self, kind: str, **fields: Any) -> None:
        pass

    @contextlib.contextmanager
    def span(self, name: str, **fields: Any) -> Iterator[None]:
        yield

    def close(self) -> None:
        pass


class DryContext:
    """Stands in for :class:`JobContext` in a dry run."""

    orchestr_dry_run = True

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or load_config()
        self.job_id = "dry-run"
        self.events = _NoEvents()
        self.current_phase = None
        self.meshes: list[Mesh] = []

    async def spawn(
        self,
        actor: type[Actor] | str,
        *args: Any,
        n: int = 1,
        name: str | None = None,
        resources: Mapping[str, float] | None = None,
        labels: Mapping[str, str] | None = None,
        restart: RestartPolicy | None = None,
        supervise: SuperviseHook = None,
        per_process: int = 1,
        **kwargs: Any,
    ) -> Mesh:
        """Import and check ``actor``; return a mesh of ``n`` placeholder members."""
        check_spawn_options(restart, supervise, per_process)
        cls = load_actor_class(actor) if isinstance(actor, str) else actor
        path = class_path(cls)
        try:
            inspect.signature(cls).bind(*args, **kwargs)
        except TypeError as exc:
            raise SpawnError(f"{path} cannot be built with these arguments: {exc}") from None
        validate_resources(dict(resources or {}))
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"n must be a positive integer, got {n!r}")
        if name is not None and not isinstance(name, str):
            raise ConfigError(f"name must be a string, got {name!r}")
        mesh_name = name or path.rpartition(":")[2]
        number = len(self.meshes)
        members = [Member(f"dry-{number}-{r}", "dry://", r) for r in range(n)]
        mesh = DryMesh(f"dry-{number}", mesh_name, path, members, list(endpoints_of(cls)))
        self.meshes.append(mesh)
        return mesh

    async def stop(self, mesh: Mesh) -> None:
        pass

    async def init_distributed(self, mesh: Mesh, **kwargs: Any) -> list[dict[str, Any]]:
        """Nothing to join in a dry run; the graph does not depend on it."""
        return []

    async def checkpoint(self, mesh: Mesh) -> int:
        return 0

    @contextlib.asynccontextmanager
    async def phase(self, name: str, **kwargs: Any) -> AsyncIterator[None]:
        yield

    def __getattr__(self, name: str) -> Any:
        raise DryRunError(
            f"the job uses ctx.{name} before its first graph; `orchestr graph` runs the job "
            f"without a cluster (only ctx.spawn, ctx.stop, ctx.phase, ctx.init_distributed, "
            f"ctx.checkpoint, ctx.events and ctx.config work), so run the job with "
            f"`orchestr run` instead"
        )


async def capture_graph(main: Callable[[Any], Awaitable[Any]]) -> Graph:
    """Run ``main`` with a :class:`DryContext` up to its first graph and return that graph.

    Raises :class:`NoGraphError` when ``main`` ends first, :class:`DryRunError` when it calls
    an actor before, and whatever else ``main`` raises."""
    if not inspect.iscoroutinefunction(main):
        raise ConfigError(f"a job's main is `async def main(ctx)`, got {main!r}")
    try:
        await main(DryContext())
    except GraphCaptured as captured:
        return captured.graph
    except BaseExceptionGroup as group:  # main reached the graph inside its own task group
        found = group.subgroup(lambda e: isinstance(e, GraphCaptured))
        if found is None:
            raise
        first: Any = found
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        return first.graph  # type: ignore[no-any-return]
    raise NoGraphError(
        "the job's main ended without running a graph (g.run(ctx) or g.collect(ctx)); "
        "`orchestr graph` shows a job's first graph"
    )
