"""``orchestr submit``, ``jobs``, ``logs`` and ``job stop``: jobs run by the cluster's head."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import json
import os
import sys
import time
import zipfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from orchestr._cluster import _daemon as _cluster
from orchestr._cluster._submitted import MAX_PACKAGE_BYTES
from orchestr.errors import ConfigError, ControlPlaneError, OrchestrError

from ._daemons import head_address

if TYPE_CHECKING:
    from orchestr._control._convert import JobInfo
    from orchestr._control._head_client import HeadClient

T = TypeVar("T")

#: Folders a working directory's package leaves out.
SKIPPED = {".git", "__pycache__", ".venv", "venv", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
FOLLOW_POLL_S = 0.2
#: How long ``submit`` and ``logs --follow`` wait for a head that went away (it may restart).
FOLLOW_RECONNECT_S = 60.0


def package(folder: Path, *, dotfiles: bool = False, keep: Path | None = None) -> bytes:
    """``folder`` as a zip, without :data:`SKIPPED` folders, links, what its ``.gitignore``
    files ignore (git's rules, each file for the folder it is in), and, unless ``dotfiles``,
    files and folders whose names start with a dot (``.env``, credentials, a state
    directory's token). ``keep`` (the entrypoint) goes in whatever the rules say. Prints to
    stderr how many were left out. Raises :class:`ConfigError` once it grows past the head's
    limit."""
    import pathspec

    folder = folder.resolve()
    buf = io.BytesIO()
    left_out = {"dotfiles": 0, ".gitignore": 0}
    rules: list[tuple[Path, pathspec.GitIgnoreSpec]] = []  # (folder, its .gitignore)

    def ignored(path: Path, is_dir: bool) -> bool:
        for base, spec in rules:
            if base == path or base not in path.parents:
                continue
            rel = path.relative_to(base).as_posix() + ("/" if is_dir else "")
            if spec.match_file(rel):
                return True
        return False

    def skip(path: Path, is_dir: bool) -> bool:
        if path == keep:
            return False
        if not dotfiles and path.name.startswith("."):
            left_out["dotfiles"] += 1
            return True
        if ignored(path, is_dir):
            left_out[".gitignore"] += 1
            return True
        return False

    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        for root, dirs, files in os.walk(folder):
            here = Path(root)
            gitignore = here / ".gitignore"
            if gitignore.is_file() and not gitignore.is_symlink():
                lines = gitignore.read_text(errors="replace").splitlines()
                rules.append((here, pathspec.GitIgnoreSpec.from_lines(lines)))
            dirs[:] = sorted(
                d for d in dirs if d not in SKIPPED and not skip(here / d, is_dir=True)
            )
            for name in sorted(files):
                path = here / name
                if path.is_symlink() or not path.is_file() or skip(path, is_dir=False):
                    continue
                archive.write(path, path.relative_to(folder).as_posix())
                if buf.tell() > MAX_PACKAGE_BYTES:
                    raise ConfigError(
                        f"the working directory {folder} packs to more than "
                        f"{MAX_PACKAGE_BYTES >> 20} MiB (the limit); leave data out of it or "
                        "point --working-dir at less"
                    )
    if any(left_out.values()):
        print(
            f"left out of the package: {left_out['dotfiles']} dotfiles (--include-dotfiles "
            f"ships them), {left_out['.gitignore']} ignored by .gitignore",
            file=sys.stderr,
        )
    return buf.getvalue()


def _connect(args: argparse.Namespace) -> tuple[str, str]:
    state_dir = _cluster.resolve_state_dir(args.state_dir)
    address = head_address(args, state_dir)
    if address is None:
        raise ConfigError(
            f"no cluster: no head runs from {state_dir}; start one (orchestr start --head) or "
            "pass --address"
        )
    return address, _cluster.cluster_token(state_dir)


def _call(args: argparse.Namespace, fn: Callable[[HeadClient], Awaitable[T]]) -> T:
    """Run ``fn(head)`` against the head ``args`` name."""
    from orchestr._control._grpc import ControlChannel
    from orchestr._control._head_client import HeadClient
    from orchestr.config import load_config

    address, token = _connect(args)

    async def go() -> T:
        channel = ControlChannel(address, token, load_config())
        try:
            return await fn(HeadClient(channel))
        finally:
            await channel.aclose()

    return asyncio.run(go())


async def _follow(head: HeadClient, job_id: str, follow: bool) -> JobInfo:
    """Copy the job's output to stdout from the start; with ``follow``, until it ends.
    Returns the job's last state."""
    offset = 0
    lost_at: float | None = None
    while True:
        try:
            data, next_offset, job = await head.job_logs(job_id, offset)
        except ControlPlaneError as exc:
            # The head went away. A head daemon that restarts keeps the job (it runs on),
            # so keep asking for a while before giving up.
            now = time.monotonic()
            if not follow or (lost_at is not None and now - lost_at > FOLLOW_RECONNECT_S):
                raise
            if lost_at is None:
                lost_at = now
                print(f"orchestr: lost the head ({exc}); waiting for it", file=sys.stderr)
            await asyncio.sleep(FOLLOW_POLL_S)
            continue
        if lost_at is not None:
            print("orchestr: the head is back", file=sys.stderr)
            lost_at = None
        if data:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
            offset = next_offset
            continue
        if not follow or job.state != "running":
            return job
        await asyncio.sleep(FOLLOW_POLL_S)


def submit(args: argparse.Namespace) -> int:
    job = Path(args.job)
    folder = Path(args.working_dir) if args.working_dir else job.parent
    try:
        if not job.is_file() or job.suffix != ".py":
            raise ConfigError(f"no job file {job} (a .py file)")
        try:
            entry = job.resolve().relative_to(folder.resolve())
        except ValueError:
            raise ConfigError(
                f"the job {job} is not inside the working directory {folder}"
            ) from None
        data = package(folder, dotfiles=args.include_dotfiles, keep=job.resolve())

        async def go(head: HeadClient) -> int:
            info = await head.submit_job(data, entry.as_posix(), args.job_args)
            print(f"submitted {info.job_id} ({len(data)} bytes from {folder})", file=sys.stderr)
            if args.no_wait:
                print(info.job_id)
                return 0
            last = await _follow(head, info.job_id, follow=True)
            why = f": {last.reason}" if last.reason else ""
            print(f"{info.job_id} {last.state} (exit code {last.exit_code}){why}", file=sys.stderr)
            code: int = last.exit_code if last.state != "stopped" else 1
            return code

        return _call(args, go)
    except OrchestrError as exc:
        print(f"orchestr submit: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def jobs(args: argparse.Namespace) -> int:
    async def go(head: HeadClient) -> list[dict[str, Any]]:
        return [dataclasses.asdict(j) for j in await head.jobs()]

    try:
        listed = _call(args, go)
    except OrchestrError as exc:
        print(f"orchestr jobs: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(listed))
        return 0
    for j in sorted(listed, key=lambda j: j["submitted_unix"]):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j["submitted_unix"]))
        print(
            f"{j['job_id']}  {j['state']:9s}  exit {j['exit_code']:3d}  {when}  {j['entrypoint']}"
        )
    if not listed:
        print("no jobs")
    return 0


async def _daemon_log(head: HeadClient, name: str | None, node: str) -> None:
    """The daemon logs of the head's host, or of ``node``'s host: their names, or one of them
    from the start."""
    if not name:
        _, _, names = await head.daemon_log(node_id=node)
        print("\n".join(names) if names else "no daemon logs")
        return
    offset = 0
    while True:
        data, offset, _ = await head.daemon_log(name, offset, node)
        if not data:
            return
        sys.stdout.buffer.write(data)


def logs(args: argparse.Namespace) -> int:
    try:
        if args.daemon is not None or args.job_id is None:
            name = args.daemon or None
            _call(args, lambda head: _daemon_log(head, name, args.node or ""))
            sys.stdout.flush()
            return 0
        _call(args, lambda head: _follow(head, args.job_id, args.follow))
    except OrchestrError as exc:
        print(f"orchestr logs: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def job_stop(args: argparse.Namespace) -> int:
    async def go(head: HeadClient) -> JobInfo:
        return await head.stop_job(args.job_id)

    try:
        info = _call(args, go)
    except OrchestrError as exc:
        print(f"orchestr job stop: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"{info.job_id} {info.state} (exit code {info.exit_code})")
    return 0


def add_parsers(sub: Any, state_dir_help: str) -> None:
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--address", metavar="HOST:PORT", help="the head (default: as for run)")
        p.add_argument("--state-dir", help=state_dir_help)

    p = sub.add_parser("submit", help="run a job on the cluster; streams its output")
    common(p)
    p.add_argument("--working-dir", help="folder shipped with the job (default: the job's)")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return")
    p.add_argument(
        "--include-dotfiles",
        action="store_true",
        help="ship files and folders whose names start with a dot (left out by default)",
    )
    p.add_argument("job", help="the job file, inside the working directory")
    p.add_argument("job_args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments")
    p.set_defaults(func=submit)
    p = sub.add_parser("jobs", help="the cluster's submitted jobs")
    common(p)
    p.add_argument("--json", action="store_true", help="print one JSON list")
    p.set_defaults(func=jobs)
    p = sub.add_parser("logs", help="a submitted job's output, or the daemons' logs")
    common(p)
    p.add_argument("--follow", "-f", action="store_true", help="until the job ends")
    p.add_argument(
        "--daemon",
        nargs="?",
        const="",
        metavar="NAME",
        help="a daemon's JSON-lines log through the head (head.jsonl, node-...jsonl); "
        "without NAME, list them",
    )
    p.add_argument(
        "--node",
        metavar="NODE_ID",
        help="with --daemon: the logs on that node's host (orchestr status lists node ids); "
        "default: the head's host",
    )
    p.add_argument("job_id", nargs="?")
    p.set_defaults(func=logs)
    p = sub.add_parser("job", help="act on a submitted job")
    job_sub = p.add_subparsers(dest="job_command", required=True)
    s = job_sub.add_parser("stop", help="stop a running job (SIGTERM, then SIGKILL)")
    common(s)
    s.add_argument("job_id")
    s.set_defaults(func=job_stop)
