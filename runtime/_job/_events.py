"""A job's event log (JSON lines) and its export as a Chrome/Perfetto trace.

Every record is one line: ``{"ts": <unix seconds>, "kind": ..., ...fields}``. Spans (phases,
calls) are one record when they end, with their start ``ts`` and ``dur`` in seconds, the
``track`` they belong on and, if they failed, the ``error``. :func:`export_trace` turns a log
into the Trace Event format that chrome://tracing and ui.perfetto.dev open: spans become
complete (``"X"``) events on one thread per track, calls (which overlap) async begin/end
(``"b"``/``"e"``) pairs, other records instant (``"i"``) events.

A log is bounded: past ``max_bytes`` events are dropped and counted by kind, and closing the log
writes one ``events_dropped`` record saying how many. The export streams, one event at a time,
so a large log is never held in memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from typing import Any, TextIO

from orchestr import clock
from orchestr.errors import ConfigError

__all__ = ["EventLog", "export_trace", "iter_events", "read_events"]

#: The most a job's event log holds by default (``Config.event_log_max_bytes``).
MAX_BYTES = 256 << 20


class EventLog:
    """Appends events to ``path``; thread-safe; each line is flushed as it is written. Past
    ``max_bytes`` in the file, events are counted by kind instead of written."""

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = MAX_BYTES) -> None:
        self.path = os.fspath(path)
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self.max_bytes = max_bytes
        self._size = self._file.tell()
        #: Events left out since the log reached ``max_bytes``, by kind.
        self.dropped: dict[str, int] = {}

    def record(self, kind: str, **fields: Any) -> None:
        """Write one event now. Raises ConfigError for a kind that is not a non-empty string
        or fields that are not JSON."""
        self._write(clock.time(), kind, fields)

    def record_span(
        self,
        name: str,
        start: float,
        dur: float,
        *,
        track: str = "job",
        kind: str = "span",
        **fields: Any,
    ) -> None:
        """Write a span that began at ``start`` (unix seconds) and lasted ``dur`` seconds."""
        fields.update(name=name, track=track, dur=dur)
        self._write(start, kind, fields)

    @contextlib.contextmanager
    def span(
        self, name: str, *, track: str = "job", kind: str = "span", **fields: Any
    ) -> Iterator[None]:
        """Time the block; the event is written when it ends, with ``error`` if it raised."""
        start = clock.time()
        began = clock.perf_counter()
        try:
            yield
        except BaseException as exc:
            fields["error"] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            fields.update(name=name, track=track, dur=clock.perf_counter() - began)
            self._write(start, kind, fields)

    def record_calls(self, spans: list[tuple[float, float, str, str, bool]]) -> None:
        """Write call spans ``(start, end, actor, endpoint, ok)`` in one go: each is a
        ``call`` event on the actor's track of the trace."""
        lines = "".join(
            json.dumps(
                {
                    "ts": start,
                    "kind": "call",
                    "name": f"{actor}.{endpoint}",
                    "track": f"calls to {actor}",
                    "dur": max(0.0, end - start),
                    **({} if ok else {"error": "failed"}),
                }
            )
            + "\n"
            for start, end, actor, endpoint, ok in spans
        )
        with self._lock:
            if self._file is None:
                return  # the job has ended; late spans are not an error
            if self._full(len(lines), "call", len(spans)):
                return
            self._file.write(lines)
            self._file.flush()

    def _write(self, ts: float, kind: str, fields: dict[str, Any]) -> None:
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"an event kind is a non-empty string, got {kind!r}")
        try:
            line = json.dumps({"ts": ts, "kind": kind, **fields}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"event {kind!r} has a field that is not JSON: {exc}") from exc
        with self._lock:
            if self._file is None:
                raise ConfigError(f"the event log {self.path} is closed")
            if self._full(len(line) + 1, kind, 1):
                return
            self._file.write(line + "\n")
            self._file.flush()

    def _full(self, nbytes: int, kind: str, count: int) -> bool:
        """Whether ``count`` events of ``nbytes`` would pass the cap (then they are counted)."""
        if self._size + nbytes > self.max_bytes:
            self.dropped[kind] = self.dropped.get(kind, 0) + count
            return True
        self._size += nbytes
        return False

    def close(self) -> None:
        """Close the file, first writing how many events were dropped, if any. Idempotent."""
        with self._lock:
            if self._file is not None:
                if self.dropped:
                    record = {
                        "ts": clock.time(),
                        "kind": "events_dropped",
                        "count": sum(self.dropped.values()),
                        "by_kind": self.dropped,
                        "max_bytes": self.max_bytes,
                    }
                    self._file.write(json.dumps(record) + "\n")
                self._file.close()
                self._file = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The events of a log, in file order, one at a time. Raises ConfigError naming the first
    bad line."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{number} is not a JSON line: {exc}") from None
            if not (isinstance(event, dict) and isinstance(event.get("kind"), str)):
                raise ConfigError(f"{path}:{number} is not an event (no kind)")
            if not isinstance(event.get("ts"), int | float):
                raise ConfigError(f"{path}:{number} has no timestamp")
            yield event


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a log, in file order. Raises ConfigError naming the first bad line."""
    return list(iter_events(path))


def export_trace(log_path: str | os.PathLike[str], trace_path: str | os.PathLike[str]) -> int:
    """Write the Chrome/Perfetto trace of an event log; returns how many log events it holds.
    Streams: two passes over the log (the first finds the earliest time), one event in memory
    at a time."""
    origin = min((e["ts"] for e in iter_events(log_path)), default=0.0)
    tracks: dict[str, int] = {}
    count = 0
    written = 0
    with open(trace_path, "w", encoding="utf-8") as f:
        f.write('{"displayTimeUnit": "ms", "traceEvents": [')

        def emit(entry: dict[str, Any]) -> None:
            nonlocal written
            f.write((",\n" if written else "\n") + json.dumps(entry))
            written += 1

        for event in iter_events(log_path):
            count += 1
            track = str(event.get("track", "job"))
            tid = tracks.setdefault(track, len(tracks) + 1)
            args = {
                k: v for k, v in event.items() if k not in ("ts", "kind", "name", "track", "dur")
            }
            entry: dict[str, Any] = {
                "name": str(event.get("name", event["kind"])),
                "cat": event["kind"],
                "pid": 1,
                "tid": tid,
                "ts": round((event["ts"] - origin) * 1e6, 3),
                "args": args,
            }
            if event["kind"] == "call" and isinstance(event.get("dur"), int | float):
                # Calls overlap (many in flight to one actor): async slices may overlap, where
                # complete ("X") slices on one thread must nest.
                entry.update(ph="b", id=written + 1)
                end = dict(entry, ph="e", args={})
                end["ts"] = round(entry["ts"] + event["dur"] * 1e6, 3)
                emit(entry)
                emit(end)
                continue
            if isinstance(event.get("dur"), int | float):
                entry.update(ph="X", dur=round(event["dur"] * 1e6, 3))
            else:
                entry.update(ph="i", s="t")
            emit(entry)
        for track, tid in tracks.items():
            emit({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": track}})
        f.write("\n]}\n")
    return count
