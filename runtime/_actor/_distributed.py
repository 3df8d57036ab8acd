"""``torch.distributed`` across the members of a mesh, with the rendezvous done by the runtime.

The controller asks member 0 to open the rendezvous store (a ``TCPStore`` on a free port of its
host), then every member joins the process group with its mesh rank at once.

The store has no authentication of its own, and torch's TCPStore listens on every interface
whatever host it is given. So member 0 binds the listening socket itself, where the cluster
binds (``bind_host``), and hands it to the store; and the group keeps its keys under a random
prefix that only the members learn (over the authenticated call path): another process that
reaches the port can neither read nor change them. The store serves for the worker's lifetime,
since NCCL and ``new_group`` use it after the group has formed. Each member is a
process of its own, so this is the ordinary multi-process setup (gloo on CPU, nccl on GPUs);
members that share a process (``per_process`` > 1) cannot each join and are refused.

The worker half runs in the actor's process as two internal endpoints every actor answers;
torch is imported only when they are called.
"""

from __future__ import annotations

import asyncio
import datetime
import secrets
import socket
from typing import TYPE_CHECKING, Any

from orchestr.errors import ConfigError
from orchestr.fabric import split_url

if TYPE_CHECKING:
    from orchestr._call._mesh import Mesh
    from orchestr._job._context import JobContext

__all__ = ["JOIN_ENDPOINT", "STORE_ENDPOINT", "init_distributed", "join", "open_store"]

STORE_ENDPOINT = "__dist_store__"
JOIN_ENDPOINT = "__dist_join__"
BACKENDS = ("gloo", "nccl")

_store: Any = None  # the rendezvous store member 0 serves, kept for the process's lifetime
_listener: socket.socket | None = None  # its listening socket, bound here


def open_store(host: str, world_size: int, timeout_s: float) -> int:
    """Member 0: serve the rendezvous store on a free port of ``host`` (and only there);
    returns the port."""
    global _store, _listener
    from torch import distributed as dist

    if dist.is_initialized():
        raise ConfigError(
            "torch.distributed is already initialised in this process (one process group per "
            "worker process)"
        )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(max(64, world_size))
    port: int = listener.getsockname()[1]
    _store = dist.TCPStore(  # type: ignore[attr-defined]
        host,
        port,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
        use_libuv=True,
    )
    _listener = listener  # the store serves on its descriptor: keep it open
    return port


def join(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    prefix: str,
) -> dict[str, Any]:
    """Join the process group (blocks until every member has; runs in a thread)."""
    from torch import distributed as dist

    if dist.is_initialized():
        raise ConfigError(
            "torch.distributed is already initialised in this process: members sharing a "
            "worker process (per_process > 1) cannot each join a process group"
        )
    if not (isinstance(prefix, str) and len(prefix) >= 32):
        raise ConfigError("a process group's store prefix is a secret of 32 characters or more")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _store if rank == 0 else dist.TCPStore(host, port, world_size, timeout=timeout)  # type: ignore[attr-defined]
    store = dist.PrefixStore(f"{prefix}/", store)  # type: ignore[attr-defined]
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": backend}


async def init_distributed(
    ctx: JobContext, mesh: Mesh, backend: str | None, timeout_s: float
) -> list[dict[str, Any]]:
    if backend is None:
        backend = "nccl" if _has_cuda() else "gloo"
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not timeout_s > 0:
        raise ConfigError(f"timeout_s must be positive, got {timeout_s!r}")
    members = list(mesh.members)
    if len({m.address for m in members}) != len(members):
        raise ConfigError(
            f"{mesh.name}: members share worker processes (per_process > 1); a process group "
            f"needs a process per member"
        )
    world = len(members)
    client = ctx.client
    prefix = secrets.token_hex(16)
    first = members[0]
    _, host, _ = split_url(first.address.partition("?")[0])
    port = await client.call(
        first.address,
        first.actor_id,
        mesh.label(first),
        STORE_ENDPOINT,
        (host, world, timeout_s),
        {},
    )
    joined = [
        client.call(
            m.address,
            m.actor_id,
            mesh.label(m),
            JOIN_ENDPOINT,
            (host, port, m.rank, world, backend, timeout_s, prefix),
            {},
            timeout_s + 5,
        )
        for m in members
    ]
    results: list[dict[str, Any]] = await asyncio.gather(*joined)
    ctx.events.record("distributed", mesh=mesh.name, world_size=world, backend=backend)
    return results


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return bool(torch.cuda.is_available())
