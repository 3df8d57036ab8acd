"""A job's event log (``events.jsonl``) read as it grows, for the dashboard: the phases as
spans, the supervision and error records as marks, and the RL job's ``rl_step`` records as
series (reward, output length, held-out score).

Each :meth:`EventTail.poll` reads what was appended since the last one, at most
:data:`MAX_READ_BYTES` of it, whole lines only (a line still being written waits for the
next poll); lines that are not JSON objects are skipped. What it keeps is bounded: the
newest :data:`MAX_SPANS` spans and :data:`MAX_MARKS` marks, and at most :data:`MAX_STEPS`
steps (past it every other one is dropped, so a long run's curve keeps its shape). The file
is opened without following a link and read only if it is a regular file. No other I/O here.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import stat
from typing import Any

__all__ = ["EventTail", "Mark", "Span", "Step"]

#: Most bytes one poll reads; the rest waits for the next polls.
MAX_READ_BYTES = 4 << 20
#: Longest line kept; a longer one is skipped whole.
MAX_LINE_BYTES = 1 << 20
MAX_SPANS = 500
MAX_MARKS = 200
MAX_STEPS = 2000
#: Event kinds shown as bars on the timeline (those with a duration).
SPAN_KINDS = frozenset({"phase", "span", "graph_stage", "fabric_plan"})
#: Event kinds shown as marks on the timeline.
MARK_KINDS = frozenset(
    {"supervision", "actor_died", "restart", "error", "head_lost", "head_reconnected", "spawn"}
)


@dataclasses.dataclass(frozen=True)
class Span:
    name: str
    track: str
    start: float  # unix seconds
    dur: float
    error: str = ""


@dataclasses.dataclass(frozen=True)
class Mark:
    kind: str
    at: float  # unix seconds
    text: str


@dataclasses.dataclass(frozen=True)
class Step:
    step: int
    reward: float
    length: float
    accuracy: float | None


class EventTail:
    """What a job's event log at ``path`` has said so far; :meth:`poll` reads the rest."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.offset = 0
        self._partial = b""
        self.spans: collections.deque[Span] = collections.deque(maxlen=MAX_SPANS)
        self.marks: collections.deque[Mark] = collections.deque(maxlen=MAX_MARKS)
        self.steps: list[Step] = []
        self._stride = 1  # keep every _stride-th step once MAX_STEPS is reached
        #: First and last event times seen (unix seconds), 0 before any.
        self.first = 0.0
        self.last = 0.0

    def poll(self) -> bool:
        """Read what was appended since the last poll. Returns whether anything new was
        kept. Blocks on reading the file (at most :data:`MAX_READ_BYTES`); raises nothing
        for a file that is missing, not regular, or shorter than before (read again from its
        start)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return False
            if st.st_size < self.offset:  # replaced or truncated: start over
                self.offset, self._partial = 0, b""
            if st.st_size == self.offset:
                return False
            data = os.pread(fd, min(MAX_READ_BYTES, st.st_size - self.offset), self.offset)
        finally:
            os.close(fd)
        self.offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_LINE_BYTES:
            self._partial = b""  # skipped whole; its end is dropped as a bad line later
        changed = False
        for line in lines:
            if line.strip() and len(line) <= MAX_LINE_BYTES:
                changed |= self._take(line)
        return changed

    def _take(self, line: bytes) -> bool:
        try:
            event = json.loads(line)
        except ValueError:
            return False
        if not isinstance(event, dict):
            return False
        kind, ts = event.get("kind"), event.get("ts")
        if not isinstance(kind, str) or not isinstance(ts, int | float):
            return False
        dur = event.get("dur")
        end = ts + dur if isinstance(dur, int | float) and dur >= 0 else ts
        self.first = min(self.first, ts) if self.first else ts
        self.last = max(self.last, end)
        if kind in SPAN_KINDS and isinstance(dur, int | float):
            self.spans.append(
                Span(
                    str(event.get("name", kind)),
                    str(event.get("track", kind)),
                    float(ts),
                    float(dur),
                    str(event.get("error") or ""),
                )
            )
            return True
        if kind == "rl_step":
            return self._take_step(event)
        if kind in MARK_KINDS:
            self.marks.append(Mark(kind, float(ts), _describe(event)))
            return True
        return False

    def _take_step(self, event: dict[str, Any]) -> bool:
        step, reward, length = event.get("step"), event.get("reward"), event.get("mean_length")
        accuracy = event.get("accuracy")
        if not isinstance(step, int) or not all(
            isinstance(v, int | float) for v in (reward, length)
        ):
            return False
        if accuracy is not None and not isinstance(accuracy, int | float):
            accuracy = None
        assert isinstance(reward, int | float) and isinstance(length, int | float)
        while self.steps and self.steps[-1].step >= step:
            self.steps.pop()  # a rolled-back batch trained again: its new record counts
        if step % self._stride:
            return False
        self.steps.append(Step(step, float(reward), float(length), accuracy))
        if len(self.steps) > MAX_STEPS:
            self._stride *= 2
            self.steps = [s for s in self.steps if s.step % self._stride == 0]
        return True


def _describe(event: dict[str, Any]) -> str:
    fields = {k: v for k, v in event.items() if k not in ("ts", "kind")}
    text = ", ".join(f"{k}={v}" for k, v in fields.items())
    return text[:500]
