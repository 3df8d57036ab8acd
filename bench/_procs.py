"""Processes the benchmarks start: finding every member of a session they gave its own."""

from __future__ import annotations

import os


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
