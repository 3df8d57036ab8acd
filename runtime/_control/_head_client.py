"""The head's client: typed calls over a :class:`~._grpc.ControlChannel`, dataclasses out.

What the job controller, its supervisor, a worker's call client and the CLI ask of the head.
No caller outside ``_control/`` builds or reads a protobuf message. Every method raises the
orchestr error the head answered with (:class:`~orchestr.errors.ConfigError`,
:class:`~orchestr.errors.PlacementError`, :class:`~orchestr.errors.ControlPlaneError` when the
head cannot be reached, ...); cancelling one cancels its RPC, and nothing is left half done on
this side.
"""

from __future__ import annotations

import os
import signal as _signal
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc

from orchestr._call._lookup import ActorLookup, ActorView
from orchestr.config import Config
from orchestr.errors import ActorDiedError, ControlPlaneError
from orchestr.protos import orchestr_pb2 as pb
from orchestr.protos import orchestr_pb2_grpc as pb_grpc

from ._convert import (
    ActorInfo,
    JobInfo,
    MeshInfo,
    NodeInfo,
    ReservationInfo,
    actor_from_pb,
    fabric_state_from_pb,
    job_from_pb,
    mesh_from_pb,
    node_from_pb,
    plan_from_pb,
    reservation_from_pb,
    restart_policy_to_pb,
)
from ._grpc import ControlChannel

__all__ = [
    "ActorWatch",
    "HeadClient",
    "HostRegistration",
    "actor_lookup",
    "death_error",
    "describe_exit",
]


def describe_exit(pid: int, exit_code: int, sig: int) -> str:
    if sig:
        try:
            name = _signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"worker process {pid} was killed by {name}"
    return f"worker process {pid} exited with code {exit_code}"


def death_error(info: ActorInfo) -> ActorDiedError:
    """The :class:`ActorDiedError` an ended actor's record describes, with the worker's last
    output (a fatal-error dump, a traceback) when it left one."""
    label = f"{info.name}[{info.rank}]"
    if info.state == "stopped":
        return ActorDiedError(f"actor {label} was stopped", actor=label)
    sig = _signal.Signals(info.signal).name if info.signal in _signal.valid_signals() else None
    how = describe_exit(info.pid, info.exit_code, info.signal)
    if info.state not in ("dead", "restarting"):  # alive again: the pid is the new worker's
        how = how.replace(f"worker process {info.pid}", "its worker")
    text = f"actor {label} died: {how}"
    if info.last_output:
        text += f"\n--- the worker's last output ---\n{info.last_output}"
    return ActorDiedError(
        text, actor=label, exit_code=None if info.signal else info.exit_code, signal=sig
    )


class ActorWatch:
    """The head's stream of actor events (``kind``, the actor), as :meth:`HeadClient.watch`
    opens it. :meth:`connected` waits for the head to take it; iterating yields events until
    the stream ends or breaks (an :class:`~orchestr.errors.OrchestrError`); :meth:`cancel`
    ends it from this side."""

    def __init__(self, head: ControlChannel, call: Any) -> None:
        self._head = head
        self._call = call

    async def connected(self) -> None:
        """Blocks until the head accepted the stream; raises the head's error if it did not."""
        try:
            await self._call.wait_for_connection()
        except grpc.aio.AioRpcError as exc:
            raise self._head.translate(exc, "WatchActors") from exc

    async def __aiter__(self) -> AsyncIterator[tuple[str, ActorInfo]]:
        try:
            async for event in self._call:
                yield event.kind, actor_from_pb(event.actor)
        except grpc.aio.AioRpcError as exc:
            raise self._head.translate(exc, "WatchActors") from exc

    def cancel(self) -> None:
        self._call.cancel()


class HostRegistration:
    """The stream that keeps an actor hosted by this program registered with the head, as
    :meth:`HeadClient.host_actor` opens it: :meth:`mesh` waits for the head's record of it,
    :meth:`held` for the stream to end (it raises the head's error, or
    :class:`~orchestr.errors.ControlPlaneError` when the head went away); :meth:`cancel`
    ends it from this side."""

    def __init__(self, head: ControlChannel, call: Any) -> None:
        self._head = head
        self._call = call
        self._replies = aiter(call)

    async def mesh(self) -> MeshInfo:
        """Blocks until the head recorded the actor; raises what it answered instead."""
        try:
            reply = await anext(self._replies)
        except StopAsyncIteration:
            raise ControlPlaneError(
                "the head ended the HostActor stream without an answer"
            ) from None
        except grpc.aio.AioRpcError as exc:
            raise self._head.translate(exc, "HostActor") from exc
        return mesh_from_pb(reply)

    async def held(self) -> None:
        """Blocks while the stream lasts; raises the error that ended it."""
        try:
            async for _ in self._replies:
                pass
        except grpc.aio.AioRpcError as exc:
            raise self._head.translate(exc, "HostActor") from exc
        raise ControlPlaneError("the head ended the HostActor stream")

    def cancel(self) -> None:
        self._call.cancel()


class HeadClient:
    """Typed calls to the head over ``channel`` (which the caller owns and closes)."""

    def __init__(self, channel: ControlChannel) -> None:
        self.channel = channel
        self._stub = channel.stub(pb_grpc.HeadStub)

    # -- the cluster -----------------------------------------------------------------------
    async def nodes(self) -> list[NodeInfo]:
        reply = await self.channel.rpc(self._stub.ListNodes, pb.Empty())
        return [node_from_pb(n) for n in reply.nodes]

    async def actors(self) -> list[ActorInfo]:
        reply = await self.channel.rpc(self._stub.ListActors, pb.Empty())
        return [actor_from_pb(a) for a in reply.actors]

    async def actor(
        self,
        actor_id: str,
        *,
        wait_for_exit_s: float = 0,
        wait_for_restart_s: float = 0,
        address: str = "",
    ) -> ActorInfo:
        """One actor's record; when it is alive and ``wait_for_exit_s`` > 0, after waiting
        that long for the node's report that it ended (its connection at ``address`` broke),
        then up to ``wait_for_restart_s`` for its new incarnation when it is being restarted."""
        request = pb.GetActorRequest(
            actor_id=actor_id,
            wait_for_exit_s=wait_for_exit_s,
            wait_for_restart_s=wait_for_restart_s,
            address=address,
        )
        timeout = wait_for_exit_s + wait_for_restart_s + 5
        return actor_from_pb(await self.channel.rpc(self._stub.GetActor, request, timeout=timeout))

    # -- meshes and reservations ---------------------------------------------------------
    async def spawn_mesh(
        self,
        class_path: str,
        init_args: bytes,
        size: int,
        *,
        resources: Mapping[str, float],
        labels: Mapping[str, str],
        name: str,
        restart: Any,
        per_process: int,
        python_path: Sequence[str],
        strategy: str,
        reservation_id: str,
    ) -> MeshInfo:
        """Place and start ``size`` members; blocks until all are alive or none is left.
        ``restart`` is the mesh's :class:`~orchestr.RestartPolicy`."""
        request = pb.SpawnMeshRequest(
            class_path=class_path,
            init_args=init_args,
            size=size,
            resources=pb.Resources(amounts=dict(resources)),
            labels=dict(labels),
            name=name,
            restart=restart_policy_to_pb(restart),
            per_process=per_process,
            python_path=list(python_path),
            strategy=strategy,
            reservation_id=reservation_id,
        )
        return mesh_from_pb(await self.channel.rpc(self._stub.SpawnMesh, request, timeout=None))

    def host_actor(
        self,
        name: str,
        class_path: str,
        call_address: str,
        endpoints: Sequence[str],
        *,
        mesh_id: str = "",
        actor_id: str = "",
    ) -> HostRegistration:
        """Register an actor this program hosts at ``call_address`` (again, after a head
        restart, with the ``mesh_id`` and ``actor_id`` it was given); it stays registered
        while the returned stream is open."""
        request = pb.HostActorRequest(
            name=name,
            class_path=class_path,
            call_address=call_address,
            endpoints=list(endpoints),
            pid=os.getpid(),
            mesh_id=mesh_id,
            actor_id=actor_id,
        )
        call = self._stub.HostActor(request, metadata=self.channel.metadata)
        return HostRegistration(self.channel, call)

    async def stop_mesh(self, mesh_id: str) -> None:
        await self.channel.rpc(self._stub.StopMesh, pb.StopMeshRequest(mesh_id=mesh_id))

    async def reserve(
        self,
        bundles: int,
        *,
        resources: Mapping[str, float],
        labels: Mapping[str, str],
        strategy: str,
        name: str,
    ) -> ReservationInfo:
        request = pb.ReserveRequest(
            bundles=bundles,
            resources=pb.Resources(amounts=dict(resources)),
            labels=dict(labels),
            strategy=strategy,
            name=name,
        )
        return reservation_from_pb(await self.channel.rpc(self._stub.Reserve, request))

    async def release(self, reservation_id: str) -> None:
        request = pb.ReleaseRequest(reservation_id=reservation_id)
        await self.channel.rpc(self._stub.Release, request)

    # -- supervision ---------------------------------------------------------------------
    def watch(self) -> ActorWatch:
        """Open the head's stream of actor events (see :class:`ActorWatch`)."""
        call = self._stub.WatchActors(pb.WatchActorsRequest(), metadata=self.channel.metadata)
        return ActorWatch(self.channel, call)

    async def restart_actor(self, actor_id: str, state: bytes | None) -> ActorInfo:
        """Re-create a ``restarting`` actor, handing ``state`` (when not None) to its
        ``load_state``; blocks until it is alive."""
        request = pb.RestartActorRequest(
            actor_id=actor_id, state=state or b"", has_state=state is not None
        )
        reply = await self.channel.rpc(self._stub.RestartActor, request, timeout=None)
        return actor_from_pb(reply)

    async def abandon_actor(self, actor_id: str) -> None:
        request = pb.AbandonActorRequest(actor_id=actor_id)
        await self.channel.rpc(self._stub.AbandonActor, request)

    # -- the fabric manager --------------------------------------------------------------
    async def fabric_show(self) -> dict[str, Any]:
        """The fabric now; raises ConfigError when the head runs no fabric manager."""
        return fabric_state_from_pb(await self.channel.rpc(self._stub.FabricShow, pb.Empty()))

    async def fabric_history(self, limit: int = 0) -> list[dict[str, Any]]:
        request = pb.FabricHistoryRequest(limit=limit)
        reply = await self.channel.rpc(self._stub.FabricHistory, request)
        return [plan_from_pb(p) for p in reply.plans]

    async def fabric_hint(
        self,
        phase: str,
        *,
        job_id: str = "",
        traffic: Sequence[tuple[str, str, float]] = (),
        collective: tuple[str, str, float] | None = None,
        demand: Sequence[tuple[str, str, float]] = (),
        expected_s: float = 0.0,
        lead_s: float = 0.0,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Tell the fabric manager a phase's traffic: between meshes (``traffic``: source
        mesh id, destination mesh id, bytes), a ``collective`` (kind, mesh id, bytes per
        member), or between switches (``demand``). Blocks until the plan is applied (or
        judged not worth it); a ``dry_run`` only plans. Returns the plan record as data."""
        request = pb.FabricHintRequest(
            job_id=job_id,
            phase=phase,
            traffic=[pb.MeshTraffic(src_mesh_id=s, dst_mesh_id=d, nbytes=n) for s, d, n in traffic],
            demand=[pb.SwitchTraffic(src=s, dst=d, nbytes=n) for s, d, n in demand],
            expected_s=expected_s,
            lead_s=lead_s,
            dry_run=dry_run,
        )
        if collective is not None:
            request.collective, request.collective_mesh_id, request.collective_bytes = collective
        reply = await self.channel.rpc(self._stub.FabricHint, request, timeout=None)
        return plan_from_pb(reply)

    # -- submitted jobs and daemon logs --------------------------------------------------
    async def submit_job(self, package: bytes, entrypoint: str, args: Sequence[str]) -> JobInfo:
        request = pb.SubmitJobRequest(package=package, entrypoint=entrypoint, args=list(args))
        return job_from_pb(await self.channel.rpc(self._stub.SubmitJob, request))

    async def jobs(self) -> list[JobInfo]:
        """Every submitted job; raises ConfigError on a head that takes none (embedded)."""
        reply = await self.channel.rpc(self._stub.ListJobs, pb.Empty())
        return [job_from_pb(j) for j in reply.jobs]

    async def job_logs(self, job_id: str, offset: int) -> tuple[bytes, int, JobInfo]:
        """The job's output from byte ``offset``: the bytes, where the next read starts, and
        the job as of this read."""
        request = pb.JobLogsRequest(job_id=job_id, offset=offset)
        got = await self.channel.rpc(self._stub.GetJobLogs, request)
        return got.data, got.offset, job_from_pb(got.job)

    async def job_events(
        self, job_id: str, title: str, state: str, offset: int, data: bytes
    ) -> int:
        """Send the head ``data``, whole lines of job ``job_id``'s event log from byte
        ``offset``, and its ``state``; returns where the next send starts. Raises
        :class:`~orchestr.errors.ConfigError` when the head shows no events (no dashboard)
        or refuses the request."""
        request = pb.JobEventsRequest(
            job_id=job_id, title=title, state=state, offset=offset, data=data
        )
        reply = await self.channel.rpc(self._stub.JobEvents, request)
        return int(reply.offset)

    async def stop_job(self, job_id: str) -> JobInfo:
        request = pb.JobRequest(job_id=job_id)
        return job_from_pb(await self.channel.rpc(self._stub.StopJob, request, timeout=60))

    async def daemon_log(
        self, name: str = "", offset: int = 0, node_id: str = ""
    ) -> tuple[bytes, int, list[str]]:
        """A daemon's log file from ``offset`` (the head's own host, or ``node_id``'s): the
        bytes, where the next read starts; with no ``name``, the names there are."""
        request = pb.DaemonLogRequest(name=name, offset=offset, node_id=node_id)
        got = await self.channel.rpc(self._stub.GetDaemonLog, request)
        return got.data, got.offset, list(got.names)


def actor_lookup(head: ControlChannel, config: Config) -> ActorLookup:
    """How a process's call client asks the head what became of an actor."""
    client = HeadClient(head)

    async def lookup(actor_id: str, address: str, restart_wait: float) -> ActorView:
        info = await client.actor(
            actor_id,
            wait_for_exit_s=config.death_report_wait,
            wait_for_restart_s=restart_wait,
            address=address,
        )
        ended = info.state in ("dead", "stopped", "restarting") or info.restarts > 0
        return ActorView(info.state, info.call_address, death_error(info) if ended else None)

    return lookup
