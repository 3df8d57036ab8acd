"""The one-sided buffer contract: register memory, share a small descriptor, the peer reads into
or writes from it, completion is the awaited call returning.

A :class:`Region` is memory this process registered; every available backend exports it and
returns where peers find it, so one region has a :class:`Descriptor` per backend. A peer picks
the backend that suits where the owner is (same process, same host, another host) through
:func:`choose`, which applies the fallback policy: a fallback is either an error or logged and
counted, never silent.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import secrets
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol

import structlog

from orchestr.errors import (
    ConfigError,
    DescriptorError,
    FallbackError,
    StaleDescriptorError,
    TransportUnavailableError,
)
from orchestr.fabric import _local

__all__ = [
    "BufferTransport",
    "Descriptor",
    "OneSided",
    "Region",
    "choose",
    "register_memory",
    "release_all",
]

log = structlog.get_logger("orchestr.fabric")

Fallback = Literal["allow", "error"]
FALLBACKS = ("allow", "error")
#: Backends in the order a reader prefers them when the owner offers several.
PREFERENCE = ("inproc", "shm", "rdma", "nixl", "tcp")
_U64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True, slots=True)
class Descriptor:
    """Where a peer finds one registered region through one backend. Small and plain data."""

    transport: str
    owner: str  # the owner's process key, host:pid:nonce
    region: int
    key: int  # a random secret per registration: a peer that did not get it cannot guess it
    length: int
    where: tuple[Any, ...]  # backend-specific routing (a fd, a URL, an rkey)

    def to_wire(self) -> list[Any]:
        return [self.transport, self.owner, self.region, self.key, self.length, list(self.where)]

    @classmethod
    def from_wire(cls, data: Any) -> Descriptor:
        try:
            transport, owner, region, key, length, where = data
        except (TypeError, ValueError):
            raise DescriptorError(f"malformed buffer descriptor {data!r}") from None
        if not (
            isinstance(transport, str)
            and isinstance(owner, str)
            and owner.count(":") == 2
            and all(isinstance(v, int) and 0 <= v <= _U64 for v in (region, key, length))
            and isinstance(where, list | tuple)
        ):
            raise DescriptorError(f"malformed buffer descriptor {data!r}")
        try:
            _local.pid_of(owner)
        except ValueError:
            raise DescriptorError(f"malformed owner {owner!r} in a buffer descriptor") from None
        return cls(transport, owner, region, key, length, tuple(where))

    def check_span(self, offset: int, nbytes: int) -> None:
        """Raise :class:`DescriptorError` unless ``[offset, offset+nbytes)`` lies inside."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.length:
            raise DescriptorError(
                f"[{offset}, +{nbytes}) lies outside the {self.length}-byte buffer "
                f"(region {self.region} of {self.owner})"
            )


class Region:
    """Memory registered by this process. Backends keep their export state in ``exports``."""

    __slots__ = ("exports", "id", "key", "mem", "released")

    def __init__(self, region_id: int, mem: memoryview) -> None:
        self.id = region_id
        self.key = secrets.randbits(63) | 1
        self.mem = mem
        self.released = False
        self.exports: dict[str, tuple[Any, ...]] = {}

    def descriptor(self, scheme: str) -> Descriptor:
        return Descriptor(
            scheme, _local.process_key(), self.id, self.key, self.mem.nbytes, self.exports[scheme]
        )


class BufferTransport(Protocol):
    """What a one-sided backend provides. ``read_into``/``write_from`` may run in a thread."""

    scheme: str

    def probe(self) -> str | None:
        """``None`` when the backend works in this process, else why not (shown to users)."""
        ...

    def reaches(self, owner: str) -> bool:
        """Whether this process can reach memory of the process ``owner`` with this backend."""
        ...

    def export(self, region: Region) -> tuple[Any, ...]:
        """Make ``region`` reachable; returns the descriptor's ``where``."""
        ...

    def unexport(self, region: Region) -> None:
        """Make ``region`` unreachable: later transfers fail with StaleDescriptorError."""
        ...

    async def read_into(self, desc: Descriptor, offset: int, dst: memoryview) -> None:
        """Copy ``len(dst)`` bytes from ``offset`` of the region ``desc`` names into ``dst``. Blocks on
        the transfer; raises :class:`TransportError` (or a subclass) when it fails, with ``dst``
        partly written: not cancel-safe."""
        ...

    async def write_from(self, desc: Descriptor, offset: int, src: memoryview) -> None:
        """Copy ``src`` into the region ``desc`` names at ``offset``. Blocks and raises as
        :meth:`read_into`; not cancel-safe (the region is left partly written)."""
        ...


class OneSided:
    """A base for backends built on one ``move``: checks the destination of a read and counts
    the bytes each transfer moved."""

    scheme: str

    async def move(self, write: bool, desc: Descriptor, offset: int, local: memoryview) -> None:
        """Copy between ``local`` and ``[offset, offset+len(local))`` of the remote region."""
        raise NotImplementedError

    async def read_into(self, desc: Descriptor, offset: int, dst: memoryview) -> None:
        """Copy ``len(dst)`` bytes from ``offset`` of the region ``desc`` names into ``dst``. Blocks on
        the transfer; raises :class:`TransportError` (or a subclass) when it fails, with ``dst``
        partly written: not cancel-safe."""
        if dst.readonly:
            raise ValueError("read_into needs a writable destination")
        await self.move(False, desc, offset, dst)
        count(self.scheme, read=dst.nbytes)

    async def write_from(self, desc: Descriptor, offset: int, src: memoryview) -> None:
        """Copy ``src`` into the region ``desc`` names at ``offset``. Blocks and raises as
        :meth:`read_into`; not cancel-safe (the region is left partly written)."""
        await self.move(True, desc, offset, src)
        count(self.scheme, written=src.nbytes)

    async def read_pieces(
        self,
        desc: Descriptor,
        offset: int,
        dst: memoryview,
        piece: int,
        fn: Callable[[memoryview], Any],
    ) -> list[Any]:
        """:meth:`read_into` piece by piece, ``fn`` called on each piece of ``dst`` once it
        has landed (in a thread for large pieces); ``fn``'s results in order."""
        return await read_pieces_with(self.read_into, desc, offset, dst, piece, fn)


#: Pieces at least this large are handed to ``fn`` in a thread, off the event loop.
FN_THREAD_BYTES = 1 << 20


async def read_pieces_with(
    read_into: Callable[[Descriptor, int, memoryview], Awaitable[None]],
    desc: Descriptor,
    offset: int,
    dst: memoryview,
    piece: int,
    fn: Callable[[memoryview], Any],
) -> list[Any]:
    """The plain form of ``read_pieces`` over any backend's ``read_into``: one piece after
    another."""
    if piece < 1:
        raise ValueError(f"piece must be a positive number of bytes, got {piece}")
    out = []
    for at in range(0, max(dst.nbytes, 1), piece):
        part = dst[at : at + piece]
        await read_into(desc, offset + at, part)
        out.append(
            await asyncio.to_thread(fn, part) if part.nbytes >= FN_THREAD_BYTES else fn(part)
        )
    return out


# -- the region table of this process ------------------------------------------------------------

_lock = threading.Lock()
_regions: dict[int, Region] = {}
_ids = itertools.count(1)


#: Regions whose owning handle was garbage collected: released at the next registration or
#: release (a finalizer must not take locks; it may run while one is held).
_later: collections.deque[tuple[Region, list[BufferTransport]]] = collections.deque()


def release_later(region: Region, transports: list[BufferTransport]) -> None:
    """:func:`release` for finalizers: queued, done by the next registration or release."""
    _later.append((region, transports))


def _drain() -> None:
    while _later:
        release(*_later.popleft())


def register_memory(mem: memoryview, transports: list[BufferTransport]) -> Region:
    """Register ``mem`` (a flat byte view) with every backend in ``transports``."""
    _drain()
    mem = mem.cast("B") if mem.format != "B" or mem.ndim != 1 else mem
    with _lock:
        region = Region(next(_ids), mem)
        _regions[region.id] = region
    try:
        for t in transports:
            region.exports[t.scheme] = t.export(region)
    except BaseException:
        release(region, transports)
        raise
    return region


def release(region: Region, transports: list[BufferTransport]) -> None:
    """Unregister ``region``. Idempotent."""
    with _lock:
        if region.released:
            return
        region.released = True
        _regions.pop(region.id, None)
    for t in transports:
        if t.scheme in region.exports:
            t.unexport(region)
    region.mem = memoryview(b"")


def lookup(region_id: int, key: int) -> Region:
    """The live region a descriptor names; StaleDescriptorError when released or forged."""
    region = _regions.get(region_id)
    if region is None or region.key != key:
        raise StaleDescriptorError(
            f"region {region_id} is not registered here (released, or never was)"
        )
    return region


def release_all(transports: list[BufferTransport]) -> int:
    """Release every region of this process (an actor stopping); returns how many."""
    _drain()
    with _lock:
        regions = list(_regions.values())
    for r in regions:
        release(r, transports)
    return len(regions)


# -- choosing a backend, and the fallback policy ---------------------------------------------------


@dataclasses.dataclass
class Counters:
    bytes_read: int = 0
    bytes_written: int = 0
    transfers: int = 0
    fallbacks: int = 0


stats: dict[str, Counters] = {}
_warned: set[tuple[str, str, str]] = set()


def count(scheme: str, *, read: int = 0, written: int = 0) -> None:
    c = stats.setdefault(scheme, Counters())
    c.bytes_read += read
    c.bytes_written += written
    c.transfers += 1


def natural(owner: str) -> str:
    """The backend a transfer with ``owner`` should use, judged by where it is."""
    if owner == _local.process_key():
        return "inproc"
    if _local.host_of(owner) == _local.host_id():
        return "shm"
    return "rdma"


def check_fallback(fallback: str) -> Fallback:
    if fallback not in FALLBACKS:
        raise ConfigError(f"fallback policy must be one of {FALLBACKS}, got {fallback!r}")
    return fallback  # type: ignore[return-value]


def choose(
    offered: dict[str, Descriptor],
    transports: Callable[[str], BufferTransport | None],
    *,
    want: str | None,
    fallback: Fallback,
) -> tuple[BufferTransport, Descriptor]:
    """Pick the backend for one transfer.

    ``want`` is the backend asked for (``None``: the natural one for where the owner is). If it
    cannot be used, the next usable backend in :data:`PREFERENCE` is a fallback: under
    ``"error"`` that raises :class:`FallbackError`; under ``"allow"`` it is logged (once per
    reason) and counted in :data:`stats`. Raises :class:`TransportUnavailableError` when no
    backend can reach the owner at all.
    """
    if not offered:
        raise DescriptorError("the buffer offers no transport")
    owner = next(iter(offered.values())).owner
    target = want or natural(owner)
    reasons: dict[str, str] = {}
    usable: list[tuple[BufferTransport, Descriptor]] = []
    for scheme in sorted(offered, key=lambda s: PREFERENCE.index(s) if s in PREFERENCE else 99):
        t = transports(scheme)
        why = "not installed in this process" if t is None else t.probe()
        if t is not None and why is None and not t.reaches(owner):
            why = f"cannot reach {owner} from {_local.process_key()}"
        if why is None and t is not None:
            usable.append((t, offered[scheme]))
        else:
            reasons[scheme] = why or "unusable"
    for t, d in usable:
        if t.scheme == target:
            return t, d
    if want is None and target == "rdma" and "rdma" not in offered:
        target = "tcp"  # the owner has no RDMA device: TCP is the natural path, not a fallback
        for t, d in usable:
            if t.scheme == "tcp":
                return t, d
    if not usable:
        detail = "; ".join(f"{s}: {r}" for s, r in reasons.items())
        raise TransportUnavailableError(f"no transport reaches the buffer of {owner} ({detail})")
    t, d = usable[0]
    why = reasons.get(target, "the owner did not offer it")
    if fallback == "error":
        raise FallbackError(
            f"{target} was wanted for the buffer of {owner} but cannot be used ({why}); "
            f"{t.scheme} would work, but the fallback policy is 'error' "
            f"(allow it with fallback='allow' or ORCHESTR_TRANSPORT_FALLBACK=allow)"
        )
    stats.setdefault(t.scheme, Counters()).fallbacks += 1
    if (target, t.scheme, why) not in _warned:
        _warned.add((target, t.scheme, why))
        log.warning("transport fallback", wanted=target, using=t.scheme, reason=why, owner=owner)
    return t, d
