"""``orchestr start``, ``stop`` and ``status``: the head and node daemons of this host."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from orchestr import _cluster
from orchestr.errors import OrchestrError

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _launch(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start a daemon in a session of its own, its output appended to ``log``."""
    log.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _fail(proc: subprocess.Popen[bytes], log: Path, what: str) -> int:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    print(f"orchestr start: {what}; its log ({log}) ends with:\n{_tail(log)}", file=sys.stderr)
    return 1


def start(args: argparse.Namespace) -> int:
    if args.head == bool(args.address):
        print("orchestr start: say --head, or --address HOST:PORT to join one", file=sys.stderr)
        return 2
    state_dir = _cluster.resolve_state_dir(args.state_dir)
    try:
        return _start_head(args, state_dir) if args.head else _start_node(args, state_dir)
    except OrchestrError as exc:
        print(f"orchestr start: {exc}", file=sys.stderr)
        return 1


def _start_head(args: argparse.Namespace, state_dir: Path) -> int:
    running = _cluster.read_head(state_dir)
    if running is not None:
        print(
            f"orchestr start: a head already runs from {state_dir} at {running['address']} "
            f"(pid {running['pid']}); orchestr stop ends it",
            file=sys.stderr,
        )
        return 1
    if not 0 <= args.port <= 65535:
        print(f"orchestr start: --port must be in 0..65535, got {args.port}", file=sys.stderr)
        return 2
    _cluster.ensure_token(state_dir)
    log = state_dir / _cluster.LOGS_DIR / "head.log"
    cmd = [sys.executable, "-m", "orchestr._cluster", "head", "--state-dir", str(state_dir)]
    cmd += ["--host", args.host, "--port", str(args.port)]
    proc = _launch(cmd, log, dict(os.environ))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        info = _cluster.read_head(state_dir)
        if info is not None and info.get("pid") == proc.pid:
            print(f"head running at {info['address']} (pid {proc.pid})")
            print(f"token: {state_dir / _cluster.TOKEN_FILE} (mode 0600)")
            print(f"logs: {log}")
            print(f"join a node: orchestr start --address {info['address']}")
            return 0
        if proc.poll() is not None:
            return _fail(proc, log, f"the head exited with code {proc.returncode}")
        time.sleep(0.05)
    return _fail(proc, log, f"the head did not serve within {START_TIMEOUT_S:.0f} s")


def _start_node(args: argparse.Namespace, state_dir: Path) -> int:
    token = _cluster.cluster_token(state_dir)
    nodes = state_dir / _cluster.NODES_DIR
    nodes.mkdir(mode=0o700, parents=True, exist_ok=True)
    stem = f"node-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    log = state_dir / _cluster.LOGS_DIR / f"{stem}.log"
    events = state_dir / _cluster.LOGS_DIR / f"{stem}.jsonl"
    cmd = [sys.executable, "-m", "orchestr._node", "--head", args.address, "--log-level", "INFO"]
    cmd += ["--log-file", str(events)]
    if args.labels:
        cmd += ["--labels", args.labels]
    proc = _launch(cmd, log, {**os.environ, "ORCHESTR_TOKEN": token})
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in _tail(log, 50).splitlines():
            if line.startswith("node ") and " serving at " in line:
                node_id, address = line.split()[1], line.rsplit(" ", 1)[1]
                _cluster.write_json(
                    nodes / f"{proc.pid}.json",
                    {"pid": proc.pid, "node_id": node_id, "address": address, "head": args.address},
                )
                print(
                    f"node {node_id} serving at {address} (pid {proc.pid}), joined {args.address}"
                )
                print(f"logs: {log}")
                return 0
        if proc.poll() is not None:
            return _fail(proc, log, f"the node exited with code {proc.returncode}")
        time.sleep(0.05)
    return _fail(proc, log, f"the node did not join {args.address} within {START_TIMEOUT_S:.0f} s")


def _terminate(pid: int) -> bool:
    """SIGTERM ``pid``, then SIGKILL after STOP_TIMEOUT_S; True when it was running."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        if not _cluster.pid_alive(pid) or _zombie(pid):
            return True
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return True


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return False


def stop(args: argparse.Namespace) -> int:
    """Stop the node daemons started from this state directory, then its head: SIGTERM
    (each stops its workers and leaves), SIGKILL after STOP_TIMEOUT_S."""
    state_dir = _cluster.resolve_state_dir(args.state_dir)
    stopped = 0
    nodes = state_dir / _cluster.NODES_DIR
    for record in sorted(nodes.glob("*.json")) if nodes.is_dir() else []:
        try:
            pid = int(json.loads(record.read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"orchestr stop: skipping {record}: {exc}", file=sys.stderr)
            continue
        if _terminate(pid):
            print(f"stopped node daemon (pid {pid})")
            stopped += 1
        record.unlink(missing_ok=True)
    try:
        head = _cluster.read_head(state_dir)
    except OrchestrError as exc:
        print(f"orchestr stop: {exc}", file=sys.stderr)
        return 1
    if head is not None and _terminate(int(head["pid"])):
        print(f"stopped head at {head['address']} (pid {head['pid']})")
        stopped += 1
    (state_dir / _cluster.HEAD_FILE).unlink(missing_ok=True)
    if not stopped:
        print(f"no daemons running from {state_dir}")
    return 0


def head_address(args: argparse.Namespace, state_dir: Path) -> str | None:
    """``--address``, else ``$ORCHESTR_ADDRESS``, else the state directory's running head."""
    if getattr(args, "address", None):
        return str(args.address)
    if os.environ.get("ORCHESTR_ADDRESS"):
        return os.environ["ORCHESTR_ADDRESS"]
    info = _cluster.read_head(state_dir)
    return None if info is None else str(info["address"])


async def _status(address: str, token: str) -> dict[str, Any]:
    from orchestr import _grpc
    from orchestr.config import load_config
    from orchestr.protos import orchestr_pb2 as pb
    from orchestr.protos import orchestr_pb2_grpc as pb_grpc

    channel = _grpc.ControlChannel(address, token, load_config())
    try:
        stub = channel.stub(pb_grpc.HeadStub)
        nodes = (await channel.rpc(stub.ListNodes, pb.Empty())).nodes
        actors = (await channel.rpc(stub.ListActors, pb.Empty())).actors
    finally:
        await channel.aclose()
    return {
        "head": address,
        "nodes": [
            {
                "node_id": n.node_id,
                "address": n.address,
                "alive": n.alive,
                "total": dict(n.total.amounts),
                "free": dict(n.free.amounts),
                "labels": dict(n.labels),
                "last_heartbeat_unix": n.last_heartbeat_unix,
            }
            for n in nodes
        ],
        "actors": [
            {
                "actor_id": a.actor_id,
                "mesh": a.name,
                "rank": a.rank,
                "node_id": a.node_id,
                "state": a.state,
                "pid": a.pid,
            }
            for a in actors
        ],
    }


def status(args: argparse.Namespace) -> int:
    state_dir = _cluster.resolve_state_dir(args.state_dir)
    try:
        address = head_address(args, state_dir)
        if address is None:
            print(
                f"orchestr status: no head runs from {state_dir}; start one with "
                "orchestr start --head, or pass --address",
                file=sys.stderr,
            )
            return 1
        report = asyncio.run(_status(address, _cluster.cluster_token(state_dir)))
    except OrchestrError as exc:
        print(f"orchestr status: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"head {report['head']}")
    now = time.time()
    print(f"{len(report['nodes'])} node(s)")
    for n in report["nodes"]:
        cpu = f"cpu {n['free'].get('cpu', 0):g}/{n['total'].get('cpu', 0):g}"
        seen = now - n["last_heartbeat_unix"]
        state = "alive" if n["alive"] else "dead"
        print(f"  {n['node_id']}  {n['address']}  {state}  {cpu}  heartbeat {seen:.1f} s ago")
    print(f"{len(report['actors'])} actor(s)")
    for a in report["actors"]:
        print(f"  {a['actor_id']}  {a['mesh']}[{a['rank']}]  {a['state']}  on {a['node_id']}")
    return 0
