"""The head's RPCs for meshes and their members: spawning (placement, then one worker per group of
members), stopping, reservations, actor lookups and the owner's supervision calls. A part the
head service owns and serves them through."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncGenerator, Callable

import grpc
import structlog

from orchestr._control._convert import actor_to_pb
from orchestr._control._grpc import ControlChannel, abort_with
from orchestr._control._head_client import describe_exit
from orchestr.config import Config
from orchestr.errors import (
    ConfigError,
    ControlPlaneError,
    OrchestrError,
    SpawnError,
)
from orchestr.protos import orchestr_pb2 as pb
from orchestr.protos import orchestr_pb2_grpc as pb_grpc

from ._head_changes import ActorChanges
from ._headstate import HeadState
from ._headstore import MeshRecord
from ._records import ActorRecord, check_hosted, check_mesh_size, validate_python_path

__all__ = ["MeshRpcs"]

log = structlog.get_logger("orchestr.head")


class MeshRpcs:
    """The mesh RPCs of :class:`~._head.HeadService`, which owns the records they change and
    gives them these: its state, its mesh records and the ones changed since it last saved,
    the open registration stream of each actor a program of its own hosts, who waits on the
    actors, its settings, its control channel to a node and its ``save``."""

    def __init__(
        self,
        state: HeadState,
        meshes: dict[str, MeshRecord],
        dirty_meshes: set[str],
        host_streams: dict[str, object],
        changes: ActorChanges,
        *,
        token: str,
        config: Config,
        channel: Callable[[str], ControlChannel],
        save: Callable[[], None],
    ) -> None:
        self.state = state
        self.meshes = meshes
        self._dirty_meshes = dirty_meshes
        self._host_streams = host_streams
        self._changes = changes
        self.token = token
        self.config = config
        self._channel = channel
        self._save = save

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
        self._save()
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
            self._save()
            first = failures[0]
            if not isinstance(first, OrchestrError):
                first = SpawnError(f"spawning {name} failed: {first!r}")
            await abort_with(context, first)
        self._save()
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
                self._changes.notify(record.actor_id)
        finally:
            await worker_ch.aclose()

    async def _stop_members(self, records: list[ActorRecord]) -> None:
        workers: set[str] = set()

        async def stop(record: ActorRecord) -> None:
            self.state.actor_ended(record.actor_id, stopped=True)
            self._changes.notify(record.actor_id)
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
        self._save()
        return pb.Ack()

    async def HostActor(
        self, request: pb.HostActorRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.MeshInfo, None]:
        """Record an actor a program of its own hosts, answer with its mesh, and hold the
        stream: when it ends (the program exited or was killed, or lost its connection) with
        the actor not stopped, the actor is dead."""
        mesh_id = request.mesh_id or f"m-{secrets.token_hex(4)}"
        actor_id = request.actor_id or f"a-{secrets.token_hex(6)}"
        endpoints = list(request.endpoints)
        try:
            check_hosted(request.name, request.class_path, request.call_address, endpoints)
            if bool(request.mesh_id) != bool(request.actor_id):
                raise ConfigError("registering again takes both mesh_id and actor_id")
            record = self.state.host(
                mesh_id,
                actor_id,
                request.name,
                request.class_path,
                request.call_address,
                endpoints,
                max(0, request.pid),
            )
        except OrchestrError as exc:
            await abort_with(context, exc)
        if mesh_id not in self.meshes:
            self.meshes[mesh_id] = MeshRecord(
                mesh_id, request.name, request.class_path, 1, "HOSTED"
            )
            self._dirty_meshes.add(mesh_id)
        stream = self._host_streams[actor_id] = object()  # this registration's, not a later one's
        self._changes.notify(actor_id)
        self._save()
        log.info("actor hosted", actor=record.label, actor_id=actor_id, pid=request.pid)
        try:
            yield pb.MeshInfo(
                mesh_id=mesh_id,
                name=record.name,
                class_path=record.class_path,
                members=[actor_to_pb(record)],
            )
            await asyncio.Event().wait()  # until the program ends the stream
        finally:
            reason = f"the program hosting it (pid {record.pid}) went away without stopping it"
            if self._host_streams.get(actor_id) is stream:
                del self._host_streams[actor_id]
            if self._host_streams.get(actor_id) is None and self.state.host_lost(actor_id, reason):
                log.warning("hosted actor lost", actor=record.label, actor_id=actor_id)
                self._changes.notify(actor_id)
                self._save()

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
        self._save()
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
        self._save()
        return pb.Ack()

    async def GetActor(
        self, request: pb.GetActorRequest, context: grpc.aio.ServicerContext
    ) -> pb.ActorInfo:
        record = self.state.actors.get(request.actor_id)
        if record is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no actor {request.actor_id!r}")
            raise AssertionError("unreachable")  # abort raises
        if request.wait_for_exit_s > 0:
            # Alive where the caller knew it: the node's report of its exit is on its way.
            await self._changes.wait_while(
                record,
                lambda r: (
                    r.state in ("starting", "alive")
                    and (not request.address or r.call_address in ("", request.address))
                ),
                request.wait_for_exit_s,
            )
        if request.wait_for_restart_s > 0:
            await self._changes.wait_while(
                record, lambda r: r.state in ("restarting", "starting"), request.wait_for_restart_s
            )
        return actor_to_pb(record)

    async def WatchActors(
        self, request: pb.WatchActorsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.ActorEvent, None]:
        queue: asyncio.Queue[pb.ActorEvent | None] = asyncio.Queue(maxsize=10_000)
        self._changes.watchers.add(queue)
        await context.send_initial_metadata(())  # the watcher knows it is heard from now on
        try:
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self._changes.watchers.discard(queue)
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
        self._changes.notify(record.actor_id)
        try:
            state = request.state if request.has_state else None
            await self._start_member(record, record.init_args, state)
        except BaseException as exc:
            self.state.restart_failed(record.actor_id)
            self._changes.notify(record.actor_id)
            if isinstance(exc, asyncio.CancelledError):
                raise
            error = exc if isinstance(exc, OrchestrError) else SpawnError(repr(exc))
            log.warning("restart failed", actor=record.label, error=str(error))
            self._save()
            await abort_with(context, error)
        self._save()
        log.info("actor restarted", actor=record.label, restarts=record.restarts)
        return actor_to_pb(record)

    async def AbandonActor(
        self, request: pb.AbandonActorRequest, context: grpc.aio.ServicerContext
    ) -> pb.Ack:
        record = self.state.abandon(request.actor_id)
        if record is not None:
            self._changes.notify(record.actor_id)
            self._save()
        return pb.Ack()


def _groups(records: list[ActorRecord], per_process: int) -> list[list[ActorRecord]]:
    """Members that share a worker process: up to ``per_process`` of a node's, in rank order."""
    size = max(1, per_process)
    by_node: dict[str, list[ActorRecord]] = {}
    for record in records:
        by_node.setdefault(record.node_id, []).append(record)
    return [
        members[i : i + size] for members in by_node.values() for i in range(0, len(members), size)
    ]
