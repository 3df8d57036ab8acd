"""``orchestr slurm`` against a real Slurm: Debian's slurmctld and slurmd, configured here for
one node (this host) with munge, run as root. A job submitted with ``orchestr slurm submit``
runs on a head and a node daemon the batch script starts, writes its output where Slurm says
and completes; a job cancelled with ``scancel`` mid-run leaves no process behind.

Slurm and munge come from Debian (``make setup-slurm``). Without them the tests are skipped,
saying so, unless ``ORCHESTR_REQUIRE_TOOLS`` is set (CI sets it)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from .test_run import _processes_with

ROOT = pathlib.Path(__file__).resolve().parents[2]
JOB = pathlib.Path(__file__).with_name("slurm_job.py")
TOOLS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scancel", "scontrol", "sinfo")

pytestmark = pytest.mark.timeout(240)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(what: str, check: object, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} within {seconds:.0f} s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A one-node Slurm cluster of this host; yields the environment its commands need."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing or os.getuid() != 0:
        why = f"a Slurm cluster here needs root and {', '.join(missing) or 'nothing more'}"
        why += " (make setup-slurm installs Debian's slurmctld, slurmd and munge)"
        if os.environ.get("ORCHESTR_REQUIRE_TOOLS"):
            pytest.fail(why)
        pytest.skip(why)
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool", "log"):
        (d / sub).mkdir(mode=0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    host = socket.gethostname()
    conf = d / "slurm.conf"
    conf.write_text(
        f"ClusterName=orchestrtest\nSlurmctldHost={host}(127.0.0.1)\n"
        f"SlurmctldPort={_port()}\nSlurmdPort={_port()}\nSlurmUser=root\nSlurmdUser=root\n"
        f"AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={d}/munge/socket\n"
        f"StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool\n"
        f"SlurmctldPidFile={d}/ctld.pid\nSlurmdPidFile={d}/d.pid\n"
        f"SlurmctldLogFile={d}/log/ctld.log\nSlurmdLogFile={d}/log/d.log\n"
        "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSelectType=select/cons_tres\n"
        "SelectTypeParameters=CR_Core\nReturnToService=2\nMpiDefault=none\n"
        "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
        "SchedulerType=sched/builtin\nKillWait=10\nMinJobAge=600\n"
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN\n"
        f"PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP\n"
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = []
    try:
        munge = ["munged", "--force", f"--socket={d}/munge/socket", f"--key-file={key}"]
        munge += [f"--pid-file={d}/munge/pid", f"--log-file={d}/munge/log"]
        subprocess.run([*munge, f"--seed-file={d}/munge/seed"], check=True)
        for daemon in (["slurmctld", "-D", "-i"], ["slurmd", "-D"]):
            daemons.append(
                subprocess.Popen(
                    daemon, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        _wait(
            "the node idle in sinfo",
            lambda: (
                "idle"
                in subprocess.run(
                    ["sinfo", "--noheader", "--format=%T"], env=env, capture_output=True, text=True
                ).stdout
            ),
        )
        yield env
    finally:
        for proc in daemons:
            proc.terminate()
            proc.wait(30)
        pid = d / "munge" / "pid"
        if pid.exists():
            os.kill(int(pid.read_text()), 15)


def _submit(env: dict[str, str], out: pathlib.Path, *args: str) -> str:
    command = [sys.executable, "-m", "orchestr.cli", "slurm", "submit", "--nodes", "1"]
    command += ["--output", str(out), "--script", str(out.with_suffix(".sbatch"))]
    done = subprocess.run(
        [*command, f"--sbatch=--chdir={JOB.parent}", str(JOB), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    found = re.match(r"Submitted batch job (\d+)", done.stdout)
    assert found, done.stdout
    return found[1]


def _state(env: dict[str, str], job: str) -> tuple[str, str]:
    shown = subprocess.run(
        ["scontrol", "show", "job", job], env=env, capture_output=True, text=True
    ).stdout
    state = re.search(r"JobState=(\w+)", shown)
    code = re.search(r"ExitCode=([\d:]+)", shown)
    return (state[1] if state else "", code[1] if code else "")


def test_a_submitted_job_runs_on_the_allocation_and_completes(
    slurm: dict[str, str], tmp_path: pathlib.Path
) -> None:
    marker = uuid.uuid4().hex
    env = {**slurm, "ORCHESTR_TEST_MARKER": marker}
    out = tmp_path / "job.out"
    job = _submit(env, out)
    _wait("the job to end", lambda: _state(env, job)[0] not in ("PENDING", "RUNNING", ""), 180)
    assert _state(env, job) == ("COMPLETED", "0:0"), out.read_text()[-3000:]
    text = out.read_text()  # where --output said
    assert "orchestr slurm: 1 node(s) joined" in text
    assert f"RESULT ['0@{socket.gethostname()}', '1@{socket.gethostname()}']" in text
    assert "the job ended with code 0" in text
    _wait("every process of the job to end", lambda: _processes_with(marker) == [], 30)


def test_scancel_stops_the_job_and_leaves_no_process(
    slurm: dict[str, str], tmp_path: pathlib.Path
) -> None:
    marker = uuid.uuid4().hex
    env = {**slurm, "ORCHESTR_TEST_MARKER": marker}
    out = tmp_path / "hang.out"
    job = _submit(env, out, "--hang")
    _wait("the job to hang", lambda: out.exists() and "HANGING" in out.read_text(), 180)
    assert len(_processes_with(marker)) >= 5  # the script, the head, srun, the node, workers
    subprocess.run(["scancel", job], env=env, check=True)
    _wait("the job to be cancelled", lambda: _state(env, job)[0] == "CANCELLED", 60)
    _wait("every process of the job to end", lambda: _processes_with(marker) == [], 30)
    assert "stopping the job and the cluster" in out.read_text()
    assert not list(pathlib.Path(os.environ.get("TMPDIR", "/tmp")).glob(f"orchestr-slurm-{job}-*"))
