"""The one-sided buffer contract: register memory, share a small descriptor, the peer reads into
or writes from it, completion is the awaited call returning.

A :class:`Region` is memory this process registered; every available backend exports it and
returns where peers find it, so one region has a :class:`Descriptor` per backend. A peer picks
the backend that suits where the owner is (same process, same host, another host) through
:func:`._fallback.choose`, which applies the fallback policy. A region may be scoped: peers
reach only its spans (:mod:`._scope`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import secrets
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from orchestr.errors import DescriptorError, StaleDescriptorError
from orchestr.fabric import _local

from . import _scope
from ._scope import Scope

__all__ = [
    "BufferTransport",
    "Descriptor",
    "OneSided",
    "Region",
    "register_memory",
    "release_all",
]

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
    #: The spans a peer may reach (:mod:`._scope`), ``None`` for the whole region. Owners
    #: that enforce scopes check their own copy; this one lets a reader refuse early, and is
    #: what a ``"reader"``-scoped backend checks.
    scope: Scope | None = None

    def to_wire(self) -> list[Any]:
        wire = [self.transport, self.owner, self.region, self.key, self.length, list(self.where)]
        return wire if self.scope is None else [*wire, list(self.scope)]

    @classmethod
    def from_wire(cls, data: Any) -> Descriptor:
        try:
            transport, owner, region, key, length, where, *rest = data
        except (TypeError, ValueError):
            raise DescriptorError(f"malformed buffer descriptor {data!r}") from None
        if len(rest) > 1:
            raise DescriptorError(f"malformed buffer descriptor {data!r:.200}")
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
        scope = _scope.parse(rest[0], length) if rest else None
        return cls(transport, owner, region, key, length, tuple(where), scope)

    def check_span(self, offset: int, nbytes: int) -> None:
        """Raise :class:`DescriptorError` unless ``[offset, offset+nbytes)`` lies inside (and
        inside one span of a scoped buffer)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.length:
            raise DescriptorError(
                f"[{offset}, +{nbytes}) lies outside the {self.length}-byte buffer "
                f"(region {self.region} of {self.owner})"
            )
        if self.scope is not None and not _scope.covers(self.scope, offset, nbytes):
            raise DescriptorError(outside_scope(offset, nbytes, self.region, self.owner))


def outside_scope(offset: int, nbytes: int, region: int, owner: str) -> str:
    """The message of a transfer refused because it lies outside its buffer's spans."""
    return (
        f"[{offset}, +{nbytes}) lies outside the spans this buffer grants (region {region} of "
        f"{owner}); ask its owner for a buffer that covers those bytes"
    )


class Region:
    """Memory registered by this process. Backends keep their export state in ``exports``.
    ``scope`` (:mod:`._scope`) is what peers may reach of ``mem``, ``None`` for all of it:
    the owner's own copy, which the backends that enforce scopes check."""

    __slots__ = ("exports", "id", "key", "mem", "released", "scope")

    def __init__(self, region_id: int, mem: memoryview, scope: Scope | None = None) -> None:
        self.id = region_id
        self.key = secrets.randbits(63) | 1
        self.mem = mem
        self.scope = scope
        self.released = False
        self.exports: dict[str, tuple[Any, ...]] = {}

    def descriptor(self, scheme: str) -> Descriptor:
        return Descriptor(
            scheme,
            _local.process_key(),
            self.id,
            self.key,
            self.mem.nbytes,
            self.exports[scheme],
            self.scope,
        )

    def reaches(self, offset: int, nbytes: int) -> bool:
        """Whether a peer may move ``[offset, offset + nbytes)`` of this region."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.mem.nbytes:
            return False
        return self.scope is None or _scope.covers(self.scope, offset, nbytes)


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

    @property
    def scheme(self) -> str:
        """The backend's URL scheme; each backend's class names its own."""
        raise NotImplementedError

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


def scoping(transport: BufferTransport) -> str | None:
    """How ``transport`` keeps a scoped region's peers inside its spans: ``"owner"`` (the
    owner or its adapter refuses the rest), ``"reader"`` (the reader checks the owner-made
    descriptor), or ``None``: it does not, and never exports a scoped region."""
    how = getattr(transport, "scoped", None)
    return how if how in ("owner", "reader") else None


def register_memory(
    mem: memoryview, transports: list[BufferTransport], scope: Scope | None = None
) -> Region:
    """Register ``mem`` (a flat byte view) with every backend in ``transports``; with a
    ``scope``, with those of them that keep peers inside it (:func:`scoping`)."""
    _drain()
    mem = mem.cast("B") if mem.format != "B" or mem.ndim != 1 else mem
    if scope is not None:
        transports = [t for t in transports if scoping(t) is not None]
    with _lock:
        region = Region(next(_ids), mem, scope)
        _regions[region.id] = region
    try:
        for t in transports:
            region.exports[t.scheme] = t.export(region)
    except BaseException:
        release(region, transports)
        raise
    return region


def widen(region: Region, added: Scope, transports: list[BufferTransport]) -> None:
    """Let peers reach ``added`` (new bytes, :func:`._scope.widen`) of a scoped region too:
    each backend that keeps state per span (``widen(region, added)``) makes it first, then the
    region's scope grows, so no peer is told of a span its backend cannot serve yet."""
    assert region.scope is not None, "only a scoped region widens"
    for t in transports:
        grow = getattr(t, "widen", None)
        if t.scheme in region.exports and grow is not None:
            grow(region, added)
    with _lock:
        if not region.released:
            region.scope = _scope.merge(region.scope, added)


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


# -- counting what moved ---------------------------------------------------------------------------


@dataclasses.dataclass
class Counters:
    bytes_read: int = 0
    bytes_written: int = 0
    transfers: int = 0
    fallbacks: int = 0


stats: dict[str, Counters] = {}


def count(scheme: str, *, read: int = 0, written: int = 0) -> None:
    c = stats.setdefault(scheme, Counters())
    c.bytes_read += read
    c.bytes_written += written
    c.transfers += 1
