"""orchestr's own CPU kernel: decode attention over the paged KV cache (``paged_attention.cpp``).

Torch has no CPU attention that reads a block table, and its fused CPU attention
(``scaled_dot_product_attention``) spends most of a decode step's time on overhead at one
query row: measured here on 32 sequences of 256 positions, 8 query / 4 key-value heads of 64
(two threads), it took 1.29 ms a layer on keys already gathered into dense rows, against 0.82
ms for this kernel reading the blocks where they are (with the gather saved too).

The kernel is compiled on first use with torch's extension builder
(``torch.utils.cpp_extension.load``: ninja and a C++ compiler), for the CPU capability torch
itself dispatches to (AVX512, AVX2 or neither: :func:`torch.backends.cpu.get_cpu_capability`),
and cached under torch's extensions folder (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``), so later processes only load it. ``make setup`` builds it once
(calling :func:`kernel_status`). Where it cannot be built (no compiler), or
with ``ORCHESTR_KERNELS=0``, :func:`decode_attention` is ``None`` and the paged runner uses
torch's attention instead, with the same results to float32 rounding.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["DecodeAttention", "decode_attention", "kernel_status"]

log = logging.getLogger(__name__)

#: ``op(q [n, heads, dim], k_pool, v_pool [blocks, size, kv_heads, dim], tables [n, width]
#: int32, lengths [n] int64, scale) -> [n, heads, dim]``
DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]

SOURCE = Path(__file__).with_name("paged_attention.cpp")
#: compiler flags per CPU capability, matching how torch builds its own kernels for it
FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "DEFAULT": [],
}

_lock = threading.Lock()
_tried = False
_op: DecodeAttention | None = None
_why: str | None = None


def _capability() -> str:
    cap = torch.backends.cpu.get_cpu_capability()
    return cap if cap in FLAGS else "DEFAULT"


def _build() -> DecodeAttention | str:
    """The op, built or loaded; or why it cannot be."""
    if os.environ.get("ORCHESTR_KERNELS", "1") == "0":
        return "ORCHESTR_KERNELS=0"
    if sys.platform != "linux":
        return f"the kernel is built on Linux only, not {sys.platform}"
    try:
        from torch.utils.cpp_extension import load
    except ImportError as exc:  # pragma: no cover - torch always ships it
        return f"torch's extension builder is missing: {exc}"
    cap = _capability()
    try:
        load(
            name=f"orchestr_kernels_{cap.lower()}",
            sources=[str(SOURCE)],
            extra_cflags=[
                "-O3",
                "-fopenmp",
                f"-DCPU_CAPABILITY={cap}",
                f"-DCPU_CAPABILITY_{cap}",
                *FLAGS[cap],
            ],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError, ValueError, subprocess.SubprocessError) as exc:
        return f"building {SOURCE.name} failed: {str(exc).strip().splitlines()[-1:]}"
    op: DecodeAttention = torch.ops.orchestr_kernels.decode_attention
    return op


def decode_attention() -> DecodeAttention | None:
    """The paged decode attention op, built on first call (this can take about 20 s; later
    processes load the cached build); ``None`` where it cannot run (:func:`kernel_status`
    says why, and a warning says it once)."""
    global _tried, _op, _why
    with _lock:
        if not _tried:
            built = _build()
            _tried = True
            if isinstance(built, str):
                _why = built
                log.warning("paged decode attention runs on torch's attention: %s", built)
            else:
                _op = built
        return _op


def kernel_status() -> str | None:
    """Why the kernel is not in use (``None`` when it is), building it if not yet tried."""
    decode_attention()
    return _why
