"""structlog set-up: JSON lines from daemons and workers, readable console output in the CLI."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, TextIO

import structlog

__all__ = ["RotatingFile", "configure_logging"]

#: A daemon's log file is rotated past this size, keeping this many older ones.
LOG_MAX_BYTES = 16 << 20
LOG_BACKUPS = 3


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
        self._file = open(path, "a", encoding="utf-8")

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
        self._file = open(self.path, "a", encoding="utf-8")


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
        processors.append(structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
