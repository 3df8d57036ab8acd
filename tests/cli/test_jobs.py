"""Submitted jobs: `orchestr submit` ships a working directory to the head daemon, which runs
the job's controller on the cluster; `jobs`, `logs`, `job stop`; bad packages refused."""

from __future__ import annotations

import json
import os
import pathlib
import textwrap
import time
import urllib.request

from .test_cluster import alive, cli, start_cluster, state_dir  # noqa: F401 (a fixture)

JOB = """
import sys, time
from helper import Doubler

async def main(ctx):
    mesh = await ctx.spawn(Doubler, n=2, resources={"cpu": 0.5})
    print("result", await mesh.double.call(21), sys.argv[1:], flush=True)
    if "--fail" in sys.argv:
        raise SystemExit(3)
    if "--sleep" in sys.argv:
        time.sleep(120)
"""

HELPER = """
import orchestr as oc

class Doubler(oc.Actor):
    @oc.endpoint
    def double(self, x: int) -> int:
        return 2 * x
"""


def workdir(tmp_path: pathlib.Path) -> pathlib.Path:
    wd = tmp_path / "wd"
    (wd / "__pycache__").mkdir(parents=True)
    (wd / "job.py").write_text(textwrap.dedent(JOB))
    (wd / "helper.py").write_text(textwrap.dedent(HELPER))
    (wd / "__pycache__" / "junk.pyc").write_bytes(b"x" * 100)
    return wd


def test_submit_runs_on_the_cluster_and_keeps_its_record(
    state_dir: pathlib.Path,  # noqa: F811
    tmp_path: pathlib.Path,
) -> None:
    start_cluster(state_dir)
    wd = workdir(tmp_path)
    sd = ["--state-dir", str(state_dir)]
    ran = cli("submit", *sd, str(wd / "job.py"), "--x", "1")
    assert ran.returncode == 0, ran.stderr
    assert "result [42, 42] ['--x', '1']" in ran.stdout  # helper.py travelled with it
    assert "succeeded (exit code 0)" in ran.stderr
    failed = cli("submit", *sd, str(wd / "job.py"), "--fail")
    assert failed.returncode == 3 and "failed (exit code 3)" in failed.stderr
    listed = json.loads(cli("jobs", "--json", *sd).stdout)
    assert [(j["state"], j["exit_code"]) for j in listed] == [("succeeded", 0), ("failed", 3)]
    job_id = listed[0]["job_id"]
    again = cli("logs", *sd, job_id)
    assert again.returncode == 0 and "result [42, 42]" in again.stdout
    shipped = state_dir / "jobs" / job_id / "wd"
    assert sorted(p.name for p in shipped.iterdir()) == ["helper.py", "job.py"]  # no caches
    # the controller kept its event log in the job's folder: the dashboard shows its spawns
    events = state_dir / "jobs" / job_id / "session" / "events.jsonl"
    assert '"kind": "spawn"' in events.read_text()
    head = json.loads((state_dir / "head.json").read_text())
    token = (state_dir / "metrics-token").read_text().strip()
    request = urllib.request.Request(
        f"http://{head['dashboard_address']}/jobs/{job_id}",
        headers={"Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(request, timeout=10) as page:
        text = page.read().decode()
    assert f"Job {job_id}" in text and "succeeded" in text and "mesh=" in text

    started = cli("submit", "--no-wait", *sd, str(wd / "job.py"), "--sleep")
    assert started.returncode == 0, started.stderr
    sleeper = started.stdout.strip()
    deadline = time.monotonic() + 60
    while "result" not in cli("logs", *sd, sleeper).stdout:
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.2)
    pid = next(
        j["pid"] for j in json.loads(cli("jobs", "--json", *sd).stdout) if j["job_id"] == sleeper
    )
    stopped = cli("job", "stop", *sd, sleeper)
    assert stopped.returncode == 0 and f"{sleeper} stopped" in stopped.stdout
    assert not alive(pid)


def test_bad_submissions_are_refused(
    state_dir: pathlib.Path,  # noqa: F811
    tmp_path: pathlib.Path,
) -> None:
    start_cluster(state_dir)
    wd = workdir(tmp_path)
    sd = ["--state-dir", str(state_dir)]
    (wd / "data.bin").write_bytes(os.urandom(33 << 20))  # incompressible, past the limit
    big = cli("submit", *sd, str(wd / "job.py"))
    assert big.returncode == 1 and "more than 32 MiB" in big.stderr
    (wd / "data.bin").unlink()
    outside = cli("submit", *sd, "--working-dir", str(wd / "__pycache__"), str(wd / "job.py"))
    assert outside.returncode == 1 and "not inside the working directory" in outside.stderr
    unknown = cli("logs", *sd, "job-nope")
    assert unknown.returncode == 1 and "no job 'job-nope'" in unknown.stderr
    wrong = cli("submit", *sd, str(wd / "job.py"), ORCHESTR_TOKEN="not-the-token")
    assert wrong.returncode == 1 and "AuthenticationError" in wrong.stderr
    assert json.loads(cli("jobs", "--json", *sd).stdout) == []  # nothing ran
