"""Cluster mode on this host: `orchestr start --head`, a node daemon joining it, `status`,
`run` on the running cluster, `stop`, and what each refuses. Real daemons, real processes."""

from __future__ import annotations

import json
import os
import pathlib
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

ORCHESTR = [sys.executable, "-m", "orchestr.cli"]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTR_")}
    full_env.update(env)
    return subprocess.run(
        [*ORCHESTR, *args], capture_output=True, text=True, timeout=120, env=full_env, cwd=ROOT
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] != "Z"


@pytest.fixture
def state_dir(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    folder = tmp_path / "state"
    yield folder
    cli("stop", "--state-dir", str(folder))  # whatever the test left running


def start_cluster(folder: pathlib.Path) -> str:
    head = cli("start", "--head", "--state-dir", str(folder))
    assert head.returncode == 0, head.stderr
    address = json.loads((folder / "head.json").read_text())["address"]
    assert f"head running at {address}" in head.stdout
    node = cli("start", "--address", address, "--state-dir", str(folder))
    assert node.returncode == 0, node.stderr
    assert f"joined {address}" in node.stdout
    return address


def test_start_status_run_stop(state_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    address = start_cluster(state_dir)
    token = state_dir / "token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    again = cli("start", "--head", "--state-dir", str(state_dir))
    assert again.returncode == 1 and "already runs" in again.stderr

    report = cli("status", "--json", "--state-dir", str(state_dir))
    assert report.returncode == 0, report.stderr
    status = json.loads(report.stdout)
    assert status["head"] == address
    (node,) = status["nodes"]
    assert node["alive"] and node["total"]["cpu"] > 0
    text = cli("status", "--state-dir", str(state_dir))
    assert "1 node(s)" in text.stdout and node["node_id"] in text.stdout

    # a job whose actor class lives in the job's own file: its folder travels with the spawn
    job = tmp_path / "jobs" / "ping_job.py"
    job.parent.mkdir()
    job.write_text(
        textwrap.dedent(
            """
            import os, sys
            import orchestr as oc

            class Ping(oc.Actor):
                @oc.endpoint
                def ping(self, x: int) -> list[int]:
                    return [x + 1, os.getppid()]

            async def main(ctx):
                mesh = await ctx.spawn(Ping, n=2, resources={"cpu": 0.5})
                got = await mesh.ping.call(41)
                print("answers", [a for a, _ in got], "args", sys.argv[1:])
                print("parents", sorted({p for _, p in got}))
            """
        )
    )
    ran = cli("run", "--state-dir", str(state_dir), str(job), "--flag")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "answers [42, 42] args ['--flag']" in ran.stdout
    # the workers are the node daemon's children, not this job's
    node_pid = int(json.loads(next((state_dir / "nodes").glob("*.json")).read_text())["pid"])
    assert f"parents [{node_pid}]" in ran.stdout
    assert alive(node_pid)  # the job ended, the cluster did not

    # the daemons' JSON-lines logs, read through the head
    names = cli("logs", "--daemon", "--state-dir", str(state_dir)).stdout.split()
    assert "head.jsonl" in names and any(n.startswith("node-") for n in names)
    head_log = cli("logs", "--daemon", "head.jsonl", "--state-dir", str(state_dir)).stdout
    events = [json.loads(line) for line in head_log.splitlines()]
    assert any(e["event"] == "head started" for e in events)
    sneaky = cli("logs", "--daemon", "../token", "--state-dir", str(state_dir))
    assert sneaky.returncode == 1 and "no daemon log '../token'" in sneaky.stderr

    head_pid = json.loads((state_dir / "head.json").read_text())["pid"]
    stopped = cli("stop", "--state-dir", str(state_dir))
    assert stopped.returncode == 0, stopped.stderr
    assert f"stopped node daemon (pid {node_pid})" in stopped.stdout
    assert f"stopped head at {address}" in stopped.stdout
    assert not alive(node_pid) and not alive(head_pid)
    assert not (state_dir / "head.json").exists()
    assert "no daemons running" in cli("stop", "--state-dir", str(state_dir)).stdout


def test_refusals(state_dir: pathlib.Path) -> None:
    nothing = cli("status", "--state-dir", str(state_dir))
    assert nothing.returncode == 1 and "no head runs from" in nothing.stderr
    both = cli("start", "--head", "--address", "127.0.0.1:1", "--state-dir", str(state_dir))
    assert both.returncode == 2 and "say --head, or --address" in both.stderr
    no_token = cli("start", "--address", "127.0.0.1:1", "--state-dir", str(state_dir))
    assert no_token.returncode == 1 and "no cluster token" in no_token.stderr

    start_cluster(state_dir)
    wrong = cli("status", "--state-dir", str(state_dir), ORCHESTR_TOKEN="not-the-token")
    assert wrong.returncode == 1
    assert (
        "AuthenticationError" in wrong.stderr
        and "not signed with the cluster token" in wrong.stderr
    )
    wrong_run = cli(
        "run", "--state-dir", str(state_dir), "examples/hello.py", ORCHESTR_TOKEN="not-it"
    )
    assert wrong_run.returncode == 1 and "token" in wrong_run.stderr
    # a token file others can read is refused, not used
    (state_dir / "token").chmod(0o644)
    loose = cli("status", "--state-dir", str(state_dir))
    assert loose.returncode == 1 and "chmod 600" in loose.stderr
    (state_dir / "token").chmod(0o600)
    assert cli("status", "--state-dir", str(state_dir)).returncode == 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_blocking_daemons_run_in_the_foreground_with_a_given_token(
    state_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """``--block`` (what a container or a Slurm step runs): the head and a node are the
    processes started, in the foreground, with the cluster token from ``ORCHESTR_TOKEN`` (a
    Kubernetes Secret's) and the node on the port it was given; SIGTERM ends each, exit 0."""
    token = "a-token-from-a-secret-0123456789"
    home_before = (pathlib.Path.home() / ".orchestr").exists()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTR_")}
    env.update(ORCHESTR_TOKEN=token, ORCHESTR_DASHBOARD_PORT="0")
    port, node_port = _free_port(), _free_port()
    head_cmd = [*ORCHESTR, "start", "--head", "--block", "--port", str(port)]
    head = subprocess.Popen(
        [*head_cmd, "--state-dir", str(state_dir)], env=env, stdout=subprocess.PIPE, text=True
    )
    procs = [head]
    try:
        assert head.stdout is not None
        assert head.stdout.readline().strip() == f"head serving at 127.0.0.1:{port}"
        assert not (state_dir / "token").exists()  # the given token, not one of its own
        node_cmd = [*ORCHESTR, "start", "--block", "--address", f"127.0.0.1:{port}"]
        node_cmd += ["--port", str(node_port), "--labels", "rack=r1"]
        node = subprocess.Popen(
            node_cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        procs.insert(0, node)
        assert node.stdout is not None
        line = node.stdout.readline()
        assert line.startswith("node ") and line.strip().endswith(f"127.0.0.1:{node_port}"), line
        status = cli("status", "--json", "--address", f"127.0.0.1:{port}", ORCHESTR_TOKEN=token)
        assert status.returncode == 0, status.stderr
        (joined,) = json.loads(status.stdout)["nodes"]
        assert joined["labels"] == {"rack": "r1"}
        for proc in procs:  # the node first
            proc.terminate()
            assert proc.wait(timeout=30) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    bad = cli("start", "--block", "--address", f"127.0.0.1:{port}", "--port", "70000")
    assert bad.returncode == 2 and "--port must be in 0..65535" in bad.stderr
    # a blocking node keeps nothing in a state directory (here: the default one's)
    assert not (pathlib.Path.home() / ".orchestr" / "nodes").exists() or home_before
