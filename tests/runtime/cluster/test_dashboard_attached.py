"""Jobs whose controllers run elsewhere on the head's dashboard: the controller sends its event
log as it grows (``JobEvents``), the head keeps it for the jobs page; bad requests are refused
and every bound holds."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from pathlib import Path

import pytest

import orchestr as oc
from orchestr._cluster._dashboard import AttachedLogs, DashboardServer
from orchestr._cluster._dashboard._attached import MAX_JOBS, MAX_REQUEST_BYTES
from orchestr._cluster._head import HeadService
from orchestr._cluster._node import NodeService
from orchestr._job._session import job_session
from tests.runtime.actors import Counter
from tests.runtime.cluster.test_dashboard import TOKEN, call


def _line(**event: object) -> bytes:
    return (json.dumps(event) + "\n").encode()


def _logs(max_bytes: int = 1 << 20) -> tuple[AttachedLogs, DashboardServer]:
    dashboard = DashboardServer(None, oc.load_config())
    return AttachedLogs(dashboard, max_bytes), dashboard


async def test_a_log_is_kept_once_in_order_and_bounded() -> None:
    logs, dashboard = _logs(max_bytes=200)
    try:
        a = _line(ts=1.0, kind="phase", name="generation", dur=1.0)
        b = _line(ts=2.0, kind="phase", name="train", dur=1.0)
        assert await logs.take("job-0123abcd", "train.py --x", "running", 0, a) == len(a)
        # sent again (its reply lost): taken once; a gap: the head says where it stands
        assert await logs.take("job-0123abcd", "", "running", 0, a + b) == len(a + b)
        assert await logs.take("job-0123abcd", "", "running", len(a + b) + 9, b) == len(a + b)
        watched = dashboard.watched["job-0123abcd"]
        assert watched.title == "train.py --x"
        path = Path(watched.session_dir) / "events.jsonl"
        assert path.read_bytes() == a + b
        assert os.stat(watched.session_dir).st_mode & 0o777 == 0o700
        # past the bound the head keeps no more, and the controller goes on past it
        big = _line(ts=3.0, kind="note", text="x" * 150)
        assert await logs.take("job-0123abcd", "", "succeeded", len(a + b), big) == len(a + b + big)
        assert path.read_bytes() == a + b and watched.state == "succeeded"
    finally:
        logs.close()
    assert "job-0123abcd" not in dashboard.watched and not path.exists()


@pytest.mark.parametrize(
    ("job_id", "state", "offset", "data", "error"),
    [
        ("../../etc", "running", 0, b"", "a job id is job- and 8 hex digits"),
        ("job-0123abcd/x", "running", 0, b"", "a job id is job- and 8 hex digits"),
        ("job-0123abcd", "done", 0, b"", "a job's state is one of running"),
        ("job-0123abcd", "running", -1, b"", "an offset is 0 or more"),
        ("job-0123abcd", "running", 0, b'{"ts": 1', "in whole lines"),
        ("job-0123abcd", "running", 0, b"x" * MAX_REQUEST_BYTES + b"\n", "bytes a request"),
    ],
)
async def test_bad_requests_are_refused_and_change_nothing(
    job_id: str, state: str, offset: int, data: bytes, error: str
) -> None:
    logs, dashboard = _logs()
    try:
        with pytest.raises(oc.ConfigError, match=error):
            await logs.take(job_id, "t", state, offset, data)
        assert not dashboard.watched
    finally:
        logs.close()


async def test_the_jobs_kept_are_bounded() -> None:
    logs, dashboard = _logs()
    try:
        for i in range(MAX_JOBS):
            await logs.take(f"job-{i:08x}", "t", "running", 0, b"")
        with pytest.raises(oc.ConfigError, match=f"event logs of {MAX_JOBS} running jobs"):
            await logs.take("job-ffffffff", "t", "running", 0, b"")
        await logs.take("job-00000003", "t", "failed", 0, b"")  # one ends: it makes room
        await logs.take("job-ffffffff", "t", "running", 0, b"")
        assert "job-00000003" not in dashboard.watched and len(dashboard.watched) == MAX_JOBS
    finally:
        logs.close()


async def test_a_controller_elsewhere_shows_its_job_on_the_heads_dashboard() -> None:
    config = dataclasses.replace(oc.load_config(), dashboard_port=0, metrics_token=TOKEN)
    async with HeadService("token", config) as head, NodeService(head.address, "token", config):
        async with job_session(head.address, "token", config) as ctx:
            async with ctx.phase("warm_up"):
                await (await ctx.spawn(Counter, n=1)).add.call(1)
            job_id = ctx.job_id
        watched = head.dashboard.watched[job_id]
        assert watched.state == "succeeded" and watched.session_dir != ctx.session_dir
        address = head.dashboard_address
        assert address is not None
        page = await call(address, "GET", f"/jobs/{job_id}", {"Authorization": f"Bearer {TOKEN}"})
        assert page.status == 200 and "warm_up" in page.body
        # a job that fails says so
        with pytest.raises(RuntimeError, match="on purpose"):
            async with job_session(head.address, "token", config) as ctx:
                raise RuntimeError("on purpose")
        assert head.dashboard.watched[ctx.job_id].state == "failed"
    assert not await asyncio.to_thread(os.path.exists, watched.session_dir)  # gone with it


async def test_a_head_without_a_dashboard_is_asked_once() -> None:
    config = oc.load_config()  # the dashboard off
    async with HeadService("token", config) as head, NodeService(head.address, "token", config):
        async with job_session(head.address, "token", config) as ctx:
            await (await ctx.spawn(Counter, n=1)).add.call(1)
        assert not head.dashboard.watched and head.attached._root is None
