"""Submitted jobs on the head's host: packages checked before anything is unpacked, and a
restarted head adopting the jobs still running."""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import stat
import zipfile

import pytest

from orchestr._cluster._submitted import check_package
from orchestr.errors import ConfigError


def _zip(members: dict[str, bytes], link: str | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        if link is not None:
            info = zipfile.ZipInfo(link)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            z.writestr(info, "/etc/passwd")
    return buf.getvalue()


def test_packages_are_checked_before_anything_is_unpacked() -> None:
    assert check_package(_zip({"job.py": b"", "pkg/mod.py": b""}), "job.py")
    with pytest.raises(ConfigError, match="points outside the job"):
        check_package(_zip({"job.py": b"", "../evil.py": b""}), "job.py")
    with pytest.raises(ConfigError, match="points outside the job"):
        check_package(_zip({"job.py": b"", "/abs.py": b""}), "job.py")
    with pytest.raises(ConfigError, match="is a link"):
        check_package(_zip({"job.py": b""}, link="sneaky"), "job.py")
    with pytest.raises(ConfigError, match="not a zip file"):
        check_package(b"not a zip", "job.py")
    with pytest.raises(ConfigError, match="not a .py file of the package"):
        check_package(_zip({"job.py": b""}), "other.py")
    with pytest.raises(ConfigError, match="not a .py file of the package"):
        check_package(_zip({"job.py": b""}), "../job.py")


async def test_a_restarted_head_adopts_running_jobs_and_closes_ended_ones(
    tmp_path: pathlib.Path,
) -> None:
    import asyncio

    from orchestr._cluster._headstore import HeadStore
    from orchestr._cluster._submitted import JobManager, JobRecord, process_start

    store = HeadStore(tmp_path / "head.sqlite")
    live = await asyncio.create_subprocess_exec("sleep", "30")
    ended_ok = await asyncio.create_subprocess_exec("true")
    await ended_ok.wait()
    try:
        records = {
            "job-live": JobRecord("job-live", "a.py", [], pid=live.pid),
            "job-done": JobRecord("job-done", "b.py", [], pid=ended_ok.pid, pid_start=1),
            "job-lost": JobRecord("job-lost", "c.py", [], pid=os.getpid(), pid_start=1),
        }
        records["job-live"].pid_start = process_start(live.pid)
        for job_id, record in records.items():
            (tmp_path / "jobs" / job_id).mkdir(parents=True)
            store.save_job(job_id, dataclasses.asdict(record))
        (tmp_path / "jobs" / "job-done" / "exit_code").write_text("0\n")

        jobs = JobManager(tmp_path, "127.0.0.1:1", "token", store)
        assert jobs.get("job-live").state == "running"  # adopted: same pid, same start
        assert (jobs.get("job-done").state, jobs.get("job-done").exit_code) == ("succeeded", 0)
        lost = jobs.get("job-lost")  # our pid, another start time: not the job's process
        assert (lost.state, lost.exit_code) == ("failed", -1)
        assert "ended while the head was down" in lost.reason

        (tmp_path / "jobs" / "job-live" / "exit_code").write_text("4\n")
        live.kill()
        await live.wait()
        async with asyncio.timeout(10):
            while True:
                if jobs.get("job-live").state != "running":
                    break
                await asyncio.sleep(0.05)
        assert (jobs.get("job-live").state, jobs.get("job-live").exit_code) == ("failed", 4)
        again = {r["job_id"]: r for r in store.load_jobs()}  # and the store has it all
        assert again["job-live"]["exit_code"] == 4 and again["job-done"]["state"] == "succeeded"
    finally:
        if live.returncode is None:
            live.kill()
            await live.wait()
