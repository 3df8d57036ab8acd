"""``orchestr start``, ``stop`` and ``status``: the head and node daemons of this host."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from orchestr._cluster import _daemon as _cluster
from orchestr._cluster._statedir import (
    check_private_file,
    is_daemon,
    private_dir,
    read_private,
    start_ticks,
)
from orchestr.errors import ConfigError, OrchestrError

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _launch(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start a daemon in a session of its own, its output appended to ``log`` (a private
    file, never reached through a link)."""
    private_dir(log.parent)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(log, flags, 0o600)
    except OSError as exc:
        raise ConfigError(
            f"cannot open the log {log}: {exc.strerror} (a link is not followed)"
        ) from None
    with os.fdopen(fd, "ab") as out:
        check_private_file(log, os.fstat(out.fileno()))
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _exec(cmd: list[str], env: dict[str, str]) -> NoReturn:
    """Become the daemon (``--block``): the same process, so a container's or a Slurm step's
    signals reach it and its exit ends the step."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, cmd, env)


def _fail(proc: subprocess.Popen[bytes], log: Path, what: str) -> int:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    print(f"orchestr start: {what}; its log ({log}) ends with:\n{_tail(log)}", file=sys.stderr)
    return 1


def host_address(given: str) -> str:
    """The address to bind: ``given``, or for ``auto`` the one this host's name resolves to."""
    return socket.gethostbyname(socket.gethostname()) if given == "auto" else given


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


def daemon_environ(args: argparse.Namespace) -> dict[str, str]:
    """This process's environment with ``--tls-cert/--tls-key/--tls-ca`` as ``ORCHESTR_TLS_*``
    (absolute paths, as the daemon's workers and submitted jobs run in other folders): a
    daemon, and every process it starts, reads its settings from there. Raises
    :class:`ConfigError` for a partial TLS set or a file that cannot be read."""
    from orchestr.config import load_config

    env = dict(os.environ)
    for name in ("cert", "key", "ca"):
        var = f"ORCHESTR_TLS_{name.upper()}"
        path = getattr(args, f"tls_{name}", None) or env.get(var)
        if path:
            env[var] = os.path.abspath(path)
    load_config(env)
    return env


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
    if os.environ.get("ORCHESTR_TOKEN"):  # the daemon serves with that one
        private_dir(state_dir)
    else:
        _cluster.ensure_token(state_dir)
    log = state_dir / _cluster.LOGS_DIR / "head.log"
    cmd = [sys.executable, "-m", "orchestr._cluster._daemon", "head", "--state-dir", str(state_dir)]
    cmd += ["--host", host_address(args.host or "127.0.0.1"), "--port", str(args.port)]
    if args.ocs_driver and not args.fabric:
        print("orchestr start: --ocs-driver drives the OCS of a --fabric PLAN", file=sys.stderr)
        return 2
    if args.fabric:
        from orchestr._cluster._fabric import open_fabric

        # a bad plan or driver is refused here, with what is wrong
        open_fabric(Path(args.fabric), args.ocs_driver or "sim")
        cmd += ["--fabric", str(Path(args.fabric).resolve())]
        cmd += ["--ocs-driver", args.ocs_driver or "sim"]
    env = daemon_environ(args)
    if args.block:
        _exec(cmd, env)
    proc = _launch(cmd, log, env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        info = _cluster.read_head(state_dir)
        if info is not None and info.get("pid") == proc.pid:
            print(f"head running at {info['address']} (pid {proc.pid})")
            print(f"token: {state_dir / _cluster.TOKEN_FILE} (mode 0600)")
            print(f"logs: {log}")
            if info.get("dashboard_address"):
                scheme = "https" if env.get("ORCHESTR_TLS_CERT") else "http"
                print(
                    f"dashboard: {scheme}://{info['dashboard_address']}/ (log in with "
                    f"{state_dir / 'metrics-token'})"
                )
            print(f"join a node: orchestr start --address {info['address']}")
            if env.get("ORCHESTR_TLS_CA"):
                print(
                    "mutual TLS: nodes and clients need --tls-* or ORCHESTR_TLS_CERT/KEY/CA, "
                    f"with certificates signed by {env['ORCHESTR_TLS_CA']}"
                )
            return 0
        if proc.poll() is not None:
            return _fail(proc, log, f"the head exited with code {proc.returncode}")
        time.sleep(0.05)
    return _fail(proc, log, f"the head did not serve within {START_TIMEOUT_S:.0f} s")


def _start_node(args: argparse.Namespace, state_dir: Path) -> int:
    if not 0 <= args.port <= 65535:
        print(f"orchestr start: --port must be in 0..65535, got {args.port}", file=sys.stderr)
        return 2
    token = _cluster.cluster_token(state_dir)
    cmd = [
        sys.executable,
        "-m",
        "orchestr._cluster._node",
        "--head",
        args.address,
        "--log-level",
        "INFO",
    ]
    if args.port:
        cmd += ["--port", str(args.port)]
    if args.labels:
        cmd += ["--labels", args.labels]
    env = {**daemon_environ(args), "ORCHESTR_TOKEN": token}
    if args.host:  # where it and its workers listen
        env["ORCHESTR_BIND_HOST"] = host_address(args.host)
    if args.block:  # its log on this terminal, and nothing in the state directory
        _exec(cmd, env)
    nodes = state_dir / _cluster.NODES_DIR
    private_dir(state_dir)  # made private when the token came from the environment
    nodes.mkdir(mode=0o700, exist_ok=True)
    stem = f"node-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    log = state_dir / _cluster.LOGS_DIR / f"{stem}.log"
    events = state_dir / _cluster.LOGS_DIR / f"{stem}.jsonl"
    cmd += ["--log-file", str(events)]
    proc = _launch(cmd, log, env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in _tail(log, 50).splitlines():
            if line.startswith("node ") and " serving at " in line:
                node_id, address = line.split()[1], line.rsplit(" ", 1)[1]
                record = {
                    "pid": proc.pid,
                    "start_ticks": start_ticks(proc.pid),
                    "node_id": node_id,
                    "address": address,
                    "head": args.address,
                }
                _cluster.write_json(nodes / f"{proc.pid}.json", record)
                print(
                    f"node {node_id} serving at {address} (pid {proc.pid}), joined {args.address}"
                )
                print(f"logs: {log}")
                return 0
        if proc.poll() is not None:
            return _fail(proc, log, f"the node exited with code {proc.returncode}")
        time.sleep(0.05)
    return _fail(proc, log, f"the node did not join {args.address} within {START_TIMEOUT_S:.0f} s")


def _terminate(pid: int, ticks: int) -> bool:
    """SIGTERM ``pid`` (started at ``ticks``: checked by the caller), then SIGKILL after
    STOP_TIMEOUT_S if it is still that process; True when it was running."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        if not _cluster.pid_alive(pid):
            return True
        time.sleep(0.05)
    if start_ticks(pid) == ticks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return True


def stop(args: argparse.Namespace) -> int:
    """Stop the node daemons started from this state directory, then its head: SIGTERM
    (each stops its workers and leaves), SIGKILL after STOP_TIMEOUT_S."""
    state_dir = _cluster.resolve_state_dir(args.state_dir)
    stopped = 0
    nodes = state_dir / _cluster.NODES_DIR
    try:
        head = _cluster.read_head(state_dir)  # checks the state directory is ours, first
    except OrchestrError as exc:
        print(f"orchestr stop: {exc}", file=sys.stderr)
        return 1
    for record in sorted(nodes.glob("*.json")) if nodes.is_dir() else []:
        try:
            info = json.loads(read_private(record))
            pid, ticks = info["pid"], info.get("start_ticks")
        except (OSError, ValueError, KeyError, TypeError, OrchestrError) as exc:
            print(f"orchestr stop: skipping {record}: {exc}", file=sys.stderr)
            continue
        if not is_daemon(pid, ticks, _cluster.NODE_MODULE):
            if isinstance(pid, int) and pid > 0 and _cluster.pid_alive(pid):
                print(
                    f"orchestr stop: pid {pid} in {record} is not the node daemon recorded "
                    f"there (another process has that pid now); left alone",
                    file=sys.stderr,
                )
        elif _terminate(pid, ticks):
            print(f"stopped node daemon (pid {pid})")
            stopped += 1
        record.unlink(missing_ok=True)
    if head is not None and _terminate(int(head["pid"]), int(head["start_ticks"])):
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


def actor_line(a: dict[str, Any]) -> str:
    """One actor of ``orchestr status``: a stopped worker (SIGSTOP) is alive but serves
    nothing, and says so."""
    state = f"{a['state']} (suspended: its process is stopped)" if a["suspended"] else a["state"]
    return (
        f"  {a['actor_id']}  {a['mesh']}[{a['rank']}]  {state}  on {a['node_id']}  "
        f"pid {a['pid']}  restarts {a['restarts']}/{a['max_restarts']}"
    )


async def _status(address: str, token: str) -> dict[str, Any]:
    from orchestr._control import _grpc
    from orchestr._control._head_client import HeadClient
    from orchestr.config import load_config

    channel = _grpc.ControlChannel(address, token, load_config())
    try:
        head = HeadClient(channel)
        nodes = await head.nodes()
        actors = await head.actors()
        try:
            jobs: list[Any] | None = await head.jobs()
        except ConfigError:  # an embedded cluster's head takes no submitted jobs
            jobs = None
    finally:
        await channel.aclose()
    meshes: dict[str, dict[str, Any]] = {}
    for a in actors:
        mesh = meshes.setdefault(
            a.mesh_id, {"mesh_id": a.mesh_id, "name": a.name, "members": 0, "states": {}}
        )
        mesh["members"] += 1
        mesh["states"][a.state] = mesh["states"].get(a.state, 0) + 1
    return {
        "head": address,
        "nodes": [
            {
                "node_id": n.node_id,
                "address": n.address,
                "alive": n.alive,
                "total": dict(n.total),
                "free": dict(n.free),
                "labels": dict(n.labels),
                "last_heartbeat_unix": n.last_heartbeat_unix,
                "transports": list(n.transports),
                "devices": list(n.devices),
                "workers": n.workers,
            }
            for n in nodes
        ],
        "meshes": list(meshes.values()),
        "actors": [
            {
                "actor_id": a.actor_id,
                "mesh": a.name,
                "rank": a.rank,
                "node_id": a.node_id,
                "mesh_id": a.mesh_id,
                "state": a.state,
                "pid": a.pid,
                "restarts": a.restarts,
                "max_restarts": a.max_restarts,
                "suspended": a.suspended,
            }
            for a in actors
        ],
        "jobs": None
        if jobs is None
        else [
            {
                "job_id": j.job_id,
                "entrypoint": j.entrypoint,
                "state": j.state,
                "exit_code": j.exit_code,
                "reason": j.reason,
            }
            for j in jobs
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
        print(
            f"  {n['node_id']}  {n['address']}  {state}  {cpu}  workers {n['workers']}  "
            f"heartbeat {seen:.1f} s ago"
        )
        offers = ", ".join(n["transports"]) or "none"
        print(f"      transports {offers}; devices {', '.join(n['devices']) or 'none'}")
    live = [m for m in report["meshes"] if set(m["states"]) & {"starting", "alive", "restarting"}]
    print(f"{len(live)} live mesh(es) of {len(report['meshes'])}")
    for m in live:
        states = ", ".join(f"{k} {v}" for k, v in sorted(m["states"].items()))
        print(f"  {m['mesh_id']}  {m['name']}  {m['members']} member(s): {states}")
    current = [a for a in report["actors"] if a["state"] in ("starting", "alive", "restarting")]
    print(f"{len(current)} live actor(s) of {len(report['actors'])}")
    for a in current:
        print(actor_line(a))
    if report["jobs"] is not None:
        print(f"{len(report['jobs'])} job(s)")
        for j in report["jobs"]:
            print(f"  {j['job_id']}  {j['state']}  exit {j['exit_code']}  {j['entrypoint']}")
    return 0
