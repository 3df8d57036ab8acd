"""Trusting only what we made: the state directory, the files in it, and the daemons it names.

A state directory holds the cluster token, the head's database (job packages, actors'
constructor arguments) and the logs. Daemons run as root on many installs, so each use checks:

- the directory and every file read from it are owned by this user and private (no group or
  other bits), and are not symbolic links; anything else is refused with what to do about it;
- a pid found in ``head.json`` or ``nodes/*.json`` is signalled only when the process still is
  the daemon recorded: the same start time (``/proc/<pid>/stat``) and an orchestr daemon's
  command line. A recycled pid, or a number someone planted, is left alone;
- one head per state directory: the head holds an exclusive lock on ``head.lock`` for its life.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from orchestr.errors import ConfigError

__all__ = [
    "HeadLock",
    "check_private_dir",
    "check_private_file",
    "is_daemon",
    "private_dir",
    "read_private",
    "start_ticks",
]

LOCK_FILE = "head.lock"


def _owner_problem(path: Path, st: os.stat_result, what: str) -> str | None:
    uid = os.geteuid()
    if st.st_uid != uid:
        return (
            f"the {what} {path} is owned by uid {st.st_uid}, not by this user (uid {uid}): "
            f"another user could have put what is in it; use a {what} of your own"
        )
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        fix = "700" if stat.S_ISDIR(st.st_mode) else "600"
        return (
            f"the {what} {path} is open to other users (mode {stat.filemode(st.st_mode)}); "
            f"run chmod {fix} {path}"
        )
    return None


def check_private_dir(path: Path) -> None:
    """Raise :class:`ConfigError` unless ``path`` is a directory (not a link) of this user's
    that no one else may enter."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ConfigError(f"no state directory at {path}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"the state directory {path} is not a directory (a link, or a file)")
    problem = _owner_problem(path, st, "state directory")
    if problem is not None:
        raise ConfigError(problem)


def private_dir(path: Path) -> Path:
    """``path`` as a private directory of this user's: made (mode 0700) when missing, else
    checked (:func:`check_private_dir`)."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    check_private_dir(path)
    return path


def check_private_file(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{path} is not a regular file (a link, or something else)")
    problem = _owner_problem(path, st, "file")
    if problem is not None:
        raise ConfigError(problem)


def read_private(path: Path) -> bytes:
    """The contents of ``path``, a private regular file of this user's (opened without
    following a link). Raises :class:`FileNotFoundError` when it is missing and
    :class:`ConfigError` when it is not private."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ConfigError(f"cannot open {path}: {exc.strerror} (a link is not followed)") from None
    with os.fdopen(fd, "rb") as f:
        check_private_file(path, os.fstat(f.fileno()))
        return f.read()


def proc_stat(pid: int) -> list[bytes]:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may hold spaces and
    parentheses), the state first; empty when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()
    except OSError:
        return []


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot), or ``None`` if it is gone."""
    try:
        return int(proc_stat(pid)[19])  # field 22 of stat(5), counted after the command name
    except (IndexError, ValueError):
        return None


def is_daemon(pid: object, ticks: object, module: str) -> bool:
    """Whether ``pid`` is still the daemon recorded with ``ticks``: the same start time, and
    ``python -m <module>`` on its command line."""
    if not (isinstance(pid, int) and pid > 0 and isinstance(ticks, int)):
        return False
    if start_ticks(pid) != ticks:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"-m" in argv and module.encode() in argv


class HeadLock:
    """The head's hold on its state directory: an exclusive ``flock`` on ``head.lock``, taken
    without waiting and held until :meth:`release` (or the process ends)."""

    def __init__(self, state_dir: Path) -> None:
        path = state_dir / LOCK_FILE
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self._fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot open {path}: {exc.strerror}") from None
        try:
            check_private_file(path, os.fstat(self._fd))
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise ConfigError(
                f"another head runs from {state_dir} (it holds {path}); one head per state "
                f"directory: `orchestr stop` ends it"
            ) from None
        except BaseException:
            os.close(self._fd)
            raise

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
