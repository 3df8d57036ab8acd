"""Cluster mode on one host's state directory: the head daemon, where daemons leave their
address and pid, and the cluster token. A job attaches to a running cluster through
:func:`orchestr._job._session.job_session` (``orchestr.connect``, ``orchestr.run(address=)``).

A state directory (``--state-dir``, else ``ORCHESTR_STATE_DIR``, else ``~/.orchestr``) holds:

- ``token``: the cluster's shared secret, created once with mode 0600 (a token file others can
  read is refused, not used);
- ``head.json``: the running head's address and pid, written atomically once it serves and
  removed when it stops;
- ``nodes/<pid>.json``: each node daemon started from here;
- ``logs/``: the daemons' output;
- ``head.sqlite``: the head's state (nodes, meshes, actors, jobs and their packages), in WAL
  mode, so a head that restarts (even after SIGKILL) carries on where it was; see
  :mod:`._headstore`;
- ``jobs/``: submitted jobs' working directories and output.

``python -m orchestr._cluster._daemon head --state-dir DIR [--host H] [--port P]`` is the head daemon
``orchestr start --head`` launches; it serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

from orchestr._log import RotatingFile, configure_logging
from orchestr._loop import run_loop
from orchestr.config import Config, load_config
from orchestr.errors import ConfigError, OrchestrError

from ._fabric import open_fabric
from ._head import HeadService
from ._headstore import STORE_FILE, HeadStore
from ._statedir import (
    HeadLock,
    check_private_dir,
    is_daemon,
    private_dir,
    proc_stat,
    read_private,
    start_ticks,
)
from ._submitted import JobManager

__all__ = [
    "HEAD_FILE",
    "TOKEN_FILE",
    "ensure_token",
    "read_head",
    "read_token",
    "resolve_state_dir",
]

STATE_DIR_ENV = "ORCHESTR_STATE_DIR"
TOKEN_FILE = "token"
#: The token a scrape of the head's /metrics presents: good for reading metrics, nothing else.
METRICS_TOKEN_FILE = "metrics-token"
HEAD_FILE = "head.json"
#: The modules the daemons run as (``python -m ...``), checked before one is signalled.
HEAD_MODULE = "orchestr._cluster._daemon"
NODE_MODULE = "orchestr._cluster._node"
NODES_DIR = "nodes"
LOGS_DIR = "logs"


def resolve_state_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """``path``, else ``$ORCHESTR_STATE_DIR``, else ``~/.orchestr``."""
    chosen = path or os.environ.get(STATE_DIR_ENV) or Path.home() / ".orchestr"
    return Path(chosen).expanduser()


def ensure_token(state_dir: Path, name: str = TOKEN_FILE) -> str:
    """The cluster token (or another, by file ``name``) under ``state_dir``, created (mode
    0600) when there is none. Raises :class:`ConfigError` for a token file that others can
    read or that is empty."""
    private_dir(state_dir)
    path = state_dir / name
    if not os.path.lexists(path):
        # written whole under a name of its own, then linked into place: a reader never sees
        # it half written, and of two processes making it at once one link wins
        draft = state_dir / f".{name}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
            with contextlib.suppress(FileExistsError):
                os.link(draft, path)
        finally:
            draft.unlink()
    return read_token(state_dir, name)


def read_token(state_dir: Path, name: str = TOKEN_FILE) -> str:
    """The token in ``state_dir/token`` (or ``name``). Raises :class:`ConfigError` when it is
    missing, empty, a link, or not a private file of this user's in a private directory of
    this user's."""
    path = state_dir / name
    try:
        if os.path.lexists(state_dir):
            check_private_dir(state_dir)
        data = read_private(path)
    except FileNotFoundError:
        raise ConfigError(
            f"no cluster token at {path}: start a head there (orchestr start --head) or set "
            "ORCHESTR_TOKEN"
        ) from None
    token = data.decode(errors="replace").strip()
    if not token:
        raise ConfigError(f"the token file {path} is empty")
    return token


def cluster_token(state_dir: Path) -> str:
    """``$ORCHESTR_TOKEN`` when set, else the state directory's token."""
    return os.environ.get("ORCHESTR_TOKEN") or read_token(state_dir)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not is_zombie(pid)


def is_zombie(pid: int) -> bool:
    return proc_stat(pid)[:1] == [b"Z"]


def read_head(state_dir: Path) -> dict[str, Any] | None:
    """What the running head of ``state_dir`` wrote (``address``, ``pid``, ...), or ``None``
    when none runs (no file, or its process is gone)."""
    path = state_dir / HEAD_FILE
    if not os.path.lexists(state_dir):
        return None
    check_private_dir(state_dir)
    try:
        info = json.loads(read_private(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(info, dict) or not isinstance(info.get("address"), str):
        raise ConfigError(f"{path} does not describe a head: {info!r}")
    # only while its process is still the head that wrote it (not a recycled pid)
    if not is_daemon(info.get("pid"), info.get("start_ticks"), HEAD_MODULE):
        return None
    return info


def write_json(path: Path, value: dict[str, Any]) -> None:
    """Write ``value`` to ``path`` atomically (a private temporary file, then a rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # left by a process of this pid that died mid-write
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(value))
    os.replace(tmp, path)


def _open_head(token: str, config: Config, host: str, port: int, store: HeadStore) -> HeadService:
    """The head service on ``port``; with port 0, on the port the previous head of this state
    directory had on ``host``: its nodes and jobs look for it there, and a head that quietly
    moved elsewhere would leave them talking to whatever holds that port now. So if the port is
    taken, the head does not start (raises :class:`ConfigError`); ``--port`` moves it."""
    previous = store.get_meta("address") or ""
    prev_host, _, prev_port = previous.rpartition(":")
    if port == 0 and prev_host == host and prev_port.isdigit():
        try:
            return HeadService(token, config, port=int(prev_port), store=store)
        except RuntimeError as exc:  # grpc cannot bind it
            raise ConfigError(
                f"the head's address {previous} is taken by another process ({exc}); the "
                f"cluster's nodes and jobs look for the head there, so it must not move "
                f"silently. Stop whatever holds the port, or move the head with "
                f"`orchestr start --head --port PORT` and start the nodes again against it"
            ) from None
    return HeadService(token, config, port=port, store=store)


async def serve_head(
    state_dir: Path,
    host: str,
    port: int,
    fabric_plan: Path | None = None,
    ocs_driver: str = "sim",
) -> None:
    """Run the head daemon until SIGTERM or SIGINT; ``head.json`` says where it is meanwhile.
    Its state lives in ``head.sqlite``: a head started again on the same state directory takes
    up the nodes, actors and jobs of the one before. With ``fabric_plan`` it runs the fabric
    manager, its OCS driven by ``ocs_driver`` (see :func:`open_fabric`)."""
    # one head per state directory, held for this one's life; taken first, so a second head
    # started at the same moment is told so rather than finding a token half made
    lock = HeadLock(private_dir(state_dir))
    # given (a Kubernetes Secret's, shared with the nodes) or the state directory's own
    token = os.environ.get("ORCHESTR_TOKEN") or ensure_token(state_dir)
    metrics_token = os.environ.get("ORCHESTR_METRICS_TOKEN") or ensure_token(
        state_dir, METRICS_TOKEN_FILE
    )
    # a daemon head serves its dashboard (on a free port unless told one)
    config = load_config(bind_host=host, metrics_token=metrics_token)
    if "ORCHESTR_DASHBOARD_PORT" not in os.environ:
        config = dataclasses.replace(config, dashboard_port=0)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    head_file = state_dir / HEAD_FILE
    fabric = open_fabric(fabric_plan, ocs_driver) if fabric_plan is not None else None
    store = HeadStore(state_dir / STORE_FILE)
    try:
        async with _open_head(token, config, host, port, store) as head:
            store.set_meta("address", head.address)
            head.jobs = JobManager(
                state_dir, head.address, token, store, retention=config.job_retention
            )
            head.log_dir = state_dir / LOGS_DIR
            head.fabric = fabric
            write_json(
                head_file,
                {
                    "address": head.address,
                    "pid": os.getpid(),
                    "start_ticks": start_ticks(os.getpid()),
                    "started_unix": time.time(),
                    "metrics_address": head.metrics_address,
                    "dashboard_address": head.dashboard_address,
                },
            )
            print(f"head serving at {head.address}", flush=True)
            await stop.wait()
    finally:
        store.close()
        lock.release()
        with contextlib.suppress(FileNotFoundError):
            info = json.loads(head_file.read_text())
            if info.get("pid") == os.getpid():
                head_file.unlink()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestr._cluster._daemon")
    sub = parser.add_subparsers(dest="role", required=True)
    head = sub.add_parser("head", help="serve the head daemon until SIGTERM")
    head.add_argument("--state-dir", required=True)
    head.add_argument("--host", default="127.0.0.1")
    head.add_argument("--port", type=int, default=0)
    head.add_argument("--log-level", default="INFO")
    head.add_argument("--fabric", help="run the fabric manager for this cabling plan")
    head.add_argument("--ocs-driver", default="sim", help="sim, or netns:TAG (with --fabric)")
    args = parser.parse_args(argv)
    state_dir = resolve_state_dir(args.state_dir)
    (state_dir / LOGS_DIR).mkdir(mode=0o700, parents=True, exist_ok=True)
    log_file = RotatingFile(str(state_dir / LOGS_DIR / "head.jsonl"))
    configure_logging(json=True, stream=log_file, level=args.log_level)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    try:
        fabric = Path(args.fabric) if args.fabric else None
        run_loop(serve_head(state_dir, args.host, args.port, fabric, args.ocs_driver))
    except OrchestrError as exc:
        print(f"orchestr head: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
