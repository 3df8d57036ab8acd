"""The reward process's parent side: :class:`FunctionRunner` starts the process (:mod:`._child`)
on first use and keeps it, sends it a batch, and holds each call to a hard deadline.

Time limits, in two layers. In the process, each call runs under a SIGALRM timer of
``timeout_s``, which stops pure Python code. Here, every answer must come within
``timeout_s + grace_s`` of the one before (``grace_s`` defaults to ``max(1 s, timeout_s)``,
room for a loaded machine): past it, the process is killed, the call it ran counts as a
timeout, and a fresh process runs the rest of the batch. A process that dies (a function
called ``os._exit``, or crashed in C) costs the call it ran an error likewise. The bookkeeping
is :class:`~._batch.Batch`'s. Waiting never blocks the event loop: the pipes are asyncio's.

A call that is cancelled (the actor stops) kills the process, whose state is then unknown; the
next batch starts another.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import msgpack
import structlog

from ._batch import Batch
from ._child import HEADER, MAX_FRAME, frame, unpack
from ._spec import FunctionSpec

__all__ = ["GRACE_S", "START_TIMEOUT_S", "FunctionRunner", "Row"]

log = structlog.get_logger("orchestr.roles.reward")

#: The least slack past ``timeout_s`` before the parent kills a process that has not answered.
GRACE_S = 1.0
#: How long a new process may take to import its functions and run their setup hooks.
START_TIMEOUT_S = 120.0
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child.py")

#: ``(prompt, completion, fields)``
Row = tuple[str, str, dict[str, Any]]

_packer = msgpack.Packer(use_bin_type=True)


class _Gone(Exception):
    """The process ended, or sent what the protocol does not allow."""


class _Process:
    """A started reward process and the functions it could not load."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        #: Whether it has loaded its functions, and those it could not (by index).
        self.ready = False
        self.load_errors: dict[int, str] = {}

    async def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(data)
            await self.proc.stdin.drain()
        except (ConnectionError, RuntimeError) as exc:
            raise _Gone(f"its input closed: {exc!r}") from exc

    async def receive(self) -> Any:
        assert self.proc.stdout is not None
        try:
            (n,) = HEADER.unpack(await self.proc.stdout.readexactly(HEADER.size))
            if n > MAX_FRAME:
                raise _Gone(f"it sent a frame of {n} bytes")
            return unpack(await self.proc.stdout.readexactly(n))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise _Gone("it exited") from exc
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise _Gone(f"it sent a frame that does not decode: {exc!r}") from exc


class FunctionRunner:
    """Runs reward functions in a process of their own, one batch at a time."""

    def __init__(
        self,
        functions: Sequence[FunctionSpec],
        timeout_s: float,
        default: float,
        *,
        grace_s: float | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.functions = list(functions)
        self.timeout_s = timeout_s
        self.default = default
        self.grace_s = max(GRACE_S, timeout_s) if grace_s is None else grace_s
        self.start_timeout_s = start_timeout_s
        #: Processes started, and killed at a deadline or found dead.
        self.starts = 0
        self.losses = 0
        self._process: _Process | None = None
        self._lock = asyncio.Lock()

    async def run(self, rows: Sequence[Row]) -> Batch:
        """Score ``rows`` with every function; returns the finished :class:`Batch`. Raises
        ``ValueError`` for a row whose fields are not plain data (nothing runs then). Blocks on
        the process (starting it first when there is none), at most ``timeout_s + grace_s``
        per call; a call whose function failed never raises here. Calls run one batch at a
        time. Cancel-safe: a cancelled batch kills the process."""
        packed = [_pack_row(i, row) for i, row in enumerate(rows)]
        spec = self.functions
        batch = Batch([f.name for f in spec], [f.weight for f in spec], len(rows), self.default)
        async with self._lock:
            try:
                while not batch.done:
                    process = await self._ready(batch)
                    if process is None:
                        break
                    for fn, text in process.load_errors.items():
                        batch.drop(fn, "error", text)
                    await self._run_on(process, batch, packed)
            except BaseException:
                await self._discard()  # cut short mid-batch: its state is unknown
                raise
        return batch

    async def _run_on(self, process: _Process, batch: Batch, packed: list[bytes]) -> None:
        """Send ``batch``'s pending calls and take the answers until it is done or the process
        is lost (then it is discarded and the call it ran fails)."""
        if batch.done:
            return
        work = batch.work()
        body = _packer.pack_array_header(len(work)) + b"".join(
            _packer.pack_array_header(3) + _packer.pack(row) + _packer.pack(fns) + packed[row]
            for row, fns in work
        )
        limit = self.timeout_s + self.grace_s
        try:
            async with asyncio.timeout(self.start_timeout_s):
                await process.send(HEADER.pack(len(body)) + body)
            while not batch.done:
                async with asyncio.timeout(limit):
                    answer = await process.receive()
                try:
                    row, fn, kind, value = answer
                    batch.record(row, fn, kind, value)
                except (TypeError, ValueError) as exc:
                    raise _Gone(f"it answered {answer!r:.200}: {exc}") from exc
        except TimeoutError:
            await self._lose(
                batch, "timeout", f"no answer within {limit:g} s: the process was killed"
            )
        except _Gone as exc:
            await self._lose(batch, "error", f"the reward process died in the call: {exc}")

    async def _lose(self, batch: Batch, cause: str, text: str) -> None:
        running = batch.running()
        returncode = None if self._process is None else self._process.proc.returncode
        await self._discard()
        self.losses += 1
        if running is not None:
            name = self.functions[running[1]].name
            log.warning(
                "a reward function lost its process",
                function=name,
                row=running[0],
                cause=cause,
                returncode=returncode,
            )
        batch.lost(cause, text)

    async def _ready(self, batch: Batch) -> _Process | None:
        """The live process, started when there is none; None when it cannot start (then
        every pending call of ``batch`` fails as an error)."""
        if self._process is not None and self._process.proc.returncode is None:
            return self._process
        await self._discard()  # died while idle
        init = {
            "sys_path": list(sys.path),
            "timeout_s": self.timeout_s,
            "functions": [
                {
                    "path": f.path,
                    "args": f.args,
                    "fields": None if f.fields is None else list(f.fields),
                    "by_name": list(f.by_name),
                }
                for f in self.functions
            ],
        }
        self.starts += 1
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-P",
                _CHILD,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            batch.drop_all("error", f"the reward process could not start: {exc!r}")
            return None
        self._process = process = _Process(proc)
        try:
            async with asyncio.timeout(self.start_timeout_s):
                await process.send(frame(init))
                ready = (await process.receive())["ready"]
            if not isinstance(ready, list) or len(ready) != len(self.functions):
                raise _Gone(f"it answered {ready!r:.200} to its start")
        except (TimeoutError, _Gone, KeyError, TypeError) as exc:
            await self._discard()
            why = "took too long" if isinstance(exc, TimeoutError) else repr(exc)
            log.error("the reward process did not start", error=why)
            batch.drop_all("error", f"the reward process did not start: {why}")
            return None
        process.load_errors = {i: str(text) for i, text in enumerate(ready) if text is not None}
        process.ready = True
        for i, text in process.load_errors.items():
            log.error("a reward function did not load", function=self.functions[i].name, error=text)
        return process

    async def _discard(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            if process.proc.returncode is None:
                process.proc.kill()
        await process.proc.wait()

    async def aclose(self) -> None:
        """Stop the process (killed: it holds no state). Blocks until it is reaped; raises
        nothing; idempotent and cancel-safe (killed before the first wait)."""
        await self._discard()


def _pack_row(i: int, row: Row) -> bytes:
    try:
        packed: bytes = _packer.pack(list(row))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(
            f"row {i}: its fields must be plain data (text, numbers, lists, dicts): {exc}"
        ) from None
    return packed
