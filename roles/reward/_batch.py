"""One ``score_rows`` batch: which calls are still to run, what each scored, what failed.

A batch is one call per row and function, run in the reward process in row-major order (row 0's
functions in config order, then row 1's...). The process answers each call in that order, so
the first call still pending is the one it is running: when the process dies or is killed at
its deadline, that call is the one that failed (:meth:`Batch.lost`). A function that loses the
process :data:`HARD_FAILURES` times in one batch is not run again in it: its remaining rows
score the default and count as failures of the same cause, so one bad function costs a batch
at most a bounded number of restarts. A failed call scores ``default`` for its function.

No I/O here.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

__all__ = ["CAUSES", "HARD_FAILURES", "Batch"]

#: Why a call failed: it raised or returned no finite number, or the process died in it
#: (``error``); it ran past its time limit (``timeout``).
CAUSES = ("error", "timeout")

#: Times one function may kill or hang the reward process in one batch before the batch stops
#: calling it.
HARD_FAILURES = 2


class Batch:
    """The calls of one batch and their results; ``names`` and ``weights`` by function."""

    def __init__(
        self, names: Sequence[str], weights: Sequence[float], rows: int, default: float
    ) -> None:
        self.names = list(names)
        self.weights = list(weights)
        self.rows = rows
        self.values = [[default] * rows for _ in self.names]
        self.failures = [dict.fromkeys(CAUSES, 0) for _ in self.names]
        #: The last failure's text per function (None: none failed).
        self.last_error: list[str | None] = [None] * len(self.names)
        self._pending = collections.deque(
            (row, fn) for row in range(rows) for fn in range(len(self.names))
        )
        self._hard = [0] * len(self.names)

    @property
    def done(self) -> bool:
        return not self._pending

    def running(self) -> tuple[int, int] | None:
        """``(row, function)`` of the call the process runs now, or None when all are done."""
        return self._pending[0] if self._pending else None

    def work(self) -> list[tuple[int, list[int]]]:
        """The pending calls as ``(row, [function, ...])`` in the order they run."""
        out: list[tuple[int, list[int]]] = []
        for row, fn in self._pending:
            if out and out[-1][0] == row:
                out[-1][1].append(fn)
            else:
                out.append((row, [fn]))
        return out

    def _fail(self, fn: int, cause: str, text: str) -> None:
        self.failures[fn][cause] += 1
        self.last_error[fn] = text

    def record(self, row: int, fn: int, kind: str, value: Any) -> None:
        """The process's answer for call ``(row, fn)``: ``("ok", float)``, or ``("error" |
        "timeout", text)``. Raises ``ValueError`` for an answer out of order or of an unknown
        kind (a broken process: its caller kills it)."""
        if self.running() != (row, fn):
            raise ValueError(f"answer for {(row, fn)} while {self.running()} runs")
        if kind == "ok" and isinstance(value, float):
            self.values[fn][row] = value
        elif kind in CAUSES:
            self._fail(fn, kind, str(value))
        else:
            raise ValueError(f"unknown answer {kind!r} {value!r} for {(row, fn)}")
        self._pending.popleft()

    def lost(self, cause: str, text: str) -> None:
        """The process died (``error``) or was killed at its deadline (``timeout``) while it
        ran :meth:`running`: that call failed; a function at :data:`HARD_FAILURES` is dropped
        from the rest of the batch with the same cause."""
        if not self._pending:
            return
        _, fn = self._pending.popleft()
        self._fail(fn, cause, text)
        self._hard[fn] += 1
        if self._hard[fn] >= HARD_FAILURES:
            self.drop(fn, cause, f"{text} ({HARD_FAILURES} times in this batch: not run again)")

    def drop(self, fn: int, cause: str, text: str) -> None:
        """Every pending call of function ``fn`` fails with ``cause`` without running (the
        function did not load in the process, or kept killing it)."""
        kept = collections.deque(call for call in self._pending if call[1] != fn)
        for _ in range(len(self._pending) - len(kept)):
            self._fail(fn, cause, text)
        self._pending = kept

    def drop_all(self, cause: str, text: str) -> None:
        """Every pending call fails (the process could not start)."""
        for fn in {fn for _, fn in self._pending}:
            self.drop(fn, cause, text)

    def result(self) -> dict[str, Any]:
        """``{"rewards": [per row], "per_function": {name: [per row]}, "failures": {name:
        {"error": n, "timeout": n}}}``: a row's reward is its functions' values (the default
        where one failed) weighted and summed."""
        rewards = [
            sum(w * values[row] for w, values in zip(self.weights, self.values, strict=True))
            for row in range(self.rows)
        ]
        return {
            "rewards": [float(r) for r in rewards],
            "per_function": dict(zip(self.names, self.values, strict=True)),
            "failures": {n: dict(f) for n, f in zip(self.names, self.failures, strict=True)},
        }
