"""The RL example on the emulated fabric: circuits follow the job's phases.

Hosts ``tor0``..``tor2`` of a :class:`NetnsFabric` (namespaces on a bridge shaped to 10 Mbit/s,
circuits shaped to 400 Mbit/s) are the hosts ``h0``..``h2`` of ``examples/fabric/netns3.toml``,
each under the ToR it is named after; a fourth, ``head``, on the same bridge but off the OCS,
runs the head daemon (its fabric manager driving the emulation with ``--ocs-driver netns:TAG``)
and the job's controller. A node daemon runs on each ToR host, labelled ``fabric_host=h<i>``.
``orchestr run examples/grpo_reverse.py --small --mode sync`` then trains a few steps: every
``weight_sync`` phase declares the weights' bytes from the trainer mesh to the generators, the
manager plans circuits from the trainer's ToR to each generator's before the first one, keeps
them after, and the job's event log and trace show each plan ending before its phase starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from orchestr._job._events import read_events
from orchestr.fabric.optical import NetnsFabric, netns_missing

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[3]
PLAN = ROOT / "examples" / "fabric" / "netns3.toml"
EXAMPLE = ROOT / "examples" / "grpo_reverse.py"
ORCHESTR = [sys.executable, "-m", "orchestr.cli"]
HEAD_PORT = 7411  # the head's namespace is ours alone
TORS = ("tor0", "tor1", "tor2")  # plan host h<i> sits under tor<i>
STEPS = 3
#: What the phase tracks show, in order: the weights of version 0, then per step.
ORDER = ["plan", "weight_sync"] + ["generation", "training", "plan", "weight_sync"] * STEPS


@dataclasses.dataclass
class Cluster:
    fab: NetnsFabric
    state_dir: Path
    address: str
    env: dict[str, str]

    def cli(self, host: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        """``orchestr ARGS`` inside ``host``, with this cluster's state directory."""
        return subprocess.run(
            [*self.fab.exec_args(host), *ORCHESTR, *args, "--state-dir", str(self.state_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**self.env, **env},
            cwd=ROOT,
        )

    def json(self, *args: str) -> Any:
        done = self.cli("head", *args, "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``orchestr run ARGS`` with its controller on the head's host."""
        head = ["run", "--address", self.address, "--state-dir", str(self.state_dir)]
        return subprocess.run(
            [*self.fab.exec_args("head"), *ORCHESTR, *head, *args],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=ROOT,
            env={**self.env, "ORCHESTR_BIND_HOST": self.fab.address("head")},
        )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    why = netns_missing()
    if why is not None:
        pytest.skip(f"the RL job on an emulated fabric: {why}")
    pytest.importorskip("torch", reason="the RL roles need torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTR_")}
    fab = NetnsFabric([*TORS, "head"], electrical_mbit=10, circuit_mbit=400)
    state_dir = tmp_path / "state"
    leaked: list[int] = []
    try:
        fab.open()
        c = Cluster(fab, state_dir, f"{fab.address('head')}:{HEAD_PORT}", env)
        head = c.cli(
            "head",
            "start",
            "--head",
            "--host",
            fab.address("head"),
            "--port",
            str(HEAD_PORT),
            "--fabric",
            str(PLAN),
            "--ocs-driver",
            f"netns:{fab.tag}",
        )
        assert head.returncode == 0, head.stdout + head.stderr

        def start_node(i: int) -> subprocess.CompletedProcess[str]:
            return c.cli(
                TORS[i],
                "start",
                "--address",
                c.address,
                "--labels",
                f"fabric_host=h{i}",
                ORCHESTR_BIND_HOST=fab.address(TORS[i]),
            )

        # the three hosts' nodes join at once, as on three machines
        with ThreadPoolExecutor(len(TORS)) as pool:
            nodes = list(pool.map(start_node, range(len(TORS))))
        for node in nodes:
            assert node.returncode == 0, node.stdout + node.stderr
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
        leaked = fab.pids()
        fab.close()  # kills what is left, deletes the namespaces
    assert not fab.leftovers(), f"namespaces left behind: {fab.leftovers()}"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert fab.tag not in listed.stdout
    assert not leaked, f"processes left in the namespaces after orchestr stop: {leaked}"


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


def test_circuits_follow_the_rl_jobs_weight_syncs(cluster: Cluster, tmp_path: Path) -> None:
    fab = cluster.fab
    job = cluster.run(
        str(EXAMPLE),
        "--small",
        "--steps",
        str(STEPS),
        "--mode",
        "sync",
        "--quiet",
        "--runs",
        str(tmp_path / "runs"),
    )
    tail = f"\n--- stdout ---\n{job.stdout[-3000:]}\n--- stderr ---\n{job.stderr[-5000:]}"
    assert job.returncode == 0, tail
    wrote = re.search(r"^wrote (.+)/ \(", job.stdout, re.MULTILINE)
    assert wrote is not None, tail
    run = Path(wrote.group(1))

    # what the cluster says after the run, asked at once: where the roles ran, the manager's
    # plans and the circuits it holds
    queries = (["status"], ["fabric", "history"], ["fabric", "show"])
    with ThreadPoolExecutor(len(queries)) as pool:
        status, history, shown = pool.map(lambda query: cluster.json(*query), queries)

    # where the roles ran: SPREAD over three equal nodes puts the trainer apart
    host = {n["node_id"]: n["labels"]["fabric_host"] for n in status["nodes"]}

    def tors(mesh: str) -> set[str]:
        return {f"tor{host[a['node_id']][1:]}" for a in status["actors"] if a["mesh"] == mesh}

    [trainer], generators = tors("Trainer"), tors("Generator")
    assert len(generators) == 2 and trainer not in generators, status["actors"]
    wanted = sorted(_pair(trainer, g) for g in generators)

    # the manager: one plan per weight sync; the first applied, the rest kept the circuits
    assert [r["phase"] for r in history] == ["weight_sync"] * (STEPS + 1), history
    first, *rest = history
    assert first["status"] == "applied" and first["commit"], first
    assert sorted((a, b) for a, b, n in first["add"]) == wanted and not first["remove"]
    assert set(first["timings"]) >= {"reserve", "program", "verify", "undrain"}
    assert all(r["status"] == "skipped" and not r["add"] and not r["remove"] for r in rest)
    assert sorted(_pair(a, b) for _, _, a, b in shown["ocs"][0]["circuits"]) == wanted
    # ... and the kernel: veth links between the namespaces, the routes on them
    assert sorted(fab.circuits()) == wanted
    for g in generators:
        assert fab.route_device(trainer, g) == fab.circuit_device(trainer, g)

    # the job's event log: each weight sync's plan ends before the phase starts
    events = read_events(run / "events.jsonl")
    spans = [e for e in events if e["kind"] in ("phase", "fabric_plan")]
    spans.sort(key=lambda e: e["ts"])
    assert [e["name"] if e["kind"] == "phase" else "plan" for e in spans] == ORDER
    plans = [e for e in spans if e["kind"] == "fabric_plan"]
    assert [(p["track"], p["phase"]) for p in plans] == [("fabric", "weight_sync")] * (STEPS + 1)
    assert [p["status"] for p in plans] == [r["status"] for r in history]
    assert plans[0]["add"] == first["add"] and plans[0]["timings"] == first["timings"]
    ended = -math.inf
    for before, after in itertools.pairwise(spans):
        if before["kind"] == "fabric_plan":
            assert ended <= before["ts"]  # asked once the phase before had ended
            assert before["ts"] + before["dur"] <= after["ts"] + 1e-3  # the circuits came first
        ended = before["ts"] + before["dur"]

    # the trace: the same order on its fabric and phases tracks
    trace = json.loads((run / "trace.json").read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    slices = sorted(
        (e["ts"], e["dur"], tracks[e["tid"]], e["name"])
        for e in trace
        if e["ph"] == "X" and tracks[e["tid"]] in ("fabric", "phases")
    )
    assert [name if track == "phases" else "plan" for _, _, track, name in slices] == ORDER
    for (ts, dur, track, name), (next_ts, *_) in itertools.pairwise(slices):
        if track == "fabric":
            assert name == "circuits for weight_sync" and ts + dur <= next_ts + 1e3  # µs
