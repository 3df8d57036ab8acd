"""structlog set-up: JSON lines from daemons and workers, readable console output in the CLI."""

from __future__ import annotations

import logging
import os
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import structlog

from .errors import ConfigError

__all__ = ["RotatingFile", "configure_logging", "read_daemon_log"]

#: A daemon's log file is rotated past this size, keeping this many older ones.
LOG_MAX_BYTES = 16 << 20
LOG_BACKUPS = 3


#: The most bytes one read of a daemon log returns.
LOG_CHUNK = 1 << 20


def read_daemon_log(
    log_dir: Path, name: str, offset: int, max_bytes: int
) -> tuple[list[str], bytes, int]:
    """The JSON-lines logs in ``log_dir`` (names), and when ``name`` is one of them, up to
    ``max_bytes`` of it from ``offset`` with the offset after them. Only a listed name is read,
    so no path reaches outside the folder. Raises :class:`ConfigError` for another name or a
    negative offset."""
    names = sorted(p.name for p in log_dir.glob("*.jsonl*") if p.is_file() and not p.is_symlink())
    if not name:
        return names, b"", 0
    if name not in names:
        raise ConfigError(f"no daemon log {name!r}; there are {', '.join(names) or 'none'}")
    if offset < 0:
        raise ConfigError(f"a log offset is >= 0, got {offset}")
    size = max_bytes if 0 < max_bytes <= LOG_CHUNK else LOG_CHUNK
    try:
        fd = os.open(log_dir / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot read the daemon log {name!r}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ConfigError(f"the daemon log {name!r} is not a regular file")
        f.seek(offset)
        data = f.read(size)
    return names, data, offset + len(data)


class RotatingFile:
    """A text stream appending to ``path`` that rotates it (``path.1`` ... ``path.N``, the
    oldest dropped) once it passes ``max_bytes``; thread-safe, for structlog's print logger."""

    def __init__(
        self, path: str, max_bytes: int = LOG_MAX_BYTES, backups: int = LOG_BACKUPS
    ) -> None:
        if max_bytes < 1 or backups < 1:
            raise ValueError("max_bytes and backups must be >= 1")
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._lock = threading.Lock()
        self._file = _open_log(path)

    def write(self, text: str) -> int:
        with self._lock:
            if self._file.tell() + len(text) > self.max_bytes and self._file.tell() > 0:
                self._rotate()
            n = self._file.write(text)
            return n

    def flush(self) -> None:
        with self._lock:
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def _rotate(self) -> None:
        self._file.close()
        for i in range(self.backups - 1, 0, -1):
            if os.path.exists(f"{self.path}.{i}"):
                os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
        os.replace(self.path, f"{self.path}.1")
        self._file = _open_log(self.path)


def _open_log(path: str) -> TextIO:
    """``path`` opened to append: private (0600), and never through a link (another user's
    link in a log folder would have a root daemon write wherever it points)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    return os.fdopen(fd, "a", encoding="utf-8")


def configure_logging(
    *, json: bool, stream: TextIO | RotatingFile | None = None, level: str = "INFO"
) -> None:
    """Route orchestr's structlog output. Context bound with ``structlog.contextvars`` (node,
    worker, actor, job, call) is merged into every event."""
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        # plain tracebacks: rich's (when it is installed) print each frame's locals, which
        # hold request bodies and secrets (an Authorization header) in a server's frames
        processors.append(
            structlog.dev.ConsoleRenderer(
                colors=False, exception_formatter=structlog.dev.plain_traceback
            )
        )
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )


class LineCutter:
    """Splits a byte stream into text lines of at most ``max_bytes`` each: a longer line is
    cut there and ends with a marker saying how much of it was dropped, so one huge line
    costs a bounded buffer (asyncio's ``readline`` gives up on it instead). No I/O here."""

    def __init__(self, max_bytes: int = 16 * 1024) -> None:
        self.max_bytes = max_bytes
        self._pending = bytearray()
        self._dropped = 0  # bytes of the current line past max_bytes

    def feed(self, data: bytes) -> list[str]:
        lines: list[str] = []
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            self._take(data[start:end])
            lines.append(self._line())
            start = end + 1
        self._take(data[start:])
        return lines

    def end(self) -> list[str]:
        """What is left once the stream has ended (a last line without a newline)."""
        return [self._line()] if self._pending or self._dropped else []

    def _take(self, part: bytes) -> None:
        room = self.max_bytes - len(self._pending)
        self._pending += part[:room]
        self._dropped += max(0, len(part) - room)

    def _line(self) -> str:
        text = self._pending.decode(errors="replace")
        if self._dropped:
            text += f" ... [line cut: {self._dropped} more bytes dropped]"
        self._pending.clear()
        self._dropped = 0
        return text


class Throttled:
    """One warning event, logged at most once per ``period`` seconds: a flood of them (refused
    connections, refused requests) must not flood the log. Each line says how many were left
    out since the one before (``not_logged_since``); :attr:`count` counts them all."""

    def __init__(self, logger: Any, event: str, period: float = 1.0) -> None:
        self.logger = logger
        self.event = event
        self.period = period
        self.count = 0
        self._last = -period
        self._skipped = 0

    def __call__(self, **fields: Any) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._last < self.period:
            self._skipped += 1
            return
        self._last = now
        self.logger.warning(self.event, not_logged_since=self._skipped, **fields)
        self._skipped = 0
