"""Rule: submitting a job cannot stall or starve the cluster, and ships nothing private by
default: packages are unpacked off the head's event loop within member, size and time limits;
dotfiles and what .gitignore ignores stay home; finished jobs' files are not kept forever."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import pathlib
import time
import zipfile

import pytest

from orchestr._cluster._headstore import HeadStore
from orchestr._cluster._submitted import MAX_MEMBERS, JobManager, JobRecord
from orchestr.cli._jobs import package
from orchestr.errors import ConfigError

from ..cli.test_cluster import cli, state_dir  # noqa: F401 (a fixture)

QUICK = {"ORCHESTR_HEARTBEAT_INTERVAL": "0.2", "ORCHESTR_HEARTBEAT_TIMEOUT": "1.0"}


def _zip_of(count: int) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("job.py", "print('ran')\n")
        for i in range(count):
            z.writestr(f"f/{i}", "")
    return buf.getvalue()


@pytest.mark.timeout(180)
def test_unpacking_a_package_of_many_files_leaves_the_head_serving(
    state_dir: pathlib.Path,  # noqa: F811
    tmp_path: pathlib.Path,
) -> None:
    head = cli("start", "--head", "--state-dir", str(state_dir), **QUICK)
    assert head.returncode == 0, head.stderr
    address = json.loads((state_dir / "head.json").read_text())["address"]
    node = cli("start", "--address", address, "--state-dir", str(state_dir), **QUICK)
    assert node.returncode == 0, node.stderr
    wd = tmp_path / "wd"
    (wd / "f").mkdir(parents=True)
    (wd / "job.py").write_text("async def main(ctx):\n    print('ran', flush=True)\n")
    for i in range(MAX_MEMBERS - 10):  # just under the limit: all of it is unpacked
        (wd / "f" / str(i)).touch()
    submitted = cli("submit", "--state-dir", str(state_dir), str(wd / "job.py"))
    assert submitted.returncode == 0, submitted.stderr
    assert "ran" in submitted.stdout
    logs = (state_dir / "logs" / "head.jsonl").read_text()
    assert "node missed its heartbeats" not in logs  # its heartbeats went on meanwhile
    status = json.loads(cli("status", "--json", "--state-dir", str(state_dir)).stdout)
    assert [n["alive"] for n in status["nodes"]] == [True]


def test_a_package_over_the_member_limit_is_refused_unopened(tmp_path: pathlib.Path) -> None:
    store = HeadStore(tmp_path / "head.sqlite")
    jobs = JobManager(tmp_path, "127.0.0.1:1", "token", store)

    async def go() -> None:
        with pytest.raises(ConfigError, match=f"at most {MAX_MEMBERS} are taken"):
            await jobs.submit(_zip_of(MAX_MEMBERS + 1), "job.py", [])

    asyncio.run(go())
    assert list((tmp_path / "jobs").iterdir()) == []  # nothing left behind


def test_dotfiles_and_ignored_files_stay_home(tmp_path: pathlib.Path) -> None:
    wd = tmp_path / "wd"
    (wd / "data").mkdir(parents=True)
    (wd / ".orchestr").mkdir()
    (wd / "sub").mkdir()
    files = {
        "job.py": "",
        "lib.py": "",
        ".env": "AWS_SECRET=1",
        ".orchestr/token": "t",
        "data/big.bin": "x",
        "server.key": "k",
        "sub/.gitignore": "*.tmp\n",
        "sub/keep.txt": "",
        "sub/scratch.tmp": "",
        ".gitignore": "data/\n*.key\n",
    }
    for name, text in files.items():
        (wd / name).write_text(text)
    names = set(zipfile.ZipFile(io.BytesIO(package(wd, keep=wd / "job.py"))).namelist())
    assert names == {"job.py", "lib.py", "sub/keep.txt"}
    with_dots = set(zipfile.ZipFile(io.BytesIO(package(wd, dotfiles=True))).namelist())
    assert {".env", ".orchestr/token", ".gitignore", "sub/.gitignore"} <= with_dots
    assert "data/big.bin" not in with_dots and "server.key" not in with_dots


def test_finished_jobs_files_are_removed_past_the_retention(tmp_path: pathlib.Path) -> None:
    store = HeadStore(tmp_path / "head.sqlite")
    now = time.time()
    for i in range(5):
        record = JobRecord(f"job-{i}", "a.py", [], state="succeeded", ended_unix=now + i)
        (tmp_path / "jobs" / record.job_id / "wd").mkdir(parents=True)
        store.save_job(record.job_id, dataclasses.asdict(record), b"zip")
    jobs = JobManager(tmp_path, "127.0.0.1:1", "token", store, retention=2)
    kept = sorted(p.name for p in (tmp_path / "jobs").iterdir())
    assert kept == ["job-3", "job-4"]  # the two that ended last
    assert [store.package(f"job-{i}") for i in range(5)] == [None, None, None, b"zip", b"zip"]
    assert jobs.get("job-0").pruned and not jobs.get("job-4").pruned
    assert len(store.load_jobs()) == 5  # the records stay
