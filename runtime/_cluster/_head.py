"""The head service: cluster membership, placement and actor lifecycle over gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import structlog

from orchestr._control._convert import actor_to_pb, fabric_state_to_pb, node_to_pb, plan_to_pb
from orchestr._control._grpc import ControlChannel, abort_with, add_port, make_server
from orchestr._control._head_client import describe_exit
from orchestr._log import read_daemon_log
from orchestr.config import Config
from orchestr.errors import (
    ConfigError,
    ControlPlaneError,
    OrchestrError,
    SpawnError,
)
from orchestr.protos import orchestr_pb2 as pb
from orchestr.protos import orchestr_pb2_grpc as pb_grpc

from ._fabric import fabric_hint
from ._headstate import (
    ActorRecord,
    HeadState,
    check_mesh_size,
    validate_python_path,
    validate_resources,
)
from ._headstore import HeadStore, MeshRecord, StoreWriteError
from ._metrics import MetricsServer
from ._submitted import JobManager, JobRecord, job_info

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
        self._changed: dict[str, asyncio.Event] = {}
        self._watchers: set[asyncio.Queue[pb.ActorEvent | None]] = set()
        self._monitor: asyncio.Task[None] | None = None
        self._saver: asyncio.Task[None] | None = None
        self.metrics = MetricsServer(self.state, token, config)
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

    async def __aenter__(self) -> HeadService:
        await self.metrics.start()
        await self.server.start()
        self._monitor = asyncio.ensure_future(self._watch_heartbeats())
        if self.store is not None:
            self._saver = asyncio.ensure_future(self._save_every(0.1))
        log.info("head started", address=self.address, epoch=self.epoch)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self.jobs is not None:
            await self.jobs.aclose()
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
                self._notify(record.actor_id)
                self._publish("died", record)
        self.save()

    def _notify(self, actor_id: str) -> None:
        """Wake whoever waits for a change of ``actor_id``'s state."""
        event = self._changed.pop(actor_id, None)
        if event is not None:
            event.set()

    async def _wait_while(self, record: ActorRecord, still: Any, limit_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit_s):
                while still(record):
                    await self._changed.setdefault(record.actor_id, asyncio.Event()).wait()

    def _publish(self, kind: str, record: ActorRecord) -> None:
        event = pb.ActorEvent(kind=kind, actor=actor_to_pb(record))
        for queue in list(self._watchers):
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:  # a watcher that does not read is cut off, not waited on
                self._watchers.discard(queue)
                queue.get_nowait()
                queue.put_nowait(None)

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
                self._notify(record.actor_id)
                self._publish("died", record)
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
            self._notify(record.actor_id)
            self._publish("died", record)
        self.save()
        return pb.Ack()

    # -- driver-facing RPCs --------------------------------------------------------------
    async def SpawnMesh(
        self, request: pb.SpawnMeshRequest, context: grpc.aio.ServicerContext
    ) -> pb.MeshInfo:
        mesh_id = f"m-{secrets.token_hex(4)}"
        name = request.name or request.class_path.rpartition(":")[2]
        try:
            check_mesh_size(request.size)  # before a table of ids is made for its members
            if request.per_process < 0:
                raise ConfigError(f"per_process must be >= 1, got {request.per_process}")
            python_path = validate_python_path(request.python_path)
            records = self.state.place(
                mesh_id,
                name,
                request.class_path,
                request.size,
                dict(request.resources.amounts),
                dict(request.labels),
                {r: f"a-{secrets.token_hex(6)}" for r in range(request.size)},
                request.strategy or "SPREAD",
                request.reservation_id,
            )
        except OrchestrError as exc:
            await abort_with(context, exc)
        for record in records:
            record.max_restarts = max(0, request.restart.max_restarts)
            record.init_args = request.init_args
            record.python_path = list(python_path)
        self.meshes[mesh_id] = MeshRecord(
            mesh_id, name, request.class_path, request.size, request.strategy or "SPREAD"
        )
        self._dirty_meshes.add(mesh_id)
        self.save()
        results = await asyncio.gather(
            *(
                self._start_group(g, request.init_args)
                for g in _groups(records, request.per_process)
            ),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self._stop_members(records)
            self.meshes[mesh_id].stopped = True
            self.save()
            first = failures[0]
            if not isinstance(first, OrchestrError):
                first = SpawnError(f"spawning {name} failed: {first!r}")
            await abort_with(context, first)
        self.save()
        log.info("mesh spawned", mesh=mesh_id, name=name, size=len(records))
        return pb.MeshInfo(
            mesh_id=mesh_id,
            name=name,
            class_path=request.class_path,
            members=[actor_to_pb(r) for r in records],
        )

    async def _start_member(
        self, record: ActorRecord, init_args: bytes, state: bytes | None = None
    ) -> None:
        """Start a worker process for ``record`` alone and create the actor in it."""
        await self._start_group([record], init_args, state)

    async def _start_group(
        self, records: list[ActorRecord], init_args: bytes, state: bytes | None = None
    ) -> None:
        """Start one worker process on the node of ``records`` (all on one node) and create
        each of their actors in it, in rank order."""
        first = records[0]
        node = self.state.nodes[first.node_id]
        worker_id = f"w-{first.actor_id[2:]}"
        if first.restarts:
            worker_id += f"-{first.restarts}"
        hosted = self.state.by_worker.setdefault(worker_id, set())
        for record in records:
            record.worker_id = worker_id
            hosted.add(record.actor_id)
        node_ch = self._channel(node.address)
        winfo = await node_ch.rpc(
            node_ch.stub(pb_grpc.NodeStub).StartWorker,
            pb.StartWorkerRequest(worker_id=worker_id, python_path=first.python_path),
            # No deadline here: the node may queue the start behind others (it starts a few
            # processes at a time) and bounds each start itself (worker_start_timeout).
            timeout=None,
        )
        # One channel per worker for its creation, closed at once, so none pile up.
        worker_ch = ControlChannel(winfo.control_address, self.token, self.config)
        try:
            for record in records:
                record.pid = winfo.pid
                record.control_address = winfo.control_address
                limit = self.config.actor_init_timeout
                try:
                    reply = await worker_ch.rpc(
                        worker_ch.stub(pb_grpc.WorkerStub).CreateActor,
                        pb.CreateActorRequest(
                            actor_id=record.actor_id,
                            class_path=record.class_path,
                            init_args=init_args,
                            name=record.name,
                            rank=record.rank,
                            mesh_id=record.mesh_id,
                            state=state or b"",
                            has_state=state is not None,
                        ),
                        timeout=limit,
                    )
                except ControlPlaneError as exc:
                    if record.state == "starting" and "timed out" in str(exc):
                        raise SpawnError(
                            f"{record.label} ({record.class_path}) was not created within "
                            f"{limit:g} s: its __init__ (or load_state) did not return "
                            f"(ORCHESTR_ACTOR_INIT_TIMEOUT); its worker is stopped"
                        ) from exc
                    raise
                if record.state != "starting":  # the worker died during the creation
                    raise SpawnError(
                        f"{record.label} died during creation: "
                        f"{describe_exit(record.pid, record.exit_code, record.signal)}"
                    )
                self.state.actor_started(
                    record.actor_id,
                    worker_id,
                    winfo.call_address,
                    winfo.pid,
                    list(reply.endpoints),
                )
                self._notify(record.actor_id)
        finally:
            await worker_ch.aclose()

    async def _stop_members(self, records: list[ActorRecord]) -> None:
        workers: set[str] = set()

        async def stop(record: ActorRecord) -> None:
            self.state.actor_ended(record.actor_id, stopped=True)
            self._notify(record.actor_id)
            node = self.state.nodes.get(record.node_id)
            if node is None or not node.alive or not record.worker_id:
                return
            if record.worker_id in workers:  # it shares its process with another member
                return
            workers.add(record.worker_id)
            ch = self._channel(node.address)
            with contextlib.suppress(OrchestrError):
                await ch.rpc(
                    ch.stub(pb_grpc.NodeStub).StopWorker,
                    pb.StopWorkerRequest(
                        worker_id=record.worker_id, grace_s=self.config.worker_stop_grace
                    ),
                )

        await asyncio.gather(*(stop(r) for r in records))

    async def StopMesh(
        self, request: pb.StopMeshRequest, context: grpc.aio.ServicerContext
    ) -> pb.Ack:
        await self._stop_members(self.state.mesh_members(request.mesh_id))
        mesh = self.meshes.get(request.mesh_id)
        if mesh is not None:
            mesh.stopped = True
            self._dirty_meshes.add(mesh.mesh_id)
        self.save()
        return pb.Ack()

    async def Reserve(
        self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReservationInfo:
        name = request.name or "reservation"
        try:
            r = self.state.reserve(
                f"r-{secrets.token_hex(6)}",
                name,
                request.bundles,
                dict(request.resources.amounts),
                dict(request.labels),
                request.strategy or "SPREAD",
            )
        except OrchestrError as exc:
            await abort_with(context, exc)
        self.save()
        log.info("reserved", reservation=r.reservation_id, name=name, bundles=len(r.node_ids))
        return pb.ReservationInfo(
            reservation_id=r.reservation_id,
            name=r.name,
            resources=pb.Resources(amounts=r.resources),
            node_ids=r.node_ids,
        )

    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.Ack:
        live = self.state.release(request.reservation_id)
        await self._stop_members(live)
        self.save()
        return pb.Ack()

    # -- the fabric manager -----------------------------------------------------------------
    async def _fabric(self, context: Any) -> FabricManager:
        if self.fabric is None:
            await abort_with(
                context,
                ConfigError(
                    "this cluster's head runs no fabric manager; start the head with "
                    "--fabric PLAN.toml (a cabling plan)"
                ),
            )
        assert self.fabric is not None
        return self.fabric

    async def FabricHint(
        self, request: pb.FabricHintRequest, context: grpc.aio.ServicerContext
    ) -> pb.FabricPlan:
        fabric = await self._fabric(context)
        try:
            reply = await fabric_hint(fabric, self.state, request)
        except OrchestrError as exc:
            await abort_with(context, exc)
        return plan_to_pb(reply)

    async def FabricShow(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> pb.FabricState:
        fabric = await self._fabric(context)
        return fabric_state_to_pb(fabric.show())

    async def FabricHistory(
        self, request: pb.FabricHistoryRequest, context: grpc.aio.ServicerContext
    ) -> pb.FabricPlans:
        fabric = await self._fabric(context)
        records = list(fabric.history)
        if request.limit > 0:
            records = records[-request.limit :]
        return pb.FabricPlans(plans=[plan_to_pb(r) for r in records])

    async def GetActor(
        self, request: pb.GetActorRequest, context: grpc.aio.ServicerContext
    ) -> pb.ActorInfo:
        record = self.state.actors.get(request.actor_id)
        if record is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no actor {request.actor_id!r}")
            raise AssertionError("unreachable")  # abort raises
        if request.wait_for_exit_s > 0:
            # Alive where the caller knew it: the node's report of its exit is on its way.
            await self._wait_while(
                record,
                lambda r: (
                    r.state in ("starting", "alive")
                    and (not request.address or r.call_address in ("", request.address))
                ),
                request.wait_for_exit_s,
            )
        if request.wait_for_restart_s > 0:
            await self._wait_while(
                record, lambda r: r.state in ("restarting", "starting"), request.wait_for_restart_s
            )
        return actor_to_pb(record)

    # -- supervision ---------------------------------------------------------------------
    # -- jobs ------------------------------------------------------------------------------
    async def _job_manager(self, context: Any) -> JobManager:
        if self.jobs is None:
            await abort_with(
                context,
                ConfigError(
                    "this head takes no submitted jobs (it is an embedded cluster's); start a "
                    "head daemon with orchestr start --head"
                ),
            )
        assert self.jobs is not None
        return self.jobs

    async def SubmitJob(
        self, request: pb.SubmitJobRequest, context: grpc.aio.ServicerContext
    ) -> pb.JobInfo:
        jobs = await self._job_manager(context)
        try:
            record = await jobs.submit(request.package, request.entrypoint, list(request.args))
        except OrchestrError as exc:
            await abort_with(context, exc)
        return _job_proto(record)

    async def ListJobs(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.JobList:
        jobs = await self._job_manager(context)
        return pb.JobList(jobs=[_job_proto(r) for r in jobs.jobs.values()])

    async def GetJobLogs(
        self, request: pb.JobLogsRequest, context: grpc.aio.ServicerContext
    ) -> pb.JobLogs:
        jobs = await self._job_manager(context)
        try:
            record = jobs.get(request.job_id)
            data, offset = jobs.read_output(request.job_id, request.offset, request.max_bytes)
        except OrchestrError as exc:
            await abort_with(context, exc)
        return pb.JobLogs(data=data, offset=offset, job=_job_proto(record))

    async def StopJob(
        self, request: pb.JobRequest, context: grpc.aio.ServicerContext
    ) -> pb.JobInfo:
        jobs = await self._job_manager(context)
        try:
            record = await jobs.stop(request.job_id)
        except OrchestrError as exc:
            await abort_with(context, exc)
        return _job_proto(record)

    async def GetDaemonLog(
        self, request: pb.DaemonLogRequest, context: grpc.aio.ServicerContext
    ) -> pb.DaemonLog:
        if request.node_id:  # a node's own host: the node serves its files
            node = self.state.nodes.get(request.node_id)
            if node is None:
                known = ", ".join(self.state.nodes) or "none"
                await abort_with(
                    context, ConfigError(f"no node {request.node_id!r}; the nodes are {known}")
                )
            assert node is not None
            ch = self._channel(node.address)
            try:
                reply: pb.DaemonLog = await ch.rpc(
                    ch.stub(pb_grpc.NodeStub).GetDaemonLog, request, timeout=10
                )
            except OrchestrError as exc:
                await abort_with(context, exc)
            return reply
        if self.log_dir is None:
            await abort_with(context, ConfigError("this head keeps no daemon logs (embedded)"))
        assert self.log_dir is not None
        try:
            names, data, offset = read_daemon_log(
                self.log_dir, request.name, request.offset, request.max_bytes
            )
        except OrchestrError as exc:
            await abort_with(context, exc)
        return pb.DaemonLog(data=data, offset=offset, names=names)

    async def WatchActors(
        self, request: pb.WatchActorsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ActorEvent]:
        queue: asyncio.Queue[pb.ActorEvent | None] = asyncio.Queue(maxsize=10_000)
        self._watchers.add(queue)
        await context.send_initial_metadata(())  # the watcher knows it is heard from now on
        try:
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self._watchers.discard(queue)
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "this watcher fell 10000 events behind and was cut off; watch again and reconcile "
            "with ListActors",
        )

    async def RestartActor(
        self, request: pb.RestartActorRequest, context: grpc.aio.ServicerContext
    ) -> pb.ActorInfo:
        """Re-create a ``restarting`` actor with its constructor arguments, on its old node
        when that still fits, else on another."""
        try:
            record = self.state.restart(request.actor_id)
        except OrchestrError as exc:
            await abort_with(context, exc)
        self._notify(record.actor_id)
        try:
            state = request.state if request.has_state else None
            await self._start_member(record, record.init_args, state)
        except BaseException as exc:
            self.state.restart_failed(record.actor_id)
            self._notify(record.actor_id)
            if isinstance(exc, asyncio.CancelledError):
                raise
            error = exc if isinstance(exc, OrchestrError) else SpawnError(repr(exc))
            log.warning("restart failed", actor=record.label, error=str(error))
            self.save()
            await abort_with(context, error)
        self.save()
        log.info("actor restarted", actor=record.label, restarts=record.restarts)
        return actor_to_pb(record)

    async def AbandonActor(
        self, request: pb.AbandonActorRequest, context: grpc.aio.ServicerContext
    ) -> pb.Ack:
        record = self.state.abandon(request.actor_id)
        if record is not None:
            self._notify(record.actor_id)
            self.save()
        return pb.Ack()

    async def ListNodes(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.NodeList:
        return pb.NodeList(nodes=[node_to_pb(n) for n in self.state.nodes.values()])

    async def ListActors(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> pb.ActorList:
        actors = self.state.actors.values()
        return pb.ActorList(actors=[actor_to_pb(a, self.state.is_suspended(a)) for a in actors])


def _job_proto(record: JobRecord) -> pb.JobInfo:
    return pb.JobInfo(**job_info(record))


def _groups(records: list[ActorRecord], per_process: int) -> list[list[ActorRecord]]:
    """Members that share a worker process: up to ``per_process`` of a node's, in rank order."""
    size = max(1, per_process)
    by_node: dict[str, list[ActorRecord]] = {}
    for record in records:
        by_node.setdefault(record.node_id, []).append(record)
    return [
        members[i : i + size] for members in by_node.values() for i in range(0, len(members), size)
    ]
