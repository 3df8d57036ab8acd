"""Keeping freed memory in the process, so torch's CPU kernels do not fault pages in again.

glibc's ``malloc`` serves a large request (above ``M_MMAP_THRESHOLD``, 128 KiB at first,
adjusted upward as such blocks are freed) with a fresh ``mmap`` and gives it back on ``free``,
and it trims the heap's top once more than ``M_TRIM_THRESHOLD`` lies free there. Either way a
tensor of the same size allocated a moment later is new memory again, and writing it faults
in every page. A model step allocates such tensors per layer (a 1,024-token prefill of a
512-wide model: 2 MiB per activation, 5.5 MiB in the MLP), so on these virtual machines a
kernel of 50 us became 3 ms (measured: an RMSNorm over ``[1024, 512]``, 2.9 ms before, 0.29
ms after; a whole 1,024-token prefill of an 8-layer 25M-parameter Llama, 980 ms before and 700
ms after). Raising both thresholds keeps freed blocks in the heap for reuse, as tcmalloc (what
vLLM's CPU guide preloads) does. The price is that the process's resident memory stays at its
peak.

:func:`keep_freed_memory` sets both once per process; it is a no-op where ``mallopt`` does not
exist (another C library) and when ``ORCHESTR_KEEP_FREED_MEMORY=0``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

import structlog

__all__ = ["keep_freed_memory"]

log = structlog.get_logger("orchestr.roles")

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: blocks up to this size come from the heap; its free top is trimmed past it
THRESHOLD = 1 << 30

_lock = threading.Lock()
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); whether they are
    raised."""
    global _done
    with _lock:
        if _done is not None:
            return _done
        _done = False
        if os.environ.get("ORCHESTR_KEEP_FREED_MEMORY", "1") == "0":
            return False
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name)
            mallopt = libc.mallopt
        except (OSError, AttributeError, TypeError):
            return False
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        ok = bool(
            mallopt(_M_MMAP_THRESHOLD, THRESHOLD) == 1
            and mallopt(_M_TRIM_THRESHOLD, THRESHOLD) == 1
        )
        if not ok:
            log.warning("mallopt refused the thresholds; freed tensors go back to the kernel")
        _done = ok
        return ok
