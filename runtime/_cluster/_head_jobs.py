"""The head's RPCs for submitted jobs, the daemons' logs and the fabric manager."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc

from orchestr._control._convert import fabric_state_to_pb, plan_to_pb
from orchestr._control._grpc import abort_with
from orchestr._log import read_daemon_log
from orchestr.errors import (
    ConfigError,
    OrchestrError,
)
from orchestr.protos import orchestr_pb2 as pb
from orchestr.protos import orchestr_pb2_grpc as pb_grpc

from ._fabric import fabric_hint
from ._head_base import HeadBase
from ._submitted import JobManager, JobRecord, job_info

if TYPE_CHECKING:
    from orchestr.fabric.optical import FabricManager


__all__ = ["FabricRpcs", "JobRpcs"]


class JobRpcs(HeadBase):
    """Part of :class:`~._head.HeadService`."""

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


def _job_proto(record: JobRecord) -> pb.JobInfo:
    return pb.JobInfo(**job_info(record))


class FabricRpcs(HeadBase):
    """Part of :class:`~._head.HeadService`."""

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
