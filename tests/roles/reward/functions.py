"""Reward functions the reward tests name by path; the reward process imports them."""

from __future__ import annotations

import os
import signal
import time
from typing import Any


def length(prompt: str, completion: str) -> float:
    return float(len(completion))


def has_answer(prompt: str, completion: str, answer: str) -> bool:
    return answer in completion


def scaled(prompt: str, completion: str, answer: str, *, scale: float, bonus: float = 0.0) -> float:
    """Routed ``answer`` plus ``scale`` from args; ``bonus`` a field when the row has it."""
    return scale * float(answer == completion) + bonus


def every_field(prompt: str, completion: str, **fields: Any) -> float:
    return float(len(fields))


def fields_seen(prompt: str, completion: str, **fields: Any) -> float:
    """A number that encodes which fields arrived: 1 for ``a``, 2 for ``b``, 4 for ``c``."""
    return float(sum(bit for name, bit in (("a", 1), ("b", 2), ("c", 4)) if name in fields))


def raises(prompt: str, completion: str) -> float:
    raise RuntimeError(f"no reward for {completion!r}")


def nan(prompt: str, completion: str) -> float:
    return float("nan")


def text(prompt: str, completion: str) -> Any:
    return "high"


def spins(prompt: str, completion: str) -> float:
    """Loops forever unless the completion says ``stop`` (a SIGALRM stops it)."""
    while completion != "stop":
        pass
    return 1.0


def sleeps(prompt: str, completion: str) -> float:
    time.sleep(60)
    return 1.0


def swallows(prompt: str, completion: str) -> float:
    """Catches every Exception, as sloppy code does: the time limit is no Exception."""
    while True:
        try:
            time.sleep(60)
        except Exception:
            pass


def deaf(prompt: str, completion: str) -> float:
    """Blocks with SIGALRM ignored, as C code that never returns to Python would: only the
    parent's deadline ends it. Quick for a ``fast`` completion."""
    if completion == "fast":
        return 1.0
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    time.sleep(60)
    return 1.0


def exits(prompt: str, completion: str) -> float:
    """Kills its own process, for an ``exit`` completion."""
    if completion == "exit":
        os._exit(3)
    return 1.0


def prints(prompt: str, completion: str) -> float:
    """Writes to stdout: must not reach the reward process's protocol."""
    print("a reward function's print", completion)
    os.write(1, b"and a raw write to fd 1\n")
    return 1.0


def one_arg(prompt: str) -> float:
    return 0.0


def unnamed_one(text: str) -> float:
    return 0.0


def completion_first(completion: str, answer: str) -> float:
    """Names what it takes: the completion and a field, no prompt."""
    return len(completion) + (0.5 if answer in completion else 0.0)


def needs_label(prompt: str, completion: str, label: str) -> float:
    return 0.0


def positional(prompt: str, completion: str, extra: str, /) -> float:
    return 0.0


NOT_CALLABLE = 3
