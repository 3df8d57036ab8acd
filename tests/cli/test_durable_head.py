"""A durable head: SIGKILL the head daemon while a submitted job runs, start it again on the
same state directory, and everything carries on: the node registers again, the job's actors
are adopted (same processes, same state), the job's record is intact and the job finishes.
Also: daemon logs of a node read through the head, and what `status` shows of nodes."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import textwrap
import time
from typing import Any

import pytest

from .test_cluster import ORCHESTR, alive, cli, start_cluster, state_dir  # noqa: F401 (a fixture)

JOB = """
import os, time
import orchestr as oc

class Counter(oc.Actor):
    def __init__(self) -> None:
        self.count = 0

    @oc.endpoint
    def add(self) -> int:
        self.count += 1
        return self.count

    @oc.endpoint
    def pid(self) -> int:
        return os.getpid()

async def main(ctx):
    mesh = await ctx.spawn(Counter, n=2, resources={"cpu": 0.1})
    print("pids", sorted(await mesh.pid.call()), flush=True)
    calls = 0
    while not os.path.exists("release"):
        await mesh.add.call()
        calls += 1
        if calls % 10 == 0:
            print("calls", calls, flush=True)
        time.sleep(0.02)
    print("final", sorted(await mesh.add.call()), "after", calls, flush=True)
"""


def _poll(what: str, check: Any, limit_s: float = 60) -> Any:
    deadline = time.monotonic() + limit_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _status(sd: list[str]) -> dict[str, Any]:
    shown = cli("status", "--json", *sd)
    assert shown.returncode == 0, shown.stderr
    result: dict[str, Any] = json.loads(shown.stdout)
    return result


@pytest.mark.timeout(180)
def test_head_killed_and_restarted_mid_job(
    state_dir: pathlib.Path,  # noqa: F811
    tmp_path: pathlib.Path,
) -> None:
    address = start_cluster(state_dir)
    sd = ["--state-dir", str(state_dir)]
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "job.py").write_text(textwrap.dedent(JOB))
    started = cli("submit", "--no-wait", *sd, str(wd / "job.py"))
    assert started.returncode == 0, started.stderr
    job_id = started.stdout.strip()

    def logs() -> str:
        out: str = cli("logs", *sd, job_id).stdout
        return out

    _poll("the job's calls", lambda: "calls 10" in logs())
    before = next(j for j in json.loads(cli("jobs", "--json", *sd).stdout) if j["job_id"] == job_id)
    actors = {a["actor_id"]: a for a in _status(sd)["actors"] if a["state"] == "alive"}
    assert len(actors) == 2

    head_pid = json.loads((state_dir / "head.json").read_text())["pid"]
    os.kill(head_pid, signal.SIGKILL)
    _poll("the head's end", lambda: not alive(head_pid), 10)
    time.sleep(1.0)  # the job runs on without its head meanwhile
    assert alive(before["pid"]), "the job's controller died with its head"

    again = cli("start", "--head", *sd)
    assert again.returncode == 0, again.stderr
    assert json.loads((state_dir / "head.json").read_text())["address"] == address
    # The node registers again and the head adopts the job's actors as they are.
    status = _poll(
        "the node to register again",
        lambda: (s := _status(sd))["nodes"] and all(n["alive"] for n in s["nodes"]) and s,
    )
    adopted = {a["actor_id"]: a for a in status["actors"] if a["actor_id"] in actors}
    assert {k: (a["state"], a["pid"], a["restarts"]) for k, a in adopted.items()} == {
        k: ("alive", a["pid"], 0) for k, a in actors.items()
    }
    listed = json.loads(cli("jobs", "--json", *sd).stdout)
    (record,) = [j for j in listed if j["job_id"] == job_id]
    assert record == before  # the job's record is intact, and it still runs

    calls_then = logs().count("calls")
    _poll("calls after the restart", lambda: logs().count("calls") > calls_then)
    (wd_on_head,) = (state_dir / "jobs").glob(f"{job_id}/wd")
    (wd_on_head / "release").touch()
    done = _poll(
        "the job's end",
        lambda: next(
            (
                j
                for j in json.loads(cli("jobs", "--json", *sd).stdout)
                if j["job_id"] == job_id and j["state"] != "running"
            ),
            None,
        ),
    )
    assert (done["state"], done["exit_code"]) == ("succeeded", 0), logs()
    final = next(line for line in logs().splitlines() if line.startswith("final"))
    counts, calls = final.split(" after ")
    # Same actors, never restarted: each counted every call, plus the last one.
    assert counts == f"final {[int(calls) + 1] * 2}"


def test_node_daemon_logs_and_what_status_shows_of_nodes(
    state_dir: pathlib.Path,  # noqa: F811
) -> None:
    start_cluster(state_dir)
    sd = ["--state-dir", str(state_dir)]
    (node,) = _status(sd)["nodes"]
    assert {"tcp", "shm"} <= set(node["transports"])
    assert isinstance(node["devices"], list)
    listed = cli("logs", "--daemon", "--node", node["node_id"], *sd)
    assert listed.returncode == 0, listed.stderr
    (name,) = [n for n in listed.stdout.split() if n.startswith("node-")]
    read = cli("logs", "--daemon", name, "--node", node["node_id"], *sd)
    assert read.returncode == 0, read.stderr
    assert any(json.loads(line).get("event") == "node started" for line in read.stdout.splitlines())
    bad = cli("logs", "--daemon", "../token", "--node", node["node_id"], *sd)
    assert bad.returncode != 0 and "no daemon log '../token'" in bad.stderr
    unknown = cli("logs", "--daemon", "--node", "n-nope", *sd)
    assert unknown.returncode != 0 and "no node 'n-nope'" in unknown.stderr


@pytest.mark.timeout(120)
def test_a_job_whose_head_does_not_come_back_fails_clearly(
    state_dir: pathlib.Path,  # noqa: F811
    tmp_path: pathlib.Path,
) -> None:
    address = start_cluster(state_dir)
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTR_")}
    env.update(
        ORCHESTR_TOKEN=(state_dir / "token").read_text().strip(),
        ORCHESTR_HEAD_RECONNECT_TIMEOUT="2",
    )
    out = tmp_path / "out.txt"
    with open(out, "w") as sink:
        job = subprocess.Popen(
            [*ORCHESTR, "run", "--address", address, str(tmp_path / "job.py")],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
    try:
        _poll("the job's calls", lambda: "calls 10" in out.read_text())
        head_pid = json.loads((state_dir / "head.json").read_text())["pid"]
        os.kill(head_pid, signal.SIGKILL)
        code = job.wait(timeout=60)  # never a hang: the job fails once its wait is over
    finally:
        job.kill()
    text = out.read_text()
    assert code != 0, text
    assert "did not come back within 2 s (ORCHESTR_HEAD_RECONNECT_TIMEOUT)" in text
