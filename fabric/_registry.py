"""The backends of this process by URL scheme, the data-plane settings, and the capability
report.

Built-in buffer backends are ``inproc``, ``shm``, ``tcp`` and ``rdma`` (pyverbs, imported only
when first probed); ``nixl`` loads when the ``nixl`` package is installed. Out-of-tree backends
register through the ``orchestr.transports`` entry-point group: the entry point's name is the
scheme and its object a callable (a class) returning the backend; one with ``connect`` and
``listen`` is a stream backend, one with ``read_into`` and ``write_from`` a buffer backend.
Entry points load on the first lookup of a scheme this process does not know.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from ._buffers import _transport as _buffers
from ._buffers._fallback import PREFERENCE, Fallback, check_fallback
from ._buffers._transport import BufferTransport
from ._streams import _transport as _streams

__all__ = [
    "buffer_transport",
    "buffer_transports",
    "configure",
    "register_buffer_transport",
    "settings",
    "transport_report",
]

log = structlog.get_logger("orchestr.fabric")
ENTRY_POINT_GROUP = "orchestr.transports"


@dataclasses.dataclass
class Settings:
    #: Address the tcp buffer server binds.
    bind_host: str = "127.0.0.1"
    #: What happens when the wanted transport cannot be used: "allow" (logged, counted) or "error".
    fallback: Fallback = "allow"
    #: Seconds a buffer transfer, or a side-channel connection, may go without progress before
    #: the peer is taken as stuck (stopped, or gone silent) and the transfer fails.
    stall_timeout: float = 30.0


settings = Settings()


def configure(
    *,
    bind_host: str | None = None,
    fallback: str | None = None,
    stall_timeout: float | None = None,
) -> None:
    """Set this process's data-plane settings (the runtime calls this from its Config)."""
    if bind_host is not None:
        settings.bind_host = bind_host
    if stall_timeout is not None:
        if not stall_timeout > 0:
            raise ValueError(f"stall_timeout must be positive, got {stall_timeout!r}")
        settings.stall_timeout = stall_timeout
    if fallback is not None:
        settings.fallback = check_fallback(fallback)


_lock = threading.Lock()
_factories: dict[str, Callable[[], BufferTransport]] = {}
_instances: dict[str, BufferTransport] = {}
_entry_points_loaded = False


def register_buffer_transport(scheme: str, factory: Callable[[], BufferTransport]) -> None:
    """Make ``scheme`` descriptors use the backend ``factory()`` builds (on first use)."""
    with _lock:
        _factories[scheme] = factory
        _instances.pop(scheme, None)


def _builtin(module: str, name: str) -> Callable[[], BufferTransport]:
    def make() -> BufferTransport:
        cls = getattr(importlib.import_module(module, __package__), name)
        return cls()  # type: ignore[no-any-return]

    return make


register_buffer_transport("inproc", _builtin("._buffers._inproc", "InprocBuffers"))
register_buffer_transport("shm", _builtin("._buffers._shm", "ShmBuffers"))
register_buffer_transport("tcp", _builtin("._buffers._tcp", "TcpBuffers"))
register_buffer_transport("rdma", _builtin("._buffers._rdma", "RdmaBuffers"))
register_buffer_transport("nixl", _builtin("._buffers._nixl", "NixlBuffers"))


def _constant(backend: BufferTransport) -> Callable[[], BufferTransport]:
    return lambda: backend


def plugins(group: str, what: str) -> Iterator[tuple[str, Any]]:
    """``(name, object)`` for each entry point of ``group``: what its factory returns. A
    plug-in that fails to load is logged (as a ``what`` plug-in) and skipped."""
    import importlib.metadata  # here: ~7 ms of every worker's start-up otherwise

    for ep in importlib.metadata.entry_points(group=group):
        try:
            obj = ep.load()()
        except Exception as exc:
            log.warning(f"cannot load {what} plug-in", name=ep.name, error=repr(exc))
            continue
        yield ep.name, obj


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for name, backend in plugins(ENTRY_POINT_GROUP, "transport"):
        if hasattr(backend, "connect") and hasattr(backend, "listen"):
            _streams.register_stream_transport(name, backend)
        elif hasattr(backend, "read_into") and hasattr(backend, "write_from"):
            register_buffer_transport(name, _constant(backend))
        else:
            log.warning("transport plug-in is neither a stream nor a buffer backend", name=name)


def buffer_transport(scheme: str) -> BufferTransport | None:
    """The backend for ``scheme``, built on first use; ``None`` if unknown."""
    t = _instances.get(scheme)
    if t is not None:
        return t
    _load_entry_points()
    factory = _factories.get(scheme)
    if factory is None:
        return None
    with _lock:
        t = _instances.get(scheme)
        if t is None:
            t = factory()
            _instances[scheme] = t
    return t


def buffer_transports() -> list[str]:
    _load_entry_points()
    return sorted(_factories)


def usable_buffer_transports() -> list[BufferTransport]:
    """Backends that work in this process, in preference order."""
    out = []
    for scheme in buffer_transports():
        try:
            t = buffer_transport(scheme)
        except ImportError:
            continue
        if t is not None and t.probe() is None:
            out.append(t)
    order = PREFERENCE
    return sorted(out, key=lambda t: order.index(t.scheme) if t.scheme in order else 99)


def transport_report() -> list[dict[str, Any]]:
    """What this process can use: one entry per backend with ``available`` and, when it is not,
    ``reason``. Backends may add details (the rdma backend lists its devices)."""
    rows: list[dict[str, Any]] = []
    for scheme in _streams.stream_transports():
        rows.append({"scheme": scheme, "kind": "stream", "available": True})
    for scheme in buffer_transports():
        try:
            t = buffer_transport(scheme)
            reason = "unknown backend" if t is None else t.probe()
        except ImportError as exc:
            t, reason = None, f"cannot import its module: {exc}"
        row: dict[str, Any] = {"scheme": scheme, "kind": "buffer", "available": reason is None}
        if reason is not None:
            row["reason"] = reason
        details = getattr(t, "details", None)
        if callable(details):
            row.update(details())
        rows.append(row)
    stats = _buffers.stats
    for row in rows:
        c = stats.get(row["scheme"])
        if c is not None and row["kind"] == "buffer":
            row["counters"] = dataclasses.asdict(c)
    return rows


#: Functions that list this process's connections (the runtime adds the call path's).
connection_sources: list[Callable[[], list[dict[str, Any]]]] = []


def connections() -> list[dict[str, Any]]:
    """Every open connection of this process with the transport it negotiated: the stream,
    how large values travel (``shm`` or ``inline``), whether the peer shares this host, and
    the reason for any fallback."""
    return [row for source in connection_sources for row in source()]


def release_all() -> int:
    """Release every buffer this process registered (the owning actor is stopping)."""
    return _buffers.release_all(list(_instances.values()))


def shutdown() -> int:
    """Release every buffer, stop backend servers, close the segment pools and go back to the
    default settings (the job or the process is ending). Returns how many buffers were still
    registered."""
    from ._buffers._segments import pool, receive_pool

    released = release_all()
    for t in list(_instances.values()):
        close = getattr(t, "close", None)
        if callable(close):
            close()
    pool.close()
    receive_pool.close()
    fresh = Settings()
    settings.bind_host, settings.fallback = fresh.bind_host, fresh.fallback
    settings.stall_timeout = fresh.stall_timeout
    return released
