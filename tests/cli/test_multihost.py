"""A cluster over three hosts made of network namespaces (tests/netns.py): the head daemon on
one, a node daemon on each of the two others, the job's controller on the head's host. Every
byte between them crosses a veth pair and a bridge; nothing touches this namespace.

A mesh placed across both nodes answers calls and moves a buffer between its members over tcp;
a node cut off mid-job (its link set down, then up) ends the job in a restart elsewhere or in a
clear failure, never in a hang, and leaves a cluster that runs the next job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.netns import Topology, require_netns

ROOT = pathlib.Path(__file__).resolve().parents[2]
JOB = pathlib.Path(__file__).with_name("multihost_job.py")
ORCHESTR = [sys.executable, "-m", "orchestr.cli"]
HEAD_PORT = 7411  # the head's namespace is ours alone: any fixed port is free there
HEARTBEAT_TIMEOUT_S = 3
#: A call is allowed this long, so that a call stuck on a dead link shows as a hang (the job
#: outlives JOB_LIMIT_S) instead of ending with a timeout that looks like a clean failure.
CALL_TIMEOUT_S = 600
#: How long a job may take from the partition to its end: a hang if it is still running then.
JOB_LIMIT_S = 75.0
MiB = 1 << 20


class Job:
    """``orchestr run`` of multihost_job.py inside the head's namespace, its output read as it
    comes (``expect``) and in full once it ends (``finish``)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out, True)),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err, False)),
        ]
        for t in self._readers:
            t.start()

    def _read(self, stream: Any, into: list[str], tell: bool) -> None:
        for line in stream:
            into.append(line)
            if tell:
                self.lines.put(line.rstrip("\n"))
        if tell:
            self.lines.put(None)

    def expect(self, prefix: str, timeout: float) -> str:
        """The rest of the job's next stdout line that starts with ``prefix``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"the job printed no {prefix!r} line in {timeout:g} s{self.tail()}")
            if line is None:
                self.proc.wait(timeout=30)
                pytest.fail(
                    f"the job ended (rc {self.proc.returncode}) before {prefix!r}{self.tail()}"
                )
            if line.startswith(prefix):
                return line[len(prefix) :].strip()

    def finish(self, timeout: float) -> int:
        """Wait for the job to end; a job still running after ``timeout`` s is a hang."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job hung: still running {timeout:g} s later{self.tail()}")
        self._drain()
        return self.proc.returncode

    def kill(self) -> None:
        """End the job if it still runs (SIGKILL); idempotent."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._drain()

    def _drain(self) -> None:
        for t in self._readers:
            t.join(timeout=10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()

    def result(self) -> dict[str, Any]:
        lines = [x for x in self.out if x.startswith("RESULT ")]
        assert lines, f"the job printed no result{self.tail()}"
        return json.loads(lines[-1][len("RESULT ") :])

    def tail(self) -> str:
        out, err = "".join(self.out)[-3000:], "".join(self.err)[-5000:]
        return f"\n--- stdout ---\n{out}\n--- stderr ---\n{err}"


@dataclasses.dataclass
class Cluster:
    net: Topology
    state_dir: pathlib.Path
    address: str
    env: dict[str, str]

    @property
    def link_up_flag(self) -> pathlib.Path:
        """The file whose appearance tells a partition job that the link is up again."""
        return self.state_dir.parent / "link-up"

    def cli(
        self, host: str, *args: str, timeout: float = 60, **env: str
    ) -> subprocess.CompletedProcess[str]:
        """``orchestr ARGS`` run inside ``host``, with this cluster's state directory."""
        return subprocess.run(
            [*self.net.exec_args(host), *ORCHESTR, *args, "--state-dir", str(self.state_dir)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**self.env, **env},
            cwd=ROOT,
        )

    def status(self) -> dict[str, Any]:
        done = self.cli("head", "status", "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def node(self, host: str) -> dict[str, Any]:
        """The newest record the head has of the node on ``host`` (by its label)."""
        nodes = [n for n in self.status()["nodes"] if n["labels"].get("host") == host]
        assert nodes, f"the head knows no node on {host}"
        return max(nodes, key=lambda n: n["last_heartbeat_unix"])

    def wait_node(self, host: str, alive: bool, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (node := self.node(host))["alive"] != alive:
            assert time.monotonic() < deadline, f"{host} not {'alive' if alive else 'dead'}: {node}"
            time.sleep(0.2)
        return node

    def job(self, scenario: str) -> Job:
        args = [*self.net.exec_args("head"), *ORCHESTR, "run", "--state-dir", str(self.state_dir)]
        env = {
            **self.env,
            "ORCHESTR_BIND_HOST": self.net.address("head"),
            "ORCHESTR_CALL_TIMEOUT": str(CALL_TIMEOUT_S),
            "MULTIHOST_N1": self.net.address("n1"),
            "MULTIHOST_N2": self.net.address("n2"),
            "MULTIHOST_LINK_UP": str(self.link_up_flag),
        }
        return Job([*args, str(JOB), scenario], env)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    require_netns()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTR_")}
    env["ORCHESTR_HEARTBEAT_TIMEOUT"] = str(HEARTBEAT_TIMEOUT_S)
    net = Topology(["head", "n1", "n2"])
    state_dir = tmp_path / "state"
    leaked: list[int] = []
    try:
        net.open()
        head_ip = net.address("head")
        c = Cluster(net, state_dir, f"{head_ip}:{HEAD_PORT}", env)
        head = c.cli("head", "start", "--head", "--host", head_ip, "--port", str(HEAD_PORT))
        assert head.returncode == 0, head.stderr
        assert f"head running at {c.address}" in head.stdout
        for host in ("n1", "n2"):
            node = c.cli(
                host,
                "start",
                "--address",
                c.address,
                "--labels",
                f"host={host}",
                ORCHESTR_BIND_HOST=net.address(host),
            )
            assert node.returncode == 0, node.stderr
            assert f"serving at {net.address(host)}:" in node.stdout
        yield c
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(
                [*ORCHESTR, "stop", "--state-dir", str(state_dir)],
                capture_output=True,
                timeout=60,
                env=env,
                cwd=ROOT,
            )
        leaked = net.pids()
        net.close()  # kills what is left, deletes the namespaces
    assert not net.leftovers(), f"namespaces left behind: {net.leftovers()}"
    assert not leaked, f"processes left in the namespaces after orchestr stop: {leaked}"


@pytest.mark.timeout(180)
def test_mesh_across_two_hosts(cluster: Cluster) -> None:
    net = cluster.net
    status = cluster.status()
    assert status["head"] == cluster.address
    nodes = {n["labels"]["host"]: n for n in status["nodes"]}
    assert sorted(nodes) == ["n1", "n2"] and all(n["alive"] for n in nodes.values())
    for host, n in nodes.items():
        assert n["address"].startswith(f"{net.address(host)}:")

    job = cluster.job("mesh")
    rc = job.finish(timeout=120)
    assert rc == 0, job.tail()
    result = job.result()

    # one member on each node, in its namespace, serving calls on its own host's address
    where = {int(rank): w for rank, w in result["where"].items()}
    assert sorted(where) == [0, 1]
    node_of = {n["node_id"]: host for host, n in nodes.items()}
    assert sorted(node_of[w["node"]] for w in where.values()) == ["n1", "n2"]
    for w in where.values():
        host = node_of[w["node"]]
        assert w["head_node"] == w["node"] and w["host"] == net.address(host)
        assert w["call_address"].startswith(f"tcp://{net.address(host)}:")
        assert w["netns"] == os.stat(f"/var/run/netns/{net.namespace(host)}").st_ino

    # the controller (on the head's host) called both; each member called the other
    assert result["pings"] == [[42, where[0]["node"]], [42, where[1]["node"]]]
    assert result["relays"] == [
        [2, where[1]["node"], where[0]["node"]],
        [3, where[0]["node"], where[1]["node"]],
    ]
    # 32 MiB read by the member on n2 from the one on n1, over tcp, byte for byte
    transfer = result["transfer"]
    assert transfer["used"] == "tcp" and transfer["bytes"] == 32 * MiB
    assert transfer["received"] == transfer["sent"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", ["restart", "fail"])
def test_partition_ends_in_recovery_or_a_clear_failure(cluster: Cluster, policy: str) -> None:
    net = cluster.net
    n1, n2 = cluster.node("n1")["node_id"], cluster.node("n2")["node_id"]
    job = cluster.job(f"partition-{policy}")
    try:
        ready = json.loads(job.expect("READY", timeout=90))
        assert ready["node"] == n2
        net.link_down("n2")
        cut = time.monotonic()
        try:
            dead = cluster.wait_node("n2", alive=False, timeout=30)
            assert dead["node_id"] == n2
            if policy == "restart":
                while (node := job.expect("NODE", timeout=JOB_LIMIT_S)) == n2:
                    pass
                assert node == n1  # the member was restarted on the other node
                # the call between the members went on to the restarted one, n2 still cut off
                assert job.expect("RELAY", timeout=JOB_LIMIT_S) == n1
                net.link_up("n2")  # mid-job: the loop goes on on n1
                cluster.wait_node("n2", alive=True, timeout=30)
                cluster.link_up_flag.touch()
            rc = job.finish(timeout=JOB_LIMIT_S - (time.monotonic() - cut))
        finally:
            net.link_up("n2")
    finally:
        job.kill()

    if policy == "restart":
        assert rc == 0, job.tail()
        result = job.result()
        assert result["moved"]["nodes"] == [n2, n1]
        assert result["rejoined"]["nodes"] == [n1]  # n2 back: the restarted member stays
        assert result["where_after"][str(ready["rank"])]["node"] == n1
    else:
        assert rc == 1, job.tail()
        err = "".join(job.err)
        # the call in flight fails, or the supervisor fails the job, whichever comes first
        assert re.search(r"the job failed: (ActorDiedError|SupervisionError): ", err), job.tail()
        assert f"Peer[{ready['rank']}] died" in err and f"node {n2} was lost" in err, job.tail()

    # the cluster is usable: n2 is back, and a job across both nodes runs
    cluster.wait_node("n2", alive=True, timeout=30)
    small = cluster.job("small")
    assert small.finish(timeout=120) == 0, small.tail()
    assert sorted(p[0] for p in small.result()["pings"]) == [2, 2]

    # the worker of the member given up on n2 must not outlive the partition
    deadline = time.monotonic() + 15
    while _alive(ready["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    # n2 registered again, listing it, and the head had it stopped
    assert not _alive(ready["pid"]), f"the given-up worker (pid {ready['pid']}) still runs"
