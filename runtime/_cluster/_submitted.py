"""Submitted jobs, on the head daemon's host: unpack a working directory, run the job's
controller against the cluster, keep its output, report and stop it.

A job's record and its package (the zip as it arrived) live in the head's database
(:class:`~._headstore.HeadStore`); its files in ``<state dir>/jobs/<job id>/``: ``wd/`` the
unpacked working directory, ``output.log`` what the controller printed, ``exit_code`` how it
ended. The controller is ``python -m orchestr.cli run --address HEAD ENTRYPOINT ARGS...`` in
``wd/``, in a session of its own, with the cluster token in its environment; a small shell
around it writes ``exit_code``, so a head that restarts while the job runs can adopt it (it is
not the controller's parent any more) and still learn how it ended. Only an
authenticated client reaches :meth:`JobManager.submit` (every head RPC checks the token);
nothing from the package is deserialised: it is unzipped, with every member's path checked to
stay inside ``wd/``, and run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import os
import secrets
import shutil
import signal
import stat
import sys
import time
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import structlog

from orchestr.errors import ConfigError
from orchestr.tasks import TaskOwner

from ._headstore import HeadStore
from ._statedir import start_ticks

__all__ = ["JobManager", "JobRecord", "check_package"]

log = structlog.get_logger("orchestr.jobs")

#: Largest package (zip bytes), largest unpacked size and most files a job may bring.
MAX_PACKAGE_BYTES = 32 << 20
MAX_UNPACKED_BYTES = 256 << 20
MAX_MEMBERS = 10_000
#: Seconds unpacking a package may take (it runs off the head's event loop, in a thread).
UNPACK_TIMEOUT_S = 60.0
#: Packages unpacked at once; more submissions wait their turn.
UNPACKING_AT_ONCE = 2
STOP_GRACE_S = 10.0
DEFAULT_LOG_CHUNK = 1 << 20
#: Runs the controller (``"$@"``) and writes its exit status to the file named by ``$0``.
_RECORD_EXIT = 'rc=0; "$@" || rc=$?; echo $rc > "$0.tmp" && mv "$0.tmp" "$0"; exit $rc'


@dataclasses.dataclass
class JobRecord:
    job_id: str
    entrypoint: str
    args: list[str]
    state: str = "running"  # running, succeeded, failed, stopped
    exit_code: int = 0
    submitted_unix: float = dataclasses.field(default_factory=time.time)
    ended_unix: float = 0.0
    pid: int = 0
    #: The controller's start time (clock ticks since boot), telling it from a later process
    #: that reuses its pid.
    pid_start: int = 0
    #: Why it ended, when its exit code alone does not say (e.g. it ended while no head ran).
    reason: str = ""
    #: Its folder and package were removed (see :meth:`JobManager.prune`).
    pruned: bool = False


def process_start(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot, from ``/proc``), 0 if it is gone."""
    return start_ticks(pid) or 0


def check_package(package: bytes, entrypoint: str) -> zipfile.ZipFile:
    """Open ``package`` as a zip and check it: within the size limits, every member's path
    relative and inside the root, no links, and ``entrypoint`` a ``.py`` file in it. Raises
    :class:`ConfigError` saying what is wrong."""
    if len(package) > MAX_PACKAGE_BYTES:
        raise ConfigError(
            f"the job's package is {len(package)} bytes; at most {MAX_PACKAGE_BYTES} are taken "
            "(leave data out of the working directory, or point --working-dir at less)"
        )
    try:
        archive = zipfile.ZipFile(io.BytesIO(package))
    except zipfile.BadZipFile as exc:
        raise ConfigError(f"the job's package is not a zip file: {exc}") from None
    members = archive.infolist()
    if len(members) > MAX_MEMBERS:
        raise ConfigError(
            f"the job's package holds {len(members)} files; at most {MAX_MEMBERS} are taken"
        )
    total = 0
    names = set()
    for info in members:
        path = PurePosixPath(info.filename)
        if path.is_absolute() or ".." in path.parts or "\\" in info.filename:
            raise ConfigError(f"the package member {info.filename!r} points outside the job")
        if stat.S_ISLNK(info.external_attr >> 16):
            raise ConfigError(f"the package member {info.filename!r} is a link; links are refused")
        total += info.file_size
        names.add(str(path))
    if total > MAX_UNPACKED_BYTES:
        raise ConfigError(
            f"the job's package unpacks to {total} bytes; at most {MAX_UNPACKED_BYTES} are taken"
        )
    entry = PurePosixPath(entrypoint)
    if (
        entry.is_absolute()
        or ".." in entry.parts
        or entry.suffix != ".py"
        or str(entry) not in names
    ):
        raise ConfigError(
            f"the entrypoint {entrypoint!r} is not a .py file of the package (it holds "
            f"{len(names)} files)"
        )
    return archive


async def wait_exit(pid: int, start: int) -> None:
    """Return once process ``pid``, started at ``start`` (see :func:`process_start`), has
    ended; it need not be a child of this one (a pidfd tells)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if process_start(pid) != start:  # gone, and the pid taken by another process
            return
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not ended.done():
                ended.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await ended
        finally:
            loop.remove_reader(fd)
    finally:
        os.close(fd)


class JobManager:
    """The head's submitted jobs. Not thread-safe; one event loop."""

    def __init__(
        self,
        state_dir: Path,
        head_address: str,
        token: str,
        store: HeadStore,
        retention: int = 100,
    ) -> None:
        self.root = state_dir / "jobs"
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.head_address = head_address
        self.token = token
        self.store = store
        self.jobs: dict[str, JobRecord] = {}
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        #: Jobs a previous head started whose controllers still run: job id -> pid.
        self._adopted: dict[str, int] = {}
        self._watchers = TaskOwner()  # each running job's watch until it ends
        self._unpacking = asyncio.Semaphore(UNPACKING_AT_ONCE)
        #: Finished jobs whose folder and package are kept; older ones' are removed.
        self.retention = retention
        self._load()
        self.prune()

    def _load(self) -> None:
        """Records of earlier jobs. One that was running when the head went away is adopted
        when its controller still runs (same pid, same start time), else ended with the
        status it left, or failed with the reason."""
        for fields in self.store.load_jobs():
            try:
                record = JobRecord(**fields)
            except TypeError as exc:
                log.warning("skipping an unreadable job record", record=fields, error=str(exc))
                continue
            self.jobs[record.job_id] = record
            if record.state != "running":
                continue
            if record.pid and record.pid_start and process_start(record.pid) == record.pid_start:
                self._adopted[record.job_id] = record.pid
                self._spawn(self._watch_adopted(record))
                log.info("job adopted", job=record.job_id, pid=record.pid)
            else:
                self._ended(record, "its controller ended while the head was down")

    def _spawn(self, coro: Any) -> None:
        self._watchers.start(coro)

    def _save(self, record: JobRecord, package: bytes | None = None) -> None:
        self.store.save_job(record.job_id, dataclasses.asdict(record), package)

    def _ended(self, record: JobRecord, reason: str = "") -> None:
        """Record the end of ``record``'s controller from the status file it left."""
        try:
            code = int((self.root / record.job_id / "exit_code").read_text())
        except (OSError, ValueError):
            code, reason = -1, reason or "its controller left no exit status"
            if record.state == "running":
                record.reason = f"{reason} (it was killed, or the host went down)"
        self._close(record, code)

    def _close(self, record: JobRecord, code: int) -> None:
        """The job ended with ``code``: succeeded or failed, unless it was stopped."""
        if record.state == "running":
            record.state = "succeeded" if code == 0 else "failed"
        record.exit_code = code
        record.ended_unix = time.time()
        self._save(record)
        log.info("job ended", job=record.job_id, state=record.state, exit_code=code)
        self.prune()

    def prune(self) -> None:
        """Remove the folder (working directory, output) and the package of every finished
        job but the :attr:`retention` most recent; their records stay (``orchestr jobs``
        lists them, with ``reason`` saying their files were removed)."""
        done = sorted(
            (r for r in self.jobs.values() if r.state != "running"),
            key=lambda r: r.ended_unix,
            reverse=True,
        )
        for record in done[self.retention :]:
            if record.pruned:
                continue
            shutil.rmtree(self.root / record.job_id, ignore_errors=True)
            self.store.delete_package(record.job_id)
            record.pruned = True
            self._save(record)
            log.info("job files removed", job=record.job_id, retention=self.retention)

    async def _watch_adopted(self, record: JobRecord) -> None:
        await wait_exit(record.pid, record.pid_start)
        self._adopted.pop(record.job_id, None)
        self._ended(record)

    def output_path(self, job_id: str) -> Path:
        return self.root / job_id / "output.log"

    def _open_output(self, job_id: str) -> BinaryIO:
        return open(self.output_path(job_id), "wb")

    def get(self, job_id: str) -> JobRecord:
        try:
            return self.jobs[job_id]
        except KeyError:
            raise ConfigError(
                f"no job {job_id!r} on this cluster; orchestr jobs lists them"
            ) from None

    async def submit(self, package: bytes, entrypoint: str, args: list[str]) -> JobRecord:
        """Unpack ``package`` and start its controller. Checking and unpacking run in a
        thread, at most :data:`UNPACKING_AT_ONCE` at a time, so the head's RPCs (heartbeats
        among them) go on meanwhile; raises :class:`ConfigError` for a bad package, and
        removes what it unpacked."""
        if not all(isinstance(a, str) and "\x00" not in a for a in args):
            raise ConfigError("job arguments must be strings without NUL bytes")
        job_id = f"job-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        folder = self.root / job_id
        wd = folder / "wd"
        async with self._unpacking:
            folder.mkdir(mode=0o700)
            try:
                await asyncio.to_thread(_unpack, package, entrypoint, wd)
            except BaseException:
                await asyncio.to_thread(shutil.rmtree, folder, True)
                raise
        record = JobRecord(job_id, entrypoint, list(args))
        # The job's own settings, not the head's; but it reaches the cluster as the head does.
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTR_")}
        env.update({k: v for k, v in os.environ.items() if k.startswith("ORCHESTR_TLS_")})
        env.update(ORCHESTR_TOKEN=self.token, ORCHESTR_ADDRESS=self.head_address)
        # its event log where the head's dashboard reads it
        env.update(
            ORCHESTR_SUBMITTED_JOB=job_id, ORCHESTR_SUBMITTED_SESSION=str(folder / "session")
        )
        cmd = ["/bin/sh", "-c", _RECORD_EXIT, str(folder / "exit_code"), sys.executable]
        cmd += ["-m", "orchestr.cli", "run", "--address", self.head_address]
        out = self._open_output(job_id)
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                entrypoint,
                *args,
                cwd=wd,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            out.close()  # the child has its own copy
        record.pid = proc.pid
        record.pid_start = process_start(proc.pid)
        self.jobs[job_id] = record
        self._procs[job_id] = proc
        self._save(record, package)
        self._spawn(self._watch(record, proc))
        log.info("job submitted", job=job_id, entrypoint=entrypoint, pid=proc.pid)
        return record

    async def _watch(self, record: JobRecord, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        self._procs.pop(record.job_id, None)
        self._close(record, code)

    def read_output(self, job_id: str, offset: int, max_bytes: int) -> tuple[bytes, int]:
        self.get(job_id)
        if offset < 0:
            raise ConfigError(f"a log offset is >= 0, got {offset}")
        size = max_bytes if max_bytes > 0 else DEFAULT_LOG_CHUNK
        try:
            with open(self.output_path(job_id), "rb") as f:
                f.seek(offset)
                data = f.read(min(size, DEFAULT_LOG_CHUNK))
        except FileNotFoundError:
            data = b""
        return data, offset + len(data)

    async def stop(self, job_id: str) -> JobRecord:
        """SIGTERM the job's controller (and its session), SIGKILL after STOP_GRACE_S; waits
        for it to end. A job that already ended is returned as it is."""
        record = self.get(job_id)
        proc = self._procs.get(job_id)
        if (proc is None and job_id not in self._adopted) or record.state != "running":
            return record
        record.state = "stopped"
        self._save(record)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(record.pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(STOP_GRACE_S):
                await self._gone(record, proc)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(record.pid, signal.SIGKILL)
            await self._gone(record, proc)
        await asyncio.gather(*self._watchers, return_exceptions=True)
        return record

    @staticmethod
    async def _gone(record: JobRecord, proc: asyncio.subprocess.Process | None) -> None:
        if proc is not None:
            await proc.wait()
        else:
            await wait_exit(record.pid, record.pid_start)

    async def aclose(self) -> None:
        """Stop every running job (the head is going away)."""
        for job_id in [*self._procs, *self._adopted]:
            await self.stop(job_id)
        await self._watchers.aclose()


def job_info(record: JobRecord) -> dict[str, Any]:
    """``record``'s fields as ``JobInfo`` has them."""
    fields = dataclasses.asdict(record)
    del fields["pid_start"]
    if fields.pop("pruned") and not fields["reason"]:
        fields["reason"] = "its files were removed (job retention)"
    return fields


def _unpack(package: bytes, entrypoint: str, wd: Path) -> None:
    """Check ``package`` and unpack it into ``wd`` (in a thread), within
    :data:`UNPACK_TIMEOUT_S`. Raises :class:`ConfigError`."""
    archive = check_package(package, entrypoint)
    deadline = time.monotonic() + UNPACK_TIMEOUT_S
    with archive:
        for member in archive.infolist():
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"unpacking the job's package took over {UNPACK_TIMEOUT_S:g} s; it is refused"
                )
            archive.extract(member, wd)
