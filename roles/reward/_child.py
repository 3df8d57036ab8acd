"""The reward process: where a :class:`~orchestr.roles.Reward` actor runs its reward functions,
so that no function stalls the actor's worker. Run as a script (``python -P _child.py``) by
:mod:`._runner`, which imports this module only for its framing.

It imports the standard library and msgpack, and the functions: the rules that ship with
orchestr (``orchestr.roles.reward:exact_match``...) are loaded from ``_rules.py`` beside this
file, not through the orchestr package, which imports torch (seconds, at every restart).

Protocol, over its stdin and stdout (the process's own fd 1 is pointed at stderr, so a
function's prints reach the worker's log and never the protocol). Frames are a 4-byte
big-endian length and a msgpack body.

1. parent: ``{"sys_path": [...], "timeout_s": t, "functions": [{"path", "args", "fields",
   "by_name"}]}``;
   child: ``{"ready": [None or the error of loading function i, ...]}``, after importing each
   function and running its ``reward_setup`` hook (no time limit: the parent's start deadline).
2. parent: ``[[row, [function, ...], [prompt, completion, fields]], ...]``; child: one frame
   ``[row, function, kind, value]`` per call in that order, ``kind`` ``"ok"`` with a float,
   ``"error"`` or ``"timeout"`` with a text. Repeats.
3. stdin at its end: the child exits. It also dies with its parent (``PR_SET_PDEATHSIG``).

A call runs under ``setitimer(ITIMER_REAL, timeout_s)``: the SIGALRM handler raises
``_CallTimeout``, a ``BaseException`` so ``except Exception`` in a function does not
swallow it. That stops pure Python code (loops, ``time.sleep``); code that blocks in C or
ignores the signal runs on until the parent's deadline kills the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import importlib.util
import math
import numbers
import os
import signal
import struct
import sys
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any

import msgpack

__all__ = ["HEADER", "MAX_FRAME", "frame", "main", "unpack"]

HEADER = struct.Struct(">I")
#: The longest frame either side reads (a batch of long completions fits many times over).
MAX_FRAME = 1 << 30
_RULES_MODULE = "orchestr.roles.reward"
_ERROR_CHARS = 500


def frame(value: Any) -> bytes:
    body: bytes = msgpack.packb(value, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def unpack(body: bytes) -> Any:
    return msgpack.unpackb(body, raw=False, strict_map_key=False)


class _CallTimeout(BaseException):
    """A call ran past its time limit."""


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise _CallTimeout


def _read(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive(fd: int) -> Any:
    """The next frame's value; None at the end of the stream."""
    head = _read(fd, HEADER.size)
    if head is None:
        return None
    (n,) = HEADER.unpack(head)
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes")
    body = _read(fd, n)
    return None if body is None else unpack(body)


def _send(fd: int, value: Any) -> None:
    data = memoryview(frame(value))
    while data:
        data = data[os.write(fd, data) :]


def _rules() -> ModuleType:
    """The shipped rules, from their file, without the orchestr package."""
    name = "_orchestr_reward_rules"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_rules.py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _import(path: str) -> Callable[..., Any]:
    module_name, _, name = path.partition(":")
    obj: Any
    if module_name == _RULES_MODULE and name in _rules().__all__:
        obj = _rules()
    else:
        obj = importlib.import_module(module_name)
    for part in name.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{path} is not callable")
    return obj  # type: ignore[no-any-return]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]


class _Function:
    """One loaded function: the callable with its args bound, and the fields it takes."""

    def __init__(self, spec: dict[str, Any]) -> None:
        fn = _import(spec["path"])
        setup = getattr(fn, "reward_setup", None)
        if callable(setup):
            setup()
        self.args = dict(spec["args"])
        self.call = functools.partial(fn, **self.args)
        self.fields: list[str] | None = spec["fields"]
        #: Which of prompt and completion go by keyword (none: both, positionally).
        self.by_name: list[str] = spec["by_name"]

    def __call__(self, prompt: str, completion: str, fields: dict[str, Any]) -> Any:
        kwargs = self.kwargs(fields)
        if not self.by_name:
            return self.call(prompt, completion, **kwargs)
        given = {"prompt": prompt, "completion": completion}
        return self.call(**kwargs, **{name: given[name] for name in self.by_name})

    def kwargs(self, fields: dict[str, Any]) -> dict[str, Any]:
        if self.fields is None:
            kwargs = dict(fields)
        else:
            kwargs = {k: fields[k] for k in self.fields if k in fields}
        for key in self.args:  # args win over a field of the same name
            kwargs.pop(key, None)
        return kwargs


def _value(value: Any) -> tuple[str, Any]:
    """A function's result as an answer: a bool counts 1.0 or 0.0; anything but a finite real
    number is an error."""
    if isinstance(value, bool):
        return "ok", float(value)
    if not isinstance(value, numbers.Real):
        return "error", f"returned {value!r:.200}, not a number"
    number = float(value)
    if not math.isfinite(number):
        return "error", f"returned {number!r}, not a finite number"
    return "ok", number


def _call(
    fn: _Function, prompt: str, completion: str, fields: dict[str, Any], limit: float
) -> tuple[str, Any]:
    # the handler again each call: a function that replaced it must not disarm later calls
    signal.signal(signal.SIGALRM, _on_alarm)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, limit)
            value = fn(prompt, completion, fields)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _CallTimeout:
        return "timeout", f"ran past its limit of {limit} s"
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: one call's fault
        return "error", _describe(exc)
    return _value(value)


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def main() -> None:
    """Serve the protocol on stdin and stdout until stdin ends."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is for the worker to handle
    inbox, outbox = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    init = _receive(inbox)
    if init is None:
        return
    sys.path[:] = init["sys_path"]
    limit = float(init["timeout_s"])
    functions: list[_Function | None] = []
    errors: list[str | None] = []
    for spec in init["functions"]:
        try:
            functions.append(_Function(spec))
            errors.append(None)
        except BaseException as exc:
            functions.append(None)
            errors.append(f"cannot load {spec['path']}: {_describe(exc)}")
    _send(outbox, {"ready": errors})
    while (work := _receive(inbox)) is not None:
        for row, indices, (prompt, completion, fields) in work:
            for i in indices:
                fn = functions[i]
                answer = (
                    ("error", errors[i])
                    if fn is None
                    else _call(fn, prompt, completion, fields, limit)
                )
                _send(outbox, [row, i, *answer])


if __name__ == "__main__":
    main()
