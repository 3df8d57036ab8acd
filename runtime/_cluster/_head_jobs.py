"""The head's RPCs for submitted jobs, the daemons' logs and the fabric manager, as functions
of what each reads; :class:`~._head.HeadService` serves them, passing its own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from orchestr._control._convert import fabric_state_to_pb, plan_to_pb
from orchestr._control._grpc import ControlChannel, abort_with
from orchestr._log import read_daemon_log
from orchestr.errors import (
    ConfigError,
    OrchestrError,
)
from orchestr.protos import orchestr_pb2 as pb
from orchestr.protos import orchestr_pb2_grpc as pb_grpc

from ._fabric import fabric_hint
from ._headstate import HeadState
from ._submitted import JobManager, JobRecord, job_info

if TYPE_CHECKING:
    from orchestr.fabric.optical import FabricManager

    from ._dashboard import AttachedLogs


__all__ = [
    "daemon_log",
    "fabric_history",
    "fabric_show",
    "hint_fabric",
    "job_events",
    "job_logs",
    "list_jobs",
    "stop_job",
    "submit_job",
]


# -- jobs ----------------------------------------------------------------------------------
async def _job_manager(jobs: JobManager | None, context: Any) -> JobManager:
    if jobs is None:
        await abort_with(
            context,
            ConfigError(
                "this head takes no submitted jobs (it is an embedded cluster's); start a "
                "head daemon with orchestr start --head"
            ),
        )
    assert jobs is not None
    return jobs


async def submit_job(
    jobs: JobManager | None, request: pb.SubmitJobRequest, context: grpc.aio.ServicerContext
) -> pb.JobInfo:
    manager = await _job_manager(jobs, context)
    try:
        record = await manager.submit(request.package, request.entrypoint, list(request.args))
    except OrchestrError as exc:
        await abort_with(context, exc)
    return _job_proto(record)


async def list_jobs(jobs: JobManager | None, context: grpc.aio.ServicerContext) -> pb.JobList:
    manager = await _job_manager(jobs, context)
    return pb.JobList(jobs=[_job_proto(r) for r in manager.jobs.values()])


async def job_logs(
    jobs: JobManager | None, request: pb.JobLogsRequest, context: grpc.aio.ServicerContext
) -> pb.JobLogs:
    manager = await _job_manager(jobs, context)
    try:
        record = manager.get(request.job_id)
        data, offset = manager.read_output(request.job_id, request.offset, request.max_bytes)
    except OrchestrError as exc:
        await abort_with(context, exc)
    return pb.JobLogs(data=data, offset=offset, job=_job_proto(record))


async def job_events(
    attached: AttachedLogs, request: pb.JobEventsRequest, context: grpc.aio.ServicerContext
) -> pb.JobEventsReply:
    """Keep a controller's new event-log lines for the dashboard."""
    if attached.dashboard.address is None:
        await abort_with(context, ConfigError("this head serves no dashboard to show events on"))
    try:
        offset = await attached.take(
            request.job_id, request.title, request.state, request.offset, request.data
        )
    except OrchestrError as exc:
        await abort_with(context, exc)
    return pb.JobEventsReply(offset=offset)


async def stop_job(
    jobs: JobManager | None, request: pb.JobRequest, context: grpc.aio.ServicerContext
) -> pb.JobInfo:
    manager = await _job_manager(jobs, context)
    try:
        record = await manager.stop(request.job_id)
    except OrchestrError as exc:
        await abort_with(context, exc)
    return _job_proto(record)


async def daemon_log(
    state: HeadState,
    channel: Callable[[str], ControlChannel],
    log_dir: Path | None,
    request: pb.DaemonLogRequest,
    context: grpc.aio.ServicerContext,
) -> pb.DaemonLog:
    """A daemon's log: a node's, which its node serves, through ``channel`` to it; else one of
    the head's host, from ``log_dir``."""
    if request.node_id:  # a node's own host: the node serves its files
        node = state.nodes.get(request.node_id)
        if node is None:
            known = ", ".join(state.nodes) or "none"
            await abort_with(
                context, ConfigError(f"no node {request.node_id!r}; the nodes are {known}")
            )
        assert node is not None
        ch = channel(node.address)
        try:
            reply: pb.DaemonLog = await ch.rpc(
                ch.stub(pb_grpc.NodeStub).GetDaemonLog, request, timeout=10
            )
        except OrchestrError as exc:
            await abort_with(context, exc)
        return reply
    if log_dir is None:
        await abort_with(context, ConfigError("this head keeps no daemon logs (embedded)"))
    assert log_dir is not None
    try:
        names, data, offset = read_daemon_log(
            log_dir, request.name, request.offset, request.max_bytes
        )
    except OrchestrError as exc:
        await abort_with(context, exc)
    return pb.DaemonLog(data=data, offset=offset, names=names)


def _job_proto(record: JobRecord) -> pb.JobInfo:
    return pb.JobInfo(**job_info(record))


# -- the fabric manager ----------------------------------------------------------------------
async def _fabric(fabric: FabricManager | None, context: Any) -> FabricManager:
    if fabric is None:
        await abort_with(
            context,
            ConfigError(
                "this cluster's head runs no fabric manager; start the head with "
                "--fabric PLAN.toml (a cabling plan)"
            ),
        )
    assert fabric is not None
    return fabric


async def hint_fabric(
    fabric: FabricManager | None,
    state: HeadState,
    request: pb.FabricHintRequest,
    context: grpc.aio.ServicerContext,
) -> pb.FabricPlan:
    manager = await _fabric(fabric, context)
    try:
        reply = await fabric_hint(manager, state, request)
    except OrchestrError as exc:
        await abort_with(context, exc)
    return plan_to_pb(reply)


async def fabric_show(
    fabric: FabricManager | None, context: grpc.aio.ServicerContext
) -> pb.FabricState:
    manager = await _fabric(fabric, context)
    return fabric_state_to_pb(manager.show())


async def fabric_history(
    fabric: FabricManager | None,
    request: pb.FabricHistoryRequest,
    context: grpc.aio.ServicerContext,
) -> pb.FabricPlans:
    manager = await _fabric(fabric, context)
    records = list(manager.history)
    if request.limit > 0:
        records = records[-request.limit :]
    return pb.FabricPlans(plans=[plan_to_pb(r) for r in records])
