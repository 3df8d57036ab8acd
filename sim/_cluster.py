"""A cluster on virtual time, and a job context over it that real job code runs against.

- :class:`SimCluster`: the hosts of a topology registered with the head's own placement
  (:class:`~orchestr._cluster._headstate.HeadState`, one node per host, labelled with its
  host as the live head labels a node), a :class:`~._flows.FlowNet` over the topology's links,
  optionally the real :class:`~orchestr.fabric.optical.FabricManager` (its circuits laid on
  the flow network as it commits them), and the actors: models of the roles, living in this
  process.
- :class:`SimContext`: what a job's ``main(ctx)`` gets, for the calls jobs make (``spawn``,
  ``stop``, ``phase``, ``announce``, ``init_distributed``, ``events``). Meshes are real
  :class:`~orchestr._call._mesh.Mesh` handles whose members' addresses are hosts; their calls
  go through :class:`SimClient`, which runs the member's model in this loop. So the job's
  own code (its adverbs, its graphs, its retries) runs unchanged, on virtual time.
- :class:`Role`: how the simulation stands in for one actor class: a factory of members and
  the resources each takes on a host.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from orchestr._actor._actor import Actor, class_path, endpoints_of
from orchestr._call._mesh import Member, Mesh
from orchestr._cluster._fabric import FABRIC_HOST_LABEL
from orchestr._cluster._headstate import HeadState
from orchestr._job._events import EventLog, export_trace
from orchestr._job._phases import Collective, Phase, make_phase
from orchestr.errors import ActorDiedError, ConfigError
from orchestr.fabric.optical import FabricManager, Hint, Topology, hint_demand, topology_from_dict
from orchestr.tasks import TaskOwner

from ._collectives import collective
from ._cpu import HostCpu
from ._engine import Engine, SimulationError
from ._flows import FlowNet

__all__ = ["Role", "SimClient", "SimCluster", "SimContext", "SimMember", "one_host"]


def one_host(name: str = "local", accelerators: int = 1) -> Topology:
    """One host and nothing to reach: a machine's roles among themselves (its cores, with
    ``SimCluster(cpus=...)``), as the live jobs run on an embedded cluster."""
    return topology_from_dict(
        {
            "version": 1,
            "switches": [{"name": "tor", "tier": "tor", "ports": 2}],
            "hosts": [
                {
                    "name": name,
                    "accelerators": accelerators,
                    "nics": [{"name": "nic0", "gbps": 100.0, "port": "tor:0"}],
                }
            ],
        }
    )


@dataclasses.dataclass(frozen=True)
class SimMember:
    """What a role's factory is told of the member it builds."""

    cluster: SimCluster
    mesh: str
    rank: int
    size: int
    host: str
    #: The hosts of every member of the mesh, by rank (known once all are placed).
    hosts: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Role:
    """The simulation's stand-in for an actor class: ``make(member, *args, **kwargs)`` builds
    one member from the arguments the job spawns it with; ``resources``, when given, is what
    each member takes on its host instead of what the job asks (a job sized for this
    machine's CPUs asks for CPUs; a simulated cluster places accelerators)."""

    make: Callable[..., Any]
    resources: Mapping[str, float] | None = None


class SimCluster:
    """``topology``'s hosts, each a node of ``resources`` (default: its accelerators as
    ``gpu`` and 64 ``cpu``) in the head's placement, a flow network over its links, and the
    role models in ``roles`` (by actor class). ``fabric``, when given, is the fabric manager
    phases are hinted to; the circuits it lays carry flows from then on. ``cpus``, when
    given, is each host's cores, which the roles' compute then shares (:mod:`._cpu`)."""

    def __init__(
        self,
        engine: Engine,
        topology: Topology,
        roles: Mapping[type[Actor], Role],
        *,
        resources: Mapping[str, float] | None = None,
        fabric: FabricManager | None = None,
        cpus: float | None = None,
    ) -> None:
        self.engine = engine
        self.topology = topology
        self.roles = {class_path(cls): (cls, role) for cls, role in roles.items()}
        self.net = FlowNet.of_topology(engine, topology)
        self.fabric = fabric
        self.state = HeadState()
        for host in topology.hosts:
            total = dict(resources or {"gpu": host.accelerators or 1, "cpu": 64})
            labels = {FABRIC_HOST_LABEL: host.name}
            self.state.register_node(host.name, host.name, total, labels, 0.0)
        #: The members' models, by actor id, and each one's host.
        self.actors: dict[str, Any] = {}
        self.host_of: dict[str, str] = {}
        self._ids = itertools.count()
        self._meetings: dict[Any, tuple[int, asyncio.Future[None]]] = {}
        #: Each host's cores, when the roles' compute shares them (``cpus``).
        self.cpu = {h.name: HostCpu(engine, cpus) for h in topology.hosts} if cpus else {}

    # -- compute, as the role models charge it --------------------------------------------------
    async def compute(self, host: str, seconds: float, weight: float = 1024.0) -> None:
        """Take ``seconds`` of one thread's work (its time alone) on ``host``, at ``weight``
        (:func:`~._cpu.nice_weight`) among the threads there when the cluster models its
        cores, else simply ``seconds``. Blocks until done."""
        cpu = self.cpu.get(host)
        if cpu is None:
            await asyncio.sleep(seconds)
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        cpu.run(seconds, lambda: done.set_result(None), weight)
        await done

    # -- the network, as the role models use it ------------------------------------------------
    async def transfer(self, src: str, dst: str, nbytes: float) -> None:
        """Move ``nbytes`` from host ``src`` to host ``dst``. Blocks until they arrived (at
        once on one host: the flow network models the links between hosts)."""
        if src == dst or nbytes <= 0:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.net.send(src, dst, nbytes, lambda: done.set_result(None))
        await done

    async def collective(self, key: Any, kind: str, hosts: tuple[str, ...], nbytes: float) -> None:
        """Join collective ``key`` of the members on ``hosts``: when the last of them has
        joined, ``kind`` of ``nbytes`` per member runs over the network, between hosts (the
        members on one host are one stop of the ring). Blocks until it ends."""
        count, done = self._meetings.get(key) or (0, asyncio.get_running_loop().create_future())
        count += 1
        self._meetings[key] = (count, done)
        if count == len(hosts):
            del self._meetings[key]
            stops = list(dict.fromkeys(hosts))
            collective(self.net, kind, stops, nbytes, lambda: done.set_result(None))
        await done

    # -- members -------------------------------------------------------------------------------
    def place(
        self,
        path: str,
        name: str,
        n: int,
        resources: Mapping[str, float],
        labels: Mapping[str, str],
        strategy: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Mesh:
        """Place ``n`` members of the actor class at ``path`` with the head's placement and
        build their models. Raises :class:`ConfigError` for a class no role models, and
        :class:`PlacementError` as the live head would."""
        if path not in self.roles:
            modelled = ", ".join(sorted(self.roles)) or "none"
            raise ConfigError(
                f"the simulation has no model of {path}; give the cluster a Role for it "
                f"(modelled: {modelled})"
            )
        cls, role = self.roles[path]
        mesh_id = f"mesh-{next(self._ids)}"
        ids = {rank: f"{name}-{mesh_id}-{rank}" for rank in range(n)}
        asked = role.resources if role.resources is not None else resources
        records = self.state.place(mesh_id, name, path, n, asked, labels, ids, strategy)
        hosts = tuple(r.node_id for r in records)
        members = []
        for r in records:
            member = SimMember(self, name, r.rank, n, r.node_id, hosts)
            self.actors[r.actor_id] = role.make(member, *args, **kwargs)
            self.host_of[r.actor_id] = r.node_id
            members.append(Member(r.actor_id, r.node_id, r.rank))
        return Mesh(mesh_id, name, path, members, list(endpoints_of(cls)))

    def remove(self, mesh: Mesh) -> None:
        for m in mesh.members:
            if self.actors.pop(m.actor_id, None) is not None:
                self.state.actor_ended(m.actor_id, stopped=True)

    # -- the fabric ----------------------------------------------------------------------------
    async def hint(self, job: str, phase: Phase, meshes: Mapping[str, Mesh]) -> None:
        """Tell the fabric manager of ``phase``'s traffic between ``meshes`` (by name) as the
        head does, and lay the circuits it then holds on the flow network. Blocks on its
        plan and reconfiguration."""
        fabric = self.fabric
        if fabric is None or phase.traffic is None:
            return
        if isinstance(phase.traffic, Collective):
            if phase.traffic.mesh not in meshes:
                return
            mesh = meshes[phase.traffic.mesh]
            traffic: Any = (phase.traffic.kind, mesh.mesh_id, phase.traffic.nbytes)
            ends = {mesh.mesh_id: mesh}
        else:
            pairs = {p: n for p, n in phase.traffic.items() if p[0] in meshes and p[1] in meshes}
            if not pairs:
                return
            traffic = {(meshes[a].mesh_id, meshes[b].mesh_id): n for (a, b), n in pairs.items()}
            ends = {meshes[m].mesh_id: meshes[m] for p in pairs for m in p}
        switches: dict[str, list[str | None]] = {
            mesh_id: [fabric.host_endpoint(m.address) for m in mesh.members]
            for mesh_id, mesh in ends.items()
        }
        demand = hint_demand(traffic, switches)
        await fabric.hint(Hint(job, phase.name, demand, phase.expected_s))
        self.net.set_circuits(circuits_of(fabric))


def circuits_of(fabric: FabricManager) -> dict[tuple[str, str], float]:
    """The circuits ``fabric`` holds now, as ``{(switch_a, switch_b): gbps}``."""
    shown = fabric.show()
    out: dict[tuple[str, str], float] = {}
    for ocs in shown["ocs"]:
        for *_ports, a, b in ocs["circuits"]:
            out[a, b] = out.get((a, b), 0.0) + float(shown["circuit_gbps"])
    return out


class SimClient:
    """The call path of a simulated cluster: a call runs the member's model in this loop, one
    call at a time for an endpoint that is not ``concurrent`` (as a worker runs them)."""

    token = ""

    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        self._inflight: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._specs: dict[tuple[type, str], bool] = {}
        # the calls running (a send's too); the simulation's end cancels what is left
        self._calls = TaskOwner()

    def inflight(self, actor_id: str) -> int:
        return self._inflight.get(actor_id, 0)

    def call(
        self,
        address: str,
        actor_id: str,
        label: str,
        endpoint: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None = None,
        fallback: str | None = None,
        retry: bool = False,
    ) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        actor = self.cluster.actors.get(actor_id)
        if actor is None:
            future = loop.create_future()
            future.set_exception(ActorDiedError(f"{label} is not running", actor=actor_id))
            return future
        method = getattr(actor, endpoint, None)
        if method is None:
            raise SimulationError(
                f"the simulated {type(actor).__name__} models no endpoint {endpoint!r} "
                f"(called on {label})"
            )
        self._inflight[actor_id] = self._inflight.get(actor_id, 0) + 1
        concurrent = getattr(actor, "concurrent", ())
        lock = None if endpoint in concurrent else self._locks.setdefault(actor_id, asyncio.Lock())
        task = self._calls.start(self._run(actor_id, lock, method, args, kwargs))
        return task

    async def _run(
        self,
        actor_id: str,
        lock: asyncio.Lock | None,
        method: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        try:
            if lock is None:
                return await method(*args, **kwargs)
            async with lock:
                return await method(*args, **kwargs)
        finally:
            self._inflight[actor_id] -= 1

    def send(
        self,
        address: str,
        actor_id: str,
        endpoint: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.call(address, actor_id, actor_id, endpoint, args, kwargs)


class SimContext:
    """A job context on a :class:`SimCluster`: the calls a job's ``main(ctx)`` makes, with
    the job's phases as spans of its event log (virtual time) and, when the cluster has a
    fabric manager, as its hints. ``trace_dir`` holds the event log (a temporary folder by
    default); :meth:`write_trace` exports it for Perfetto."""

    def __init__(self, cluster: SimCluster, *, job_id: str = "sim", trace_dir: str | None = None):
        self.cluster = cluster
        self.job_id = job_id
        self.trace_dir = trace_dir or tempfile.mkdtemp(prefix="orchestr-sim-")
        os.makedirs(self.trace_dir, exist_ok=True)
        self.events = EventLog(os.path.join(self.trace_dir, "events.jsonl"))
        self.meshes: dict[str, Mesh] = {}
        #: Every phase the job ran: ``(name, start, end)`` in virtual seconds.
        self.phases: list[tuple[str, float, float]] = []
        self._current: list[Phase] = []
        self._announced: dict[str, Phase] = {}

    @property
    def current_phase(self) -> Phase | None:
        return self._current[-1] if self._current else None

    async def spawn(
        self,
        actor: type[Actor] | str,
        *args: Any,
        n: int = 1,
        name: str | None = None,
        resources: Mapping[str, float] | None = None,
        labels: Mapping[str, str] | None = None,
        restart: Any = None,
        supervise: Any = None,
        per_process: int = 1,
        strategy: str = "SPREAD",
        reservation: Any = None,
        **kwargs: Any,
    ) -> Mesh:
        """Place and build ``n`` members, as :meth:`JobContext.spawn` does; blocks on
        nothing. Raises :class:`ConfigError` for a bad ``n`` or a class no role models."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"n must be a positive integer, got {n!r}")
        path = actor if isinstance(actor, str) else class_path(actor)
        mesh_name = name or path.rsplit(":", 1)[-1].lower()
        mesh = self.cluster.place(
            path, mesh_name, n, resources or {}, labels or {}, strategy, args, kwargs
        )
        self.meshes[mesh.name] = mesh
        self.events.record("spawn", mesh=mesh.name, size=n, class_path=path)
        return mesh

    async def stop(self, mesh: Mesh) -> None:
        self.cluster.remove(mesh)

    async def init_distributed(self, mesh: Mesh, **_: Any) -> list[dict[str, Any]]:
        n = len(mesh.members)
        return [{"rank": m.rank, "world_size": n, "backend": "sim"} for m in mesh.members]

    def announce(
        self,
        name: str,
        *,
        traffic: Any = None,
        expected_s: float | None = None,
        lead_s: float | None = None,
    ) -> None:
        self._announced[name] = make_phase(name, traffic, expected_s)

    @contextlib.asynccontextmanager
    async def phase(
        self, name: str, *, traffic: Any = None, expected_s: float | None = None
    ) -> AsyncIterator[Phase]:
        """Run the block as phase ``name``, as :meth:`JobContext.phase` does: its traffic is
        hinted to the fabric manager first (blocking on its plan), and it is a span of the
        event log."""
        phase = make_phase(name, traffic, expected_s)
        announced = self._announced.pop(name, None)
        if announced is not None and traffic is None:
            phase = announced
        await self.cluster.hint(self.job_id, phase, self.meshes)
        self._current.append(phase)
        start = self.cluster.engine.seconds
        try:
            with self.events.span(name, track="phases", kind="phase", **phase.describe()):
                yield phase
        finally:
            self._current.remove(phase)
            self.phases.append((name, start, self.cluster.engine.seconds))

    def close(self) -> None:
        """Close the event log. Idempotent."""
        self.events.close()

    def write_trace(self, folder: str | None = None) -> str:
        """Close the event log and export it as a Chrome/Perfetto trace (``trace.json`` in
        ``folder``, by default the trace folder); returns its path."""
        self.close()
        path = os.path.join(folder or self.trace_dir, "trace.json")
        export_trace(self.events.path, path)
        return path
