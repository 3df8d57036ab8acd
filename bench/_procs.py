"""Processes the benchmarks start: each in a session of its own, every member of it ended
whatever happens, and the JSON a child driver prints read back."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


def session_members(sid: int) -> list[int]:
    """The processes of session ``sid`` (one a benchmark started with its own session), this
    process excepted."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # after the name: state, ppid, pgrp, session
            members.append(int(entry))
    return members


class Processes:
    """Process groups a benchmark started (each in its own session), so that whatever happens
    they and everything they started are ended: at :meth:`stop`, else at exit."""

    def __init__(self, progress: tuple[str, ...] = ()) -> None:
        self.running: dict[int, subprocess.Popen[Any]] = {}
        #: Extra clean-ups (namespaces, Ray's leftovers), run last-in first-out at exit.
        self.cleanups: list[Callable[[], None]] = []
        #: Prefixes of a child's stderr lines that :meth:`run_json` passes on (its progress).
        self.progress = progress

    def start(self, cmd: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
        self.running[proc.pid] = proc
        return proc

    def stop(self, proc: subprocess.Popen[Any], grace: float = 5.0) -> None:
        """SIGTERM its group, SIGKILL what is left after ``grace`` (its whole session, Ray's
        workers in other groups of it too)."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in session_members(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        self.running.pop(proc.pid, None)

    def stop_all(self) -> None:
        for proc in list(self.running.values()):
            self.stop(proc, grace=2.0)
        while self.cleanups:
            with contextlib.suppress(Exception):
                self.cleanups.pop()()

    def run_json(
        self, cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 900
    ) -> Any:
        """Run ``cmd`` in a session of its own; return the JSON object on the last line of its
        stdout, passing on its progress lines. Raises RuntimeError with its stderr's tail."""
        proc = self.start(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        while True:
            # Short waits: a signal that lands on another thread (gRPC's, torch's) only runs
            # its handler once the main thread gets back to Python code.
            try:
                out, err = proc.communicate(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    self.stop(proc)
                    raise RuntimeError(
                        f"{' '.join(cmd[:6])} ... ran past {timeout:.0f} s"
                    ) from None
        self.stop(proc)
        for line in err.splitlines():
            if self.progress and line.startswith(self.progress):
                print(line, file=sys.stderr, flush=True)
        lines = out.strip().splitlines()
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{' '.join(cmd[:6])} ... exited {proc.returncode}:\n{err[-3000:]}")
        return json.loads(lines[-1])


def exit_on_signal(signum: int, frame: object) -> None:
    """A signal handler: leave by SystemExit, so that clean-ups run."""
    raise SystemExit(128 + signum)


def kill_by_marker(marker: str) -> None:
    """SIGKILL the processes whose command line names ``marker`` (a folder the benchmark made:
    Ray's daemons carry their temp dir in their arguments)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if marker.encode() in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)
