"""The head service: cluster membership, placement and actor lifecycle over gRPC. It owns the
head's state and serves every RPC of the ``Head`` service: the nodes' here, the meshes' through
its part :class:`~._head_meshes.MeshRpcs`, the jobs', logs' and fabric's through the functions
of :mod:`._head_jobs`."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import structlog

from orchestr._control._convert import actor_to_pb, node_to_pb
from orchestr._control._grpc import ControlChannel, abort_with, add_port, make_server
from orchestr._control._head_client import describe_exit
from orchestr.config import Config
from orchestr.errors import (
    ConfigError,
)
from orchestr.protos import orchestr_pb2 as pb
from orchestr.protos import orchestr_pb2_grpc as pb_grpc
from orchestr.tasks import TaskOwner

from . import _head_jobs as jobs_rpc
from ._dashboard import AttachedLogs, DashboardServer
from ._head_changes import ActorChanges
from ._head_meshes import MeshRpcs
from ._headstate import HeadState
from ._headstore import HeadStore, MeshRecord, StoreWriteError
from ._metrics import MetricsServer
from ._records import validate_resources
from ._submitted import JobManager

if TYPE_CHECKING:
    from orchestr.fabric.optical import FabricManager

__all__ = ["HeadService"]

log = structlog.get_logger("orchestr.head")


class HeadService(pb_grpc.HeadServicer):
    """Serves the ``Head`` gRPC service. ``async with`` starts and stops it."""

    def __init__(
        self, token: str, config: Config, *, port: int = 0, store: HeadStore | None = None
    ) -> None:
        self.token = token
        self.config = config
        self.state = HeadState()
        #: This head's incarnation; a node whose heartbeat another one answers registers again.
        self.epoch = secrets.token_hex(8)
        #: Where the state is kept across restarts (a head daemon's); ``None``: in memory only.
        self.store = store
        #: Since when writes to the store fail (monotonic s), or None; unsaved changes stay
        #: marked and are written again with each save meanwhile.
        self.store_failing_since: float | None = None
        self._store_error_logged = 0.0
        self._forget_actors: set[str] = set()
        self._forget_meshes: set[str] = set()
        self.meshes: dict[str, MeshRecord] = {}
        self._dirty_meshes: set[str] = set()
        self._host_streams: dict[str, object] = {}
        self._born = self.state.now()
        self._rehosted = False  # restored hosted actors not yet checked for their programs
        if store is not None:
            nodes, actors, meshes, reservations = store.load()
            self.state.restore(nodes, actors, self.state.now(), reservations)
            self.meshes = {m.mesh_id: m for m in meshes}
            if nodes or actors:
                log.info(
                    "head state restored",
                    nodes=len(nodes),
                    actors=sum(a.state in ("starting", "alive") for a in actors),
                    meshes=sum(not m.stopped for m in meshes),
                )
        self.server = make_server(token, config)
        pb_grpc.add_HeadServicer_to_server(self, self.server)  # type: ignore[no-untyped-call]
        self.port = add_port(self.server, f"{config.bind_host}:{port}", config)
        self.address = f"{config.bind_host}:{self.port}"
        self._channels: dict[str, ControlChannel] = {}
        self._changes = ActorChanges()
        # it shares the mesh records and the hosted actors' streams: changed in place, never
        # replaced
        self._mesh_rpcs = MeshRpcs(
            self.state,
            self.meshes,
            self._dirty_meshes,
            self._host_streams,
            self._changes,
            token=token,
            config=config,
            channel=self._channel,
            save=self.save,
        )
        # the heartbeat monitor and the saver: aclose() cancels and awaits each
        self._tasks = TaskOwner()
        self._monitor: asyncio.Task[None] | None = None
        self._saver: asyncio.Task[None] | None = None
        self.metrics = MetricsServer(self.state, token, config)
        #: The web dashboard (``Config.dashboard_port``; off at -1).
        self.dashboard = DashboardServer(self, config)
        #: The event logs controllers elsewhere send (``JobEvents``), for the dashboard.
        self.attached = AttachedLogs(self.dashboard, config.event_log_max_bytes)
        #: Submitted jobs; only a head daemon (with a state directory) takes them.
        self.jobs: JobManager | None = None
        #: Where the daemons of the head's host write their JSON-lines logs, if anywhere.
        self.log_dir: Path | None = None
        #: The fabric manager, when the head daemon was given a cabling plan (``--fabric``).
        self.fabric: FabricManager | None = None

    @property
    def metrics_address(self) -> str | None:
        """``host:port`` of its ``GET /metrics`` once started; ``None`` when metrics are off."""
        return self.metrics.address

    @property
    def dashboard_address(self) -> str | None:
        """``host:port`` of its dashboard once started; ``None`` when it is off."""
        return self.dashboard.address

    async def __aenter__(self) -> HeadService:
        await self.metrics.start()
        try:
            await self.dashboard.start()
        except BaseException:
            await self.metrics.aclose()
            raise
        await self.server.start()
        self._monitor = self._tasks.start(self._watch_heartbeats())
        if self.store is not None:
            self._saver = self._tasks.start(self._save_every(0.1))
        log.info("head started", address=self.address, epoch=self.epoch)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self.jobs is not None:
            await self.jobs.aclose()
        await self.dashboard.aclose()
        self.attached.close()
        await self.metrics.aclose()
        for task in (self._monitor, self._saver):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._monitor = self._saver = None
        await self.server.stop(grace=0.5)
        self.save()
        for ch in self._channels.values():
            await ch.aclose()
        self._channels.clear()

    def save(self) -> None:
        """Forget actors that ended long ago (and meshes left with none), then write what
        changed since the last save to the store."""
        gone = self.state.prune()
        empty: set[str] = set()
        if gone:
            empty = {a.mesh_id for a in gone} - {a.mesh_id for a in self.state.actors.values()}
            for mesh_id in empty:
                self.meshes.pop(mesh_id, None)
                self._dirty_meshes.discard(mesh_id)
        if self.store is None:
            self.state.take_dirty()
            self._dirty_meshes.clear()
            return
        nodes, actors, reservations = self.state.take_dirty()
        meshes = [self.meshes[m] for m in self._dirty_meshes if m in self.meshes]
        self._dirty_meshes.clear()
        self._forget_actors.update(a.actor_id for a in gone)
        self._forget_meshes.update(empty)
        try:
            self.store.save(nodes, actors, meshes, reservations)
            self.store.forget(self._forget_actors, self._forget_meshes)
        except StoreWriteError as exc:
            # kept marked, to be written with the next save (every 100 ms)
            self.state.dirty_nodes.update(n.node_id for n in nodes)
            self.state.dirty_actors.update(a.actor_id for a in actors)
            self.state.dirty_reservations.update(r.reservation_id for r in reservations)
            self._dirty_meshes.update(m.mesh_id for m in meshes)
            now = time.monotonic()
            if self.store_failing_since is None:
                self.store_failing_since = now
            if now - self._store_error_logged >= 10.0:
                self._store_error_logged = now
                log.error(
                    "the head cannot save its state; retrying",
                    error=str(exc),
                    failing_for_s=round(now - self.store_failing_since, 1),
                )
            return
        self._forget_actors.clear()
        self._forget_meshes.clear()
        if self.store_failing_since is not None:
            log.warning(
                "the head saves its state again",
                after_s=round(time.monotonic() - self.store_failing_since, 1),
            )
            self.store_failing_since = None
            self._store_error_logged = 0.0

    async def _save_every(self, period: float) -> None:
        """Changes made outside an RPC's own save (a worker's creation finishing) reach the
        store within ``period`` s."""
        while True:
            await asyncio.sleep(period)
            self.save()

    def _channel(self, address: str) -> ControlChannel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = ControlChannel(address, self.token, self.config)
        return ch

    async def _watch_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)
            try:
                self._expire_nodes()
            except Exception:  # a bug: said loudly, and the watch goes on
                log.exception("the heartbeat monitor failed; it keeps watching")

    def _expire_nodes(self) -> None:
        timeout = self.config.heartbeat_timeout
        for node_id in self.state.expire_nodes(self.state.now(), timeout):
            log.warning("node missed its heartbeats; marked dead", node=node_id)
            reason = f"node {node_id} was lost: no heartbeat for over {timeout:g} s"
            for record in self.state.node_lost(node_id, reason):
                log.warning(
                    "actor lost with its node",
                    actor=record.label,
                    actor_id=record.actor_id,
                    node=node_id,
                    restarting=record.state == "restarting",
                )
                self._changes.notify(record.actor_id)
                self._changes.publish("died", record)
        if not self._rehosted and self.state.now() - self._born > timeout:
            # once: only records restored from the store can lack a program's stream
            self._rehosted = True
            orphans = [
                a.actor_id
                for a in self.state.actors.values()
                if not a.node_id and a.state == "alive" and a.actor_id not in self._host_streams
            ]
            reason = (
                f"the program hosting it did not register within {timeout:g} s of a head restart"
            )
            for actor_id in orphans:
                if self.state.host_lost(actor_id, reason):
                    log.warning("hosted actor lost", actor_id=actor_id, reason=reason)
                    self._changes.notify(actor_id)
        self.save()

    # -- node-facing RPCs ----------------------------------------------------------------
    async def RegisterNode(
        self, request: pb.RegisterNodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterNodeReply:
        try:
            validate_resources(dict(request.total.amounts))  # before anything is changed
        except ConfigError as exc:
            await abort_with(context, ConfigError(f"node {request.node_id}: {exc}"))
        stray: list[str] = []
        if request.node_id in self.state.nodes:
            # It was known: this head restarted, or had marked it dead. Adopt the actors of
            # the workers it still runs; the others ended while the head could not see them.
            was_alive = self.state.nodes[request.node_id].alive
            reason = f"its worker was gone when node {request.node_id} registered again" + (
                "" if was_alive else " (the node had been marked dead)"
            )
            live = [w.worker_id for w in request.workers]
            ended, stray = self.state.rejoin(request.node_id, live, reason)
            for record in ended:
                self._changes.notify(record.actor_id)
                self._changes.publish("died", record)
            adopted = sum(
                a.node_id == request.node_id and a.state == "alive"
                for a in self.state.actors.values()
            )
            log.info(
                "node registered again",
                node=request.node_id,
                address=request.address,
                adopted=adopted,
                ended=len(ended),
                stopping=len(stray),
            )
        self.state.register_node(
            request.node_id,
            request.address,
            dict(request.total.amounts),
            dict(request.labels),
            self.state.now(),
            transports=list(request.transports),
            devices=list(request.devices),
        )
        self.save()
        if not request.rejoin:
            log.info("node registered", node=request.node_id, address=request.address)
        return pb.RegisterNodeReply(epoch=self.epoch, stop_workers=stray)

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatReply:
        known = self.state.heartbeat(
            request.node_id, self.state.now(), request.workers, request.suspended
        )
        return pb.HeartbeatReply(epoch=self.epoch, register_again=not known)

    async def ReportWorkerExit(
        self, request: pb.WorkerExit, context: grpc.aio.ServicerContext
    ) -> pb.Ack:
        for record in self.state.worker_exited(
            request.worker_id, request.exit_code, request.signal, request.last_output
        ):
            log.warning(
                "actor died",
                actor=record.label,
                actor_id=record.actor_id,
                node=request.node_id,
                reason=describe_exit(request.pid, request.exit_code, request.signal),
                restarting=record.state == "restarting",
            )
            self._changes.notify(record.actor_id)
            self._changes.publish("died", record)
        self.save()
        return pb.Ack()

    async def ListNodes(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.NodeList:
        return pb.NodeList(nodes=[node_to_pb(n) for n in self.state.nodes.values()])

    async def ListActors(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> pb.ActorList:
        actors = self.state.actors.values()
        return pb.ActorList(actors=[actor_to_pb(a, self.state.is_suspended(a)) for a in actors])

    # -- the mesh RPCs, served by the part that holds them --------------------------------
    async def SpawnMesh(
        self, request: pb.SpawnMeshRequest, context: grpc.aio.ServicerContext
    ) -> pb.MeshInfo:
        return await self._mesh_rpcs.SpawnMesh(request, context)

    async def StopMesh(
        self, request: pb.StopMeshRequest, context: grpc.aio.ServicerContext
    ) -> pb.Ack:
        return await self._mesh_rpcs.StopMesh(request, context)

    async def HostActor(
        self, request: pb.HostActorRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.MeshInfo]:
        # an async generator itself, as grpc serves a streaming RPC only from one
        async with contextlib.aclosing(self._mesh_rpcs.HostActor(request, context)) as replies:
            async for reply in replies:
                yield reply

    async def Reserve(
        self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReservationInfo:
        return await self._mesh_rpcs.Reserve(request, context)

    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.Ack:
        return await self._mesh_rpcs.Release(request, context)

    async def GetActor(
        self, request: pb.GetActorRequest, context: grpc.aio.ServicerContext
    ) -> pb.ActorInfo:
        return await self._mesh_rpcs.GetActor(request, context)

    async def WatchActors(
        self, request: pb.WatchActorsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ActorEvent]:
        async with contextlib.aclosing(self._mesh_rpcs.WatchActors(request, context)) as events:
            async for event in events:
                yield event

    async def RestartActor(
        self, request: pb.RestartActorRequest, context: grpc.aio.ServicerContext
    ) -> pb.ActorInfo:
        return await self._mesh_rpcs.RestartActor(request, context)

    async def AbandonActor(
        self, request: pb.AbandonActorRequest, context: grpc.aio.ServicerContext
    ) -> pb.Ack:
        return await self._mesh_rpcs.AbandonActor(request, context)

    # -- jobs, the daemons' logs and the fabric manager ----------------------------------
    async def SubmitJob(
        self, request: pb.SubmitJobRequest, context: grpc.aio.ServicerContext
    ) -> pb.JobInfo:
        return await jobs_rpc.submit_job(self.jobs, request, context)

    async def ListJobs(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.JobList:
        return await jobs_rpc.list_jobs(self.jobs, context)

    async def GetJobLogs(
        self, request: pb.JobLogsRequest, context: grpc.aio.ServicerContext
    ) -> pb.JobLogs:
        return await jobs_rpc.job_logs(self.jobs, request, context)

    async def StopJob(
        self, request: pb.JobRequest, context: grpc.aio.ServicerContext
    ) -> pb.JobInfo:
        return await jobs_rpc.stop_job(self.jobs, request, context)

    async def GetDaemonLog(
        self, request: pb.DaemonLogRequest, context: grpc.aio.ServicerContext
    ) -> pb.DaemonLog:
        return await jobs_rpc.daemon_log(self.state, self._channel, self.log_dir, request, context)

    async def JobEvents(
        self, request: pb.JobEventsRequest, context: grpc.aio.ServicerContext
    ) -> pb.JobEventsReply:
        return await jobs_rpc.job_events(self.attached, request, context)

    async def FabricHint(
        self, request: pb.FabricHintRequest, context: grpc.aio.ServicerContext
    ) -> pb.FabricPlan:
        return await jobs_rpc.hint_fabric(self.fabric, self.state, request, context)

    async def FabricShow(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> pb.FabricState:
        return await jobs_rpc.fabric_show(self.fabric, context)

    async def FabricHistory(
        self, request: pb.FabricHistoryRequest, context: grpc.aio.ServicerContext
    ) -> pb.FabricPlans:
        return await jobs_rpc.fabric_history(self.fabric, request, context)
