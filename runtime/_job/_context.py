"""The job controller's side: the embedded local cluster, :class:`JobContext` and :func:`run`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Mapping
from typing import Any, TypeVar

import structlog

from orchestr._actor._actor import Actor, class_path, saves_state
from orchestr._actor._distributed import init_distributed
from orchestr._call import _serde
from orchestr._call._client import CallClient
from orchestr._call._mesh import Member, Mesh
from orchestr._cluster._records import STRATEGIES, validate_resources
from orchestr._control._convert import ActorInfo, NodeInfo
from orchestr._control._grpc import ControlChannel
from orchestr._control._head_client import HeadClient
from orchestr.config import Config
from orchestr.errors import ConfigError, SupervisionError
from orchestr.tasks import TaskOwner

from ._events import EventLog, export_trace
from ._hints import tell_fabric
from ._hosting import Hosting, lookup
from ._paths import import_path
from ._phases import FabricHints, Phase, RecordingHints, make_phase
from ._policy import RestartPolicy, SuperviseHook, check_spawn_options
from ._reservation import Reservation
from ._supervise import Supervisor

__all__ = ["JobContext"]

log = structlog.get_logger("orchestr.driver")

T = TypeVar("T")


class JobContext:
    """What a job's ``main(ctx)`` gets: spawning meshes and reading cluster state."""

    def __init__(
        self,
        head: ControlChannel,
        client: CallClient,
        config: Config,
        job_id: str,
        session_dir: str,
    ) -> None:
        self.head = head
        #: Where this job's worker logs (JSON lines) are written.
        self.session_dir = session_dir
        self.client = client
        self.config = config
        self.job_id = job_id
        self._client = HeadClient(head)
        self._meshes: list[Mesh] = []
        self._reservations: list[Reservation] = []
        self._reserved_in: dict[str, str] = {}  # mesh id -> the reservation it was spawned in
        #: The job's event log (JSON lines); exported as ``trace.json`` when the job ends.
        self.events = EventLog(
            os.path.join(session_dir, "events.jsonl"), max_bytes=config.event_log_max_bytes
        )
        #: Where phase hints go: the fabric manager, or (by default) a recorder.
        self.hints: FabricHints = RecordingHints()
        self._phases: list[Phase] = []
        #: Whether the head runs a fabric manager (None: not asked yet); without one, phase
        #: hints stay in the event log.
        self._fabric_on: bool | None = None
        #: Phases announced ahead (:meth:`announce`): their declaration and hint in flight.
        self._announced: dict[str, tuple[Phase, asyncio.Task[None]]] = {}
        self._announcing = TaskOwner()  # the hints of announced phases in flight
        #: Hears of deaths of this job's actors and restarts, accepts or escalates them.
        self.supervisor = Supervisor(
            head, client, self.events, self._escalate, reconnect_s=config.head_reconnect_timeout
        )
        self._host: asyncio.Task[Any] | None = None
        #: Actors this program hosts itself (:meth:`serve_actor`).
        self._hosting = Hosting(self._client, client.token, config)

    def _escalate(self, error: SupervisionError) -> None:
        """The root policy: an escalated failure fails the job loudly, at once. The job's
        main is cancelled; leaving the cluster raises ``error``."""
        if self._host is not None and not self._host.done():
            self._host.cancel(msg="orchestr: an actor failure escalated to the job's root")

    @property
    def current_phase(self) -> Phase | None:
        """The innermost phase now running, if any."""
        return self._phases[-1] if self._phases else None

    @contextlib.asynccontextmanager
    async def phase(
        self, name: str, *, traffic: Any = None, expected_s: float | None = None
    ) -> AsyncIterator[Phase]:
        """Run the block as phase ``name`` (``generation``, ``training``, ``weight_sync``,
        ``idle`` or the job's own word), declaring the traffic it expects: bytes between meshes
        ``{("trainer", "generator"): n}`` or an :class:`orchestr.Collective`. The fabric hints
        hear of it before the block starts; the event log and trace get a span.

        Entering blocks on the fabric manager's plan when ``Config.fabric`` is ``managed``
        (a head without a fabric manager is asked once); raises :class:`ConfigError` for a bad
        name or traffic. Cancel-safe: a cancelled block ends its phase's span."""
        phase = make_phase(name, traffic, expected_s)
        announced = self._announced.pop(name, None)
        if announced is not None and traffic is None:
            phase = announced[0]  # its traffic was declared ahead, with announce()
        if announced is not None:
            await announced[1]  # the circuits planned in its lead time (or their failure)
        else:
            await tell_fabric(self, phase)
        self.hints.upcoming(phase)
        self._phases.append(phase)
        try:
            with self.events.span(name, track="phases", kind="phase", **phase.describe()):
                yield phase
        finally:
            self._phases.remove(phase)
            self.hints.ended(phase)

    def announce(
        self,
        name: str,
        *,
        traffic: Any = None,
        expected_s: float | None = None,
        lead_s: float | None = None,
    ) -> None:
        """Tell the fabric manager now about phase ``name`` coming in about ``lead_s`` seconds
        (its traffic as for :meth:`phase`), so circuits can be laid while the job goes on; the
        later ``phase(name)`` waits for them instead of asking then. Returns at once."""
        phase = make_phase(name, traffic, expected_s)
        if lead_s is not None and not (isinstance(lead_s, int | float) and lead_s >= 0):
            raise ConfigError(f"lead_s is a number of seconds >= 0, got {lead_s!r}")
        previous = self._announced.pop(name, None)
        if previous is not None:
            previous[1].cancel()
        task = self._announcing.start(tell_fabric(self, phase, float(lead_s or 0.0)))
        self._announced[name] = (phase, task)

    #: ``host:port`` of the head's Prometheus endpoint (``GET /metrics``); ``None`` when the
    #: head serves none (``ORCHESTR_METRICS_PORT=-1``) or is not this job's own.
    metrics_address: str | None = None
    #: ``host:port`` of the head's dashboard; ``None`` when it serves none (an embedded
    #: cluster's head serves one only with ``ORCHESTR_DASHBOARD_PORT`` set) or is not this
    #: job's own.
    dashboard_address: str | None = None

    @property
    def head_address(self) -> str:
        """``host:port`` of the cluster's head: what another node joins
        (``python -m orchestr._cluster._node --head ADDRESS``)."""
        return self.head.address

    @property
    def token(self) -> str:
        """The cluster token every control-plane request and call connection presents; a
        node joining the cluster needs it (``ORCHESTR_TOKEN``). Keep it secret."""
        return self.client.token

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
        strategy: str = "SPREAD",
        reservation: Reservation | None = None,
        **kwargs: Any,
    ) -> Mesh:
        """Create ``n`` actors of class ``actor`` (a class or ``"module:Class"``), each built with
        ``actor(*args, **kwargs)``, placed on nodes that have ``resources`` free and carry
        ``labels``. Blocks until every member is ready; all or nothing.

        ``restart`` (a :class:`RestartPolicy`; default: no restarts, at-most-once) and
        ``supervise`` (``"restart"``, ``"handle"``, ``"escalate"`` or a function of a
        :class:`Failure` returning one) decide what a member's death does. By default a death
        with no restart left fails the job with :class:`SupervisionError`. ``per_process``
        members of a node share one worker process (light actors: fewer processes, and a call
        to all of them wakes each process once); a process that dies takes all of its members
        with it, and each is restarted in a process of its own. ``strategy`` places the
        members over nodes: ``"SPREAD"`` (each member where most CPU is free),
        ``"PACK"`` (as few nodes as fit), ``"STRICT_PACK"`` (one node or none),
        ``"STRICT_SPREAD"`` (a node each or none). ``reservation`` (from :meth:`reserve`)
        places the members in its free bundles instead, one each; ``resources`` then default
        to a bundle's and may not exceed it.

        Raises :class:`PlacementError`, or :class:`SpawnError` with the remote traceback when
        an import or ``__init__`` fails. Not idempotent.
        Not cancel-safe: members started before a cancellation live on until the job ends.
        """
        path = actor if isinstance(actor, str) else class_path(actor)
        policy = check_spawn_options(restart, supervise, per_process)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"n must be a positive integer, got {n!r}")
        if name is not None and not isinstance(name, str):
            raise ConfigError(f"name must be a string, got {name!r}")
        if strategy not in STRATEGIES:
            raise ConfigError(
                f"unknown placement strategy {strategy!r}; say one of {', '.join(STRATEGIES)}"
            )
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in (labels or {}).items()):
            raise ConfigError(f"labels map strings to strings, got {labels!r}")
        if reservation is not None and not isinstance(reservation, Reservation):
            raise ConfigError(f"reservation must come from ctx.reserve, got {reservation!r}")
        init_args, buffers = _serde.encode([list(args), kwargs])
        if buffers:
            raise ConfigError(
                "tensors and arrays cannot be constructor arguments (they would ride the control "
                "plane); pass them in a call after spawn"
            )
        info = await self._client.spawn_mesh(
            path,
            init_args,
            n,
            resources=validate_resources(resources or {}),
            labels=dict(labels or {}),
            name=name or "",
            restart=policy,
            per_process=per_process,
            # The job's import path travels with the spawn: a node started elsewhere (without
            # the job's environment) puts it first on its workers' PYTHONPATH.
            python_path=import_path(),
            strategy=strategy,
            reservation_id=reservation.reservation_id if reservation is not None else "",
        )
        mesh = Mesh(
            info.mesh_id,
            info.name,
            info.class_path,
            [Member(m.actor_id, m.call_address, m.rank) for m in info.members],
            list(info.members[0].endpoints) if info.members else [],
            retry=policy.retry == "at_least_once",
        )
        saves = not isinstance(actor, str) and saves_state(actor)
        self.supervisor.adopt(mesh, policy, supervise, saves)
        self._meshes.append(mesh)
        if reservation is not None:
            self._reserved_in[mesh.mesh_id] = reservation.reservation_id
        self.events.record("spawn", mesh=mesh.name, size=n, class_path=mesh.class_path)
        log.info("spawned", mesh=mesh.name, size=n)
        return mesh

    async def reserve(
        self,
        n: int = 1,
        *,
        resources: Mapping[str, float] | None = None,
        labels: Mapping[str, str] | None = None,
        strategy: str = "SPREAD",
        name: str | None = None,
    ) -> Reservation:
        """Hold ``n`` bundles of ``resources`` on nodes carrying ``labels``, placed at once by
        ``strategy`` (as :meth:`spawn` places members), or none: a gang reserved ahead of
        spawning, like a Ray placement group. Spawn into it with ``spawn(...,
        reservation=r)``; ``await r.release()`` (or the job's end) frees it. Raises
        :class:`PlacementError` saying what was missing.

        Blocks on one call to the head. Not cancel-safe: cancelled after the head made the
        reservation, the job never learns its id, and its resources stay held."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"n must be a positive integer, got {n!r}")
        if strategy not in STRATEGIES:
            raise ConfigError(
                f"unknown placement strategy {strategy!r}; say one of {', '.join(STRATEGIES)}"
            )
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in (labels or {}).items()):
            raise ConfigError(f"labels map strings to strings, got {labels!r}")
        info = await self._client.reserve(
            n,
            resources=validate_resources(resources or {}),
            labels=dict(labels or {}),
            strategy=strategy,
            name=name or "",
        )
        r = Reservation(info.reservation_id, info.name, info.resources, info.node_ids, self)
        self._reservations.append(r)
        self.events.record("reserve", reservation=r.name, bundles=n)
        return r

    async def release(self, reservation: Reservation) -> None:
        """Free ``reservation`` and stop the actors spawned in it. Idempotent.

        Blocks on one call to the head; raises :class:`ControlPlaneError` when it cannot be
        reached. Cancel-safe: call it again."""
        for mesh in self._meshes:  # their members end with it: not a failure
            if self._reserved_in.get(mesh.mesh_id) == reservation.reservation_id:
                self.supervisor.forget(mesh)
        await self._client.release(reservation.reservation_id)
        if reservation in self._reservations:
            self._reservations.remove(reservation)

    def write_trace(self, folder: str | os.PathLike[str]) -> str:
        """Copy the job's event log so far to ``folder/events.jsonl`` and write its
        Chrome/Perfetto trace beside it as ``trace.json``; returns the trace's path. (The
        session's own ``trace.json`` is written when the job ends.)"""
        os.makedirs(folder, exist_ok=True)
        events = os.path.join(folder, "events.jsonl")
        shutil.copyfile(self.events.path, events)
        trace = os.path.join(folder, "trace.json")
        export_trace(events, trace)
        return trace

    async def stop(self, mesh: Mesh) -> None:
        """Stop every actor of ``mesh`` (its workers get SIGTERM). Idempotent.

        Blocks until the head has stopped them; raises :class:`ControlPlaneError` when it
        cannot be reached. Cancel-safe: call it again."""
        if self._hosting.hosts(mesh):
            await self._hosting.stop(mesh)
            return
        self.supervisor.forget(mesh)
        await self._client.stop_mesh(mesh.mesh_id)

    async def serve_actor(self, actor: Actor, *, name: str) -> Mesh:
        """Host ``actor``, an instance this program built, in this process: it serves calls
        here and the cluster knows it as the mesh ``name`` of one member, which other jobs
        find with :meth:`lookup` (give it a name no other live mesh has). Returns its mesh.
        It is stopped by :meth:`stop` or when this job ends; if this program dies, the head
        records it dead and its callers get :class:`ActorDiedError`. After a head restart it
        is registered again by itself.

        Blocks until the head recorded it. Raises :class:`ConfigError` for something that
        is not an actor instance, one hosted already or a bad name, and
        :class:`ControlPlaneError` when the head cannot be reached. Cancel-safe: a
        cancelled registration leaves nothing hosted."""
        mesh = await self._hosting.serve(actor, name)
        self._meshes.append(mesh)
        self.events.record("host", mesh=mesh.name, class_path=mesh.class_path)
        return mesh

    async def lookup(self, name: str) -> Mesh:
        """The live mesh named ``name``, of any job or program on the cluster (one spawned
        with ``name=``, or hosted by :meth:`serve_actor`): a handle to call it by. This job
        does not supervise it.

        Blocks on one call to the head; raises :class:`MeshError` when no live mesh has that
        name or several have, :class:`ControlPlaneError` when the head cannot be reached.
        Cancel-safe: it changes nothing."""
        return lookup(await self._client.actors(), name)

    async def init_distributed(
        self, mesh: Mesh, *, backend: str | None = None, timeout_s: float = 120.0
    ) -> list[dict[str, Any]]:
        """Make the members of ``mesh`` one ``torch.distributed`` process group, rank = mesh
        rank: member 0 serves the rendezvous store on its host, then all join at once.
        ``backend``: ``"gloo"`` or ``"nccl"`` (default: nccl where CUDA is available, else
        gloo). Blocks until every member has joined, at most ``timeout_s``; returns what each
        reports (rank, world_size, backend). Raises :class:`ConfigError` for a bad backend or
        members that share a process, :class:`ActorError` when a member cannot join. Once per
        process: not idempotent.

        Not cancel-safe: members that joined stay in a group the others never reach."""
        return await init_distributed(self, mesh, backend, timeout_s)

    async def checkpoint(self, mesh: Mesh) -> int:
        """Save the state of every member of ``mesh`` (its class defines ``save_state``); a
        member restarted later is given the last saved state through ``load_state``. Runs in
        order with each member's other calls. Returns how many members were saved (a dead one
        is skipped); raises :class:`ConfigError` when the class saves nothing.

        Blocks on every member's ``save_state`` call. Cancel-safe: a member's state saved
        before the cancellation is kept, and the rest keep their previous one."""
        return await self.supervisor.checkpoint(mesh)

    async def nodes(self) -> list[NodeInfo]:
        """The cluster's nodes as the head last heard of them (dead ones too, until pruned).
        Blocks on one call to the head; raises :class:`ControlPlaneError` when it cannot be
        reached. Cancel-safe: it changes nothing."""
        return await self._client.nodes()

    async def actors(self) -> list[ActorInfo]:
        """Every actor the head records, of every job, in every state. Blocks on one call to
        the head; raises :class:`ControlPlaneError` when it cannot be reached. Cancel-safe: it
        changes nothing."""
        return await self._client.actors()
