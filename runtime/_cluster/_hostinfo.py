"""What a node finds out about its host: its resources, its data-plane transports and devices,
the import path its workers get, whether a worker's process is stopped, and the labels
it is given on its command line."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

from orchestr.errors import ConfigError

from ._statedir import proc_stat

__all__ = ["detect_fabric", "detect_resources", "is_stopped", "merge_pythonpath", "parse_labels"]


def detect_resources() -> dict[str, float]:
    """CPUs, memory (bytes) and GPUs of this host, without importing torch."""
    cpus = float(
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    gpus = 0.0
    with contextlib.suppress(OSError):
        gpus = float(len(os.listdir("/proc/driver/nvidia/gpus")))
    return {"cpu": cpus, "memory": memory, "gpu": gpus}


def detect_fabric() -> tuple[list[str], list[str]]:
    """The data-plane transports this host's workers can use (stream and buffer transports
    that load here; ``inproc`` left out, it never crosses a process) and its devices
    (``cuda:N`` per NVIDIA GPU, ``rdma:NAME`` per RDMA device), for ``orchestr status``."""
    from orchestr.fabric import stream_transports
    from orchestr.fabric.lowlevel import usable_buffer_transports

    usable = {t.scheme for t in usable_buffer_transports()}
    transports = sorted(({*stream_transports()} | usable) - {"inproc"})
    devices: list[str] = []
    with contextlib.suppress(OSError):
        gpus = sorted(os.listdir("/proc/driver/nvidia/gpus"))
        devices += [f"cuda:{i}" for i in range(len(gpus))]
    with contextlib.suppress(OSError):
        devices += [f"rdma:{name}" for name in sorted(os.listdir("/sys/class/infiniband"))]
    return transports, devices


def merge_pythonpath(job_path: Sequence[str], own: str) -> tuple[str, list[str]]:
    """A worker's ``PYTHONPATH``: the folders of the spawning job's import path first, then
    ``own`` (the node's ``PYTHONPATH``), each once, in order; and the job's folders this node
    does not have, which are left out (the job may run on another host)."""
    found = [folder for folder in job_path if os.path.isdir(folder)]
    missing = [folder for folder in job_path if folder not in found]
    entries = [*found, *(own.split(os.pathsep) if own else ())]
    return os.pathsep.join(dict.fromkeys(entries)), missing


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state ``T``: SIGSTOP; ``t``: a tracer's stop)."""
    return proc_stat(pid)[:1] in ([b"T"], [b"t"])


# -- running a node on its own ---------------------------------------------------------------
def parse_labels(text: str) -> dict[str, str]:
    """``"k=v,k2=v2"`` -> ``{"k": "v", "k2": "v2"}``; empty text gives no labels."""
    labels: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"a label is key=value, got {item!r}")
        labels[key.strip()] = value.strip()
    return labels
