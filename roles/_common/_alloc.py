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

A sharded trainer wants the opposite (:func:`return_freed_memory`): its point is a smaller
peak, and each step gathers a layer's weights, frees them, and gathers the next. With glibc's
threshold rising to every size freed (up to 32 MiB), those buffers came from the heap and
stayed resident when freed, so a sharded member's peak resident memory was above a replicated
one's (measured by ``bench/parallel.py``: a 57M-parameter TinyLM on two members, 1,482
against 1,276 MiB above the process's own). A fixed threshold of 1 MiB sends every large
buffer to ``mmap`` and back to the kernel when freed: 494 MiB on the same model.

:func:`peak_resident_bytes` is what a process measures its own peak by. ``getrusage``'s
``ru_maxrss`` does not do: Linux carries it over ``exec``, so a worker started by a large
process (a controller holding a model, say) reports that process's size as its own peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import threading
from typing import Any

import structlog

__all__ = ["keep_freed_memory", "peak_resident_bytes", "return_freed_memory"]

log = structlog.get_logger("orchestr.roles")

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: blocks up to this size come from the heap; its free top is trimmed past it
THRESHOLD = 1 << 30
#: :func:`return_freed_memory`'s fixed mmap threshold
RETURN_THRESHOLD = 1 << 20

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
        mallopt = _mallopt()
        if mallopt is None:
            return False
        ok = bool(
            mallopt(_M_MMAP_THRESHOLD, THRESHOLD) == 1
            and mallopt(_M_TRIM_THRESHOLD, THRESHOLD) == 1
        )
        if not ok:
            log.warning("mallopt refused the thresholds; freed tensors go back to the kernel")
        _done = ok
        return ok


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at :data:`RETURN_THRESHOLD` for this process, so large
    freed blocks go back to the kernel (unless :func:`keep_freed_memory` ran here: a process
    does one or the other); whether it is set."""
    with _lock:
        if _done:
            return False
        mallopt = _mallopt()
        return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, RETURN_THRESHOLD) == 1


def _mallopt() -> Any:
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def peak_resident_bytes() -> int:
    """This process's peak resident memory: ``VmHWM`` of ``/proc/self/status`` (this program's
    own, since its ``exec``), or ``ru_maxrss`` where there is no such file."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
