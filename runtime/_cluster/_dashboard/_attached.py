"""The event logs of jobs whose controllers run elsewhere (``orchestr run --address HEAD``,
``oc.connect``): each controller sends its log's new lines to the head (the ``JobEvents`` RPC,
:meth:`AttachedLogs.take`), which keeps them in a private folder of its own, where the
dashboard reads them as it reads a local job's (:mod:`._tail`).

Everything is bounded: a request's bytes, each log's (``Config.event_log_max_bytes``, past
which the head keeps no more of that log), and the jobs kept (past :data:`MAX_JOBS`, the
oldest ended one goes, or a new job is refused while all run). Requests carry whole lines at
the offset the controller's log has them; one sent again (its reply lost) is taken once. The
files are the head's own: made in a ``0700`` folder, opened without following links.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shutil
import tempfile
from typing import TYPE_CHECKING

from orchestr.errors import ConfigError

if TYPE_CHECKING:
    from ._server import DashboardServer, WatchedJob

__all__ = ["MAX_JOBS", "MAX_REQUEST_BYTES", "STATES", "AttachedLogs"]

#: A job id as a controller's session makes it (``_job._session``).
JOB_ID = re.compile(r"job-[0-9a-f]{8}")
#: What a controller may say of its job.
STATES = ("running", "succeeded", "failed")
#: Most bytes one request may carry.
MAX_REQUEST_BYTES = 1 << 20
#: Most jobs kept at once.
MAX_JOBS = 256


@dataclasses.dataclass
class _Log:
    watched: WatchedJob
    path: str
    size: int = 0
    full: bool = False


class AttachedLogs:
    """Attached jobs' event logs for ``dashboard``, each kept up to ``max_bytes``."""

    def __init__(self, dashboard: DashboardServer, max_bytes: int) -> None:
        self.dashboard = dashboard
        self.max_bytes = max_bytes
        self._root: str | None = None  # made at the first job
        self._logs: dict[str, _Log] = {}
        self._lock = asyncio.Lock()  # one request at a time

    async def take(self, job_id: str, title: str, state: str, offset: int, data: bytes) -> int:
        """Keep ``data`` (whole lines) as job ``job_id``'s log from byte ``offset`` and its
        ``state``; returns where the next request should start. The books are kept on the
        loop (the dashboard's pages read them there), the bytes written in a thread; one
        request at a time. Raises :class:`ConfigError` for a malformed request, or a new job
        while :data:`MAX_JOBS` run."""
        if not JOB_ID.fullmatch(job_id):
            raise ConfigError(f"a job id is job- and 8 hex digits, got {job_id[:80]!r}")
        if state not in STATES:
            raise ConfigError(f"a job's state is one of {', '.join(STATES)}, got {state[:40]!r}")
        if offset < 0:
            raise ConfigError(f"an offset is 0 or more, got {offset}")
        if len(data) > MAX_REQUEST_BYTES:
            raise ConfigError(f"at most {MAX_REQUEST_BYTES} bytes a request, got {len(data)}")
        if data and not data.endswith(b"\n"):
            raise ConfigError("an event log is sent in whole lines")
        async with self._lock:
            log = self._logs.get(job_id) or self._add(job_id, title)
            log.watched.state = state
            if offset > log.size:
                return log.size  # a gap: the controller sends again from what the head holds
            new = data[log.size - offset :]
            if log.full or log.size + len(new) > self.max_bytes:
                log.full = True  # past the bound the head keeps no more of this log
                return offset + len(data)
            if new:
                await asyncio.to_thread(_append, log.path, new)
                log.size += len(new)
            return log.size

    def _add(self, job_id: str, title: str) -> _Log:
        if len(self._logs) >= MAX_JOBS:
            ended = [k for k, v in self._logs.items() if v.watched.state != "running"]
            if not ended:
                raise ConfigError(f"the head keeps the event logs of {MAX_JOBS} running jobs")
            self._forget(ended[0])
        if self._root is None:
            self._root = tempfile.mkdtemp(prefix="orchestr-attached-")  # 0700
        folder = os.path.join(self._root, job_id)
        os.mkdir(folder, 0o700)
        path = os.path.join(folder, "events.jsonl")
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        watched = self.dashboard.watch_job(job_id, title[:200], folder)
        log = self._logs[job_id] = _Log(watched, path)
        return log

    def _forget(self, job_id: str) -> None:
        log = self._logs.pop(job_id)
        self.dashboard.forget_job(job_id)
        shutil.rmtree(os.path.dirname(log.path), ignore_errors=True)

    def close(self) -> None:
        """Remove every log kept. Idempotent."""
        for job_id in list(self._logs):
            self.dashboard.forget_job(job_id)
        self._logs.clear()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None


def _append(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
