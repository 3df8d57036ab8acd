"""orchestr's own CPU kernels for the paged runner (``kernels.cpp``): decode attention over the
paged KV cache, and the elementwise work around the products fused into one pass each.

- ``decode_attention``: one query per sequence over its keys and values where they lie in the
  block pool, through its block table. Torch has no CPU attention that reads a block table,
  and its fused CPU attention (``scaled_dot_product_attention``) spends most of a decode
  step's time on overhead at one query row: measured here on 32 sequences of 256 positions,
  8 query / 4 key-value heads of 64 (two threads), it took 1.29 ms a layer on keys already
  gathered into dense rows, against 0.63 ms for this kernel reading the scattered blocks
  (0.41 ms since it prefetches each block's values while it scores the block's keys).
- ``prefill_attention``: a prefill chunk's causal attention over its sequence's blocks (the
  keys before the chunk and its own), in tiles of keys scored by broadcast multiply-adds with
  an online softmax, values added four rows at a time: measured here on a 1,024-token prompt
  (8 query / 4 key-value heads of 64, two threads), 8.9-10 ms a layer against 12.7-13.7 ms
  for torch's causal flash attention on the keys gathered densely (and the gather saved).
- ``rope_and_cache``: rotary positions applied in place to a fused q/k/v product's rows, and
  each token's keys and values written to its slot of the pool (one pass, where torch took a
  concatenation, a negation, two products, a sum and two indexed writes).
- ``silu_and_mul``: ``silu(gate) * up`` of the fused gate/up product.
- ``add_rms_norm``: the residual sum in place, then RMSNorm, per row.

They are compiled on first use with torch's extension builder
(``torch.utils.cpp_extension.load``: ninja and a C++ compiler), for the CPU capability torch
itself dispatches to (AVX512, AVX2 or neither: :func:`torch.backends.cpu.get_cpu_capability`),
and cached under torch's extensions folder (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions/pyXY``) in a folder named by a digest of the source, the flags and
the torch install, so later processes load the library directly. ``make setup`` builds them
once (calling :func:`kernel_status`). Where they cannot be built (no compiler), or with
``ORCHESTR_KERNELS=0``, :func:`kernels` is ``None`` and the paged runner uses torch's ops
instead, with the same tokens (the same values to float32 rounding).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["DecodeAttention", "Kernels", "kernel_status", "kernels"]

log = logging.getLogger(__name__)

#: ``op(q [n, heads, dim], k_pool, v_pool [blocks, size, kv_heads, dim], tables [n, width]
#: int32, lengths [n] int64, scale) -> [n, heads, dim]``
DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


@dataclass(frozen=True)
class Kernels:
    """The built ops (``torch.ops.orchestr_kernels``), each documented in ``kernels.cpp``."""

    decode_attention: DecodeAttention
    #: ``(q [n, heads, dim], k_pool, v_pool, table [blocks] int32, start, scale) -> [n,
    #: heads, dim]``: a chunk at positions ``start .. start + n - 1``, causal
    prefill_attention: Callable[..., torch.Tensor]
    #: ``(qkv [t, (heads + 2 kv_heads) dim], positions [t], cos, sin [positions, dim / 2],
    #: k_pool, v_pool, slots [t], heads)``: rotates qkv's queries and keys in place, writes
    #: keys and values to the pools' slots
    rope_and_cache: Callable[..., None]
    #: ``(x [.., 2 w]) -> [.., w]``
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    #: ``(hidden, delta or None, weight, eps) -> normed``; ``hidden += delta`` in place
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float], torch.Tensor]


SOURCE = Path(__file__).with_name("kernels.cpp")
#: compiler flags per CPU capability, matching how torch builds its own kernels for it
FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "DEFAULT": [],
}

_lock = threading.Lock()
_tried = False
_ops: Kernels | None = None
_why: str | None = None


def _capability() -> str:
    cap = torch.backends.cpu.get_cpu_capability()
    return cap if cap in FLAGS else "DEFAULT"


def _build_root() -> Path:
    """Where builds go: ``TORCH_EXTENSIONS_DIR``, else torch's default root
    (``$XDG_CACHE_HOME/torch_extensions``, as ``get_default_build_root`` says, without
    importing the builder) and a folder per Python."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(cache).resolve() / "torch_extensions" / version


#: A build lock older than this was left by a build that was killed (a build takes about a
#: minute here): torch's builder would wait on it forever.
STALE_LOCK_S = 600.0


def clear_stale_lock(folder: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove ``folder``'s build lock when it is older than ``max_age_s`` (torch's builder
    takes the lock by creating the file and never checks its holder is alive, so a build
    killed mid-way blocks every later one); returns whether it did."""
    lock = folder / "lock"
    try:
        if time.time() - lock.stat().st_mtime <= max_age_s:
            return False
        lock.unlink()
    except FileNotFoundError:
        return False
    return True


def _build() -> Kernels | str:
    """The op, built or loaded; or why it cannot be."""
    if os.environ.get("ORCHESTR_KERNELS", "1") == "0":
        return "ORCHESTR_KERNELS=0"
    if sys.platform != "linux":
        return f"the kernel is built on Linux only, not {sys.platform}"
    cap = _capability()
    cflags = [
        "-O3",
        # products and sums rounded one at a time, as torch's elementwise ops round them
        # (explicit fused multiply-adds stay where the code asks for them)
        "-ffp-contract=off",
        "-fopenmp",
        f"-DCPU_CAPABILITY={cap}",
        f"-DCPU_CAPABILITY_{cap}",
        *FLAGS[cap],
    ]
    # one build per torch install (each venv's build names its own torch's headers, and one
    # folder shared by two venvs would be rebuilt by each in turn), source and flags: a
    # folder's library is then current by its name alone
    key = "\0".join([str(Path(torch.__file__).parent), torch.__version__, *cflags])
    digest = hashlib.sha256(key.encode() + b"\0" + SOURCE.read_bytes()).hexdigest()[:12]
    name = f"orchestr_kernels_{cap.lower()}_{digest}"
    folder = _build_root() / name
    library = folder / f"{name}.so"
    try:
        if library.is_file() and not (folder / "lock").exists():
            # built before: load it directly (torch's builder spends 0.05-0.1 s here
            # importing itself and asking ninja whether the build is current)
            torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
        else:
            from torch.utils.cpp_extension import load

            folder.mkdir(parents=True, exist_ok=True)
            clear_stale_lock(folder)
            load(
                name=name,
                sources=[str(SOURCE)],
                extra_cflags=cflags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                is_python_module=False,
                verbose=False,
            )
    except (RuntimeError, OSError, ImportError, ValueError, subprocess.SubprocessError) as exc:
        return f"building {SOURCE.name} failed: {str(exc).strip().splitlines()[-1:]}"
    ops = torch.ops.orchestr_kernels
    return Kernels(
        ops.decode_attention,
        ops.prefill_attention,
        ops.rope_and_cache,
        ops.silu_and_mul,
        ops.add_rms_norm,
    )


def kernels() -> Kernels | None:
    """The ops, built on first call (this can take about 30 s; later processes load the cached
    build); ``None`` where they cannot run (:func:`kernel_status` says why, and a warning
    says it once)."""
    global _tried, _ops, _why
    with _lock:
        if not _tried:
            built = _build()
            _tried = True
            if isinstance(built, str):
                _why = built
                log.warning("the paged runner runs on torch's ops alone: %s", built)
            else:
                _ops = built
        return _ops


def kernel_status() -> str | None:
    """Why the kernels are not in use (``None`` when they are), building them if not yet
    tried."""
    kernels()
    return _why
