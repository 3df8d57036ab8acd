"""What /proc says of a process, for tests that bound memory."""

from __future__ import annotations

from pathlib import Path


def rss_mib(pid: int | str = "self") -> float:
    """The resident set size of ``pid`` (this process by default), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def stop(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped: ``kill`` returns before
    the kernel has stopped them, and a thread still running can answer one more request."""
    import os
    import signal
    import time

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                states.append(stat.read_text().rpartition(")")[2].split()[0])
            except OSError:
                continue  # a thread that just ended
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")
