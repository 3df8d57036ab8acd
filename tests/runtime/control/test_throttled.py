"""A flood of refusals is counted, and logged at most once a period with how many were left out:
tried with a flood of unsigned control-plane requests against a real head."""

from __future__ import annotations

import structlog

import orchestr as oc
from orchestr._control._grpc import ControlChannel
from orchestr._log import Throttled
from orchestr.protos import orchestr_pb2 as pb
from orchestr.protos import orchestr_pb2_grpc as pb_grpc


def test_a_flood_is_one_line_a_period() -> None:
    logger = structlog.get_logger("test")
    with structlog.testing.capture_logs() as logs:
        warn = Throttled(logger, "refused", period=3600)
        for i in range(100):
            warn(i=i)
        warn.period = 0.0
        warn(i=100)
    assert [(e["i"], e["not_logged_since"]) for e in logs] == [(0, 0), (100, 99)]
    assert warn.count == 101


async def test_unsigned_requests_do_not_flood_the_heads_log(ctx: oc.JobContext) -> None:
    channel = ControlChannel(ctx.head.address, "wrong", ctx.config)
    try:
        with structlog.testing.capture_logs() as logs:
            for _ in range(50):
                try:
                    await channel.rpc(channel.stub(pb_grpc.HeadStub).ListNodes, pb.Empty())
                except oc.AuthenticationError:
                    pass
    finally:
        await channel.aclose()
    refused = [e for e in logs if e["event"] == "refused a control-plane request"]
    assert 1 <= len(refused) < 50
