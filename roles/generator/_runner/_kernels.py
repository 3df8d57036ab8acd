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

A library is code that runs as this user, so one is built in and loaded from a folder only
when no other user can have put it there: the build folder and the library must be this
user's and writable by no one else, and every folder above them this user's or root's and
not writable by others, unless its sticky bit keeps others from renaming or removing what is
ours in it (``/tmp``). Folders that are missing are made with mode 0700. Anywhere else (a
``TORCH_EXTENSIONS_DIR`` shared by several users, say) nothing is built or loaded, and
:func:`kernel_status` says why. Builds and loads of one folder take turns under an ``flock``
on its ``orchestr.lock``, which the kernel drops when its holder dies, so a killed build
blocks no one; a process waits at most :data:`LOCK_WAIT_S` for another's build. A library
that loads without the ops leaves the paged runner on torch's ops, as a failed build does.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
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


#: How long a process waits for another one building or loading the kernels in the same
#: folder (a build takes about a minute here) before it runs on torch's ops instead.
LOCK_WAIT_S = 600.0
#: Held (``flock``) around every build and load in a build folder. The kernel drops it when
#: its holder dies, so a build that was killed leaves nothing behind to wait on.
LOCK_FILE = "orchestr.lock"
#: torch's builder's own lock: a file it creates, and waits on for as long as it exists.
TORCH_LOCK_FILE = "lock"

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def _name_and_flags() -> tuple[str, list[str]]:
    """The build folder's name (the library's too) and the compiler flags."""
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
    return f"orchestr_kernels_{cap.lower()}_{digest}", cflags


def _owner_problem(path: Path, st: os.stat_result, *, above: bool) -> str | None:
    """Why another user could put or replace what is at ``path`` (``st`` is its ``lstat``),
    or ``None``. The build folder and the library must be this user's and writable by no one
    else. A folder ``above`` them may also be root's, and may be writable by others when its
    sticky bit is set (``/tmp``): no one else can then rename or remove what is ours in it."""
    uid = os.geteuid()
    if st.st_uid != uid and not (above and st.st_uid == 0):
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & _WRITABLE_BY_OTHERS and not (above and st.st_mode & stat.S_ISVTX):
        return f"{path} is writable by other users (mode {stat.filemode(st.st_mode)})"
    return None


def _claim(folder: Path) -> str | None:
    """Make ``folder`` and any folder missing above it (mode 0700; each one only once the
    folders above it have passed), checking every folder from ``/`` down: ``None`` when no
    other user can put or replace anything in ``folder``, else why. A symbolic link on the
    way is refused: resolve the path first. Raises ``OSError`` when a folder cannot be
    made."""
    for path in [*reversed(folder.parents), folder]:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass  # made meanwhile, by whoever: checked below as any other
            st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            return f"{path} is not a folder (a link, or a file)"
        problem = _owner_problem(path, st, above=path != folder)
        if problem is not None:
            return problem
    return None


def _library_problem(library: Path) -> str | None:
    st = os.lstat(library)
    if not stat.S_ISREG(st.st_mode):
        return f"{library} is not a regular file (a link, or something else)"
    return _owner_problem(library, st, above=False)


def _take(path: Path, wait_s: float) -> int | None:
    """An open descriptor of ``path`` that holds its exclusive ``flock``, or ``None`` when
    other processes held it for all of ``wait_s``. The lock is polled rather than waited on
    in the kernel so that the deadline holds; it is dropped when the descriptor is closed or
    its process dies. Raises ``OSError`` when ``path`` cannot be opened."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + wait_s
    waiting = False
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if not waiting:
                    log.info("waiting up to %.0f s for another process's hold on %s", left, path)
                    waiting = True
                time.sleep(min(0.1, left))
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def _load_or_build(name: str, cflags: list[str], folder: Path) -> str | None:
    """Load the library in ``folder``, built first when it is missing or its last build was
    cut short; ``None`` once loaded, else why not. The caller holds the folder's lock."""
    library = folder / f"{name}.so"
    torch_lock = folder / TORCH_LOCK_FILE
    if os.path.lexists(library) and not os.path.lexists(torch_lock):
        try:
            problem = _library_problem(library)
            if problem is not None:
                return (
                    f"the kernels' library is not loaded: {problem}; remove {folder} to rebuild it"
                )
            # built before: load it directly (torch's builder spends 0.05-0.1 s here
            # importing itself and asking ninja whether the build is current)
            torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
        except OSError as exc:
            return f"loading {library} failed: {exc}; remove {folder} to rebuild it"
        return None
    try:
        from torch.utils.cpp_extension import load

        # every build here runs under our lock, so a lock file of torch's builder seen now
        # was left by a build that was killed: the builder would wait on it forever
        torch_lock.unlink(missing_ok=True)
        load(
            name=name,
            sources=[str(SOURCE)],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )
        # the linker wrote it with the umask's mode: the next load checks it is ours alone
        st = os.lstat(library)
        if st.st_mode & _WRITABLE_BY_OTHERS:
            os.chmod(library, stat.S_IMODE(st.st_mode) & ~_WRITABLE_BY_OTHERS)
    except (RuntimeError, OSError, ImportError, ValueError, subprocess.SubprocessError) as exc:
        return f"building {SOURCE.name} failed: {str(exc).strip().splitlines()[-1:]}"
    return None


def _build(wait_s: float | None = None) -> Kernels | str:
    """The ops, built or loaded; or why they cannot be. Blocks on the build, and for at most
    ``wait_s`` (:data:`LOCK_WAIT_S` by default) on another process's build of the folder."""
    if os.environ.get("ORCHESTR_KERNELS", "1") == "0":
        return "ORCHESTR_KERNELS=0"
    if sys.platform != "linux":
        return f"the kernel is built on Linux only, not {sys.platform}"
    name, cflags = _name_and_flags()
    folder = Path(os.path.realpath(_build_root())) / name
    try:
        problem = _claim(folder)
    except OSError as exc:
        return f"cannot make the kernels' build folder {folder}: {exc.strerror}"
    if problem is not None:
        return (
            f"the kernels are neither built nor loaded in {folder}: {problem}, so another "
            f"user could put a library there for this process to run; set "
            f"TORCH_EXTENSIONS_DIR to a folder of your own that only you can write to"
        )
    lock = folder / LOCK_FILE
    wait_s = LOCK_WAIT_S if wait_s is None else wait_s
    try:
        held = _take(lock, wait_s)
    except OSError as exc:
        return f"cannot open the kernels' build lock {lock}: {exc.strerror}"
    if held is None:
        return (
            f"another process held {lock} for {wait_s:g} s (building the kernels, or stopped "
            f"while it did); the next process tries again"
        )
    try:
        failed = _load_or_build(name, cflags, folder)
    finally:
        os.close(held)
    if failed is not None:
        return failed
    namespace = torch.ops.orchestr_kernels
    try:
        found = {op.name: getattr(namespace, op.name) for op in fields(Kernels)}
    except (AttributeError, RuntimeError) as exc:
        return (
            f"the library in {folder} lacks the kernels' ops ({exc}); remove {folder} to rebuild it"
        )
    return Kernels(**found)


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
