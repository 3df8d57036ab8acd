"""``Buffer``: the user-facing one-sided buffer, in the shape of Monarch's ``RDMABuffer``.

The owner registers a tensor (or any writable bytes-like value) where it lies; the handle is
small, is passed in any actor call, and can be forwarded through other actors without moving the
bytes. Whoever holds it calls ``read_into`` / ``write_from``; the bytes move directly between
the owner's memory and the caller's, over the best backend for where the two are.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from orchestr.errors import DescriptorError, OrchestrError
from orchestr.fabric import _local, _registry

from . import _borrow, _fallback, _scope, _transport
from ._borrow import Borrowed, Claim
from ._transport import Descriptor, Region, read_pieces_with

T = TypeVar("T")

__all__ = ["Buffer"]


def as_bytes(data: Any, *, writable: bool) -> tuple[memoryview, str, list[int]]:
    """A flat byte view of a CPU tensor, numpy array or bytes-like value, with dtype and shape."""
    module = type(data).__module__
    if module.startswith("torch"):
        if data.device.type != "cpu":
            raise OrchestrError(
                f"only CPU tensors can be registered here, got one on {data.device}; copy it "
                f"to the host first"
            )
        if not data.is_contiguous():
            raise OrchestrError("register a contiguous tensor (call .contiguous() first)")
        import torch

        dtype, shape = str(data.dtype).removeprefix("torch."), list(data.shape)
        flat = data.detach().reshape(-1).view(torch.uint8)
        view = memoryview(flat.numpy()) if flat.numel() else memoryview(bytearray())
    elif module == "numpy":
        if not data.flags.c_contiguous:
            raise OrchestrError("register a C-contiguous array (np.ascontiguousarray)")
        dtype, shape = data.dtype.str, list(data.shape)
        view = memoryview(data.reshape(-1).view("u1")) if data.size else memoryview(bytearray())
    else:
        try:
            view = memoryview(data)
        except TypeError:
            raise OrchestrError(
                f"cannot register a {type(data).__name__}: pass a tensor, array or bytes-like"
            ) from None
        if not view.contiguous:
            raise OrchestrError("register a contiguous buffer")
        dtype, shape = "u1", [view.nbytes]
    view = view.cast("B") if view.ndim != 1 or view.format != "B" else view
    if writable and view.readonly:
        raise OrchestrError("this buffer is read-only; read_into needs a writable destination")
    return view, dtype, shape


def _plain_tensor(data: Any) -> bool:
    """A contiguous CPU tensor (whose memory ``data_ptr`` gives)."""
    return (
        type(data).__module__.startswith("torch")
        and data.device.type == "cpu"
        and data.is_contiguous()
        and not data.is_conj()
        and not data.is_neg()
    )


class Buffer:
    """Registered memory that peers read and write without the owner's code taking part.

    ``Buffer(tensor)`` registers a contiguous CPU tensor (numpy arrays and writable bytes-like
    values too) in place, with every transport that works here. Pass the buffer in any call;
    the receiver awaits ``read_into(dst)`` or ``write_from(src)``. The owner calls
    ``release()`` (or uses ``with``) when peers are done; a released buffer's handles fail with
    :class:`StaleDescriptorError`. A buffer whose owner drops it is released soon after (at the
    next registration), and all are released when the owning actor stops; the kernel reclaims
    them if its process is killed.

    A grant of part of some memory is a buffer of its own: ``Buffer(tensor, spans=[(offset,
    nbytes), ...], writable=False)`` registers the same memory again under a new key, and
    peers given that handle reach only those spans (at the memory's own offsets), only to read
    with ``writable=False``; releasing it revokes just that grant. Who refuses a transfer
    outside the spans depends on the backend: the owner (``inproc``, ``tcp``, ``nixl``), its
    adapter (``rdma``: a memory region per span), or, on the owner's host (``shm``), the
    reader, from the owner-made handle: a process of the owner's user can read that memory
    anyway, so the user is the boundary there. A span outside ``data`` raises
    :class:`DescriptorError`; spans that touch or overlap are merged.
    """

    __module__ = "orchestr.fabric"  # its public home (the serializer finds it by this name)

    def __init__(
        self,
        data: Any,
        *,
        spans: Iterable[tuple[int, int]] | None = None,
        writable: bool = True,
    ) -> None:
        view, self.dtype, self.shape = as_bytes(data, writable=False)
        if not writable:
            view = view.toreadonly()
        scope = None if spans is None else _scope.flatten(spans, view.nbytes)
        self._data = data  # keeps the memory alive while registered
        self._transports = _registry.usable_buffer_transports()
        self._region: Region | None = _transport.register_memory(view, self._transports, scope)
        # dropped without release(): released soon after (the memory stays valid until then)
        self._finalizer = weakref.finalize(
            self, _transport.release_later, self._region, self._transports
        )
        self._widening = threading.Lock()
        self.nbytes = view.nbytes
        self.descriptors: dict[str, Descriptor] = self._describe(self._region)

    @staticmethod
    def _describe(region: Region) -> dict[str, Descriptor]:
        return {s: region.descriptor(s) for s in region.exports}

    @classmethod
    def _from_parts(
        cls, nbytes: int, dtype: str, shape: list[int], descriptors: dict[str, Descriptor]
    ) -> Buffer:
        self = cls.__new__(cls)
        self._data = None
        self._transports = []
        self._region = None
        self.nbytes, self.dtype, self.shape, self.descriptors = nbytes, dtype, shape, descriptors
        return self

    @property
    def owner(self) -> str:
        """The owning process, ``host:pid:nonce``."""
        return next(iter(self.descriptors.values())).owner

    @property
    def spans(self) -> list[tuple[int, int]] | None:
        """The ``(offset, nbytes)`` spans a peer may reach, ``None`` when it may reach all of
        the buffer (as this handle was sent: :meth:`allow` may have widened them since)."""
        scope = next(iter(self.descriptors.values())).scope
        return None if scope is None else [(a, b - a) for a, b in _scope.pairs(scope)]

    def allow(self, spans: Iterable[tuple[int, int]]) -> None:
        """Let peers reach ``spans`` (``(offset, nbytes)``) of a buffer made with ``spans``
        too (owner only; thread-safe). Handles sent before keep working for what they were
        granted; those sent afterwards carry the wider spans, which a peer needs where its
        own check decides (``shm``). Scopes only grow: release the buffer to revoke it.
        Raises :class:`DescriptorError` for a buffer that is not its owner's, was released or
        is not scoped, or for a span outside it; with ``rdma``, what registering fails with."""
        region = self._owned("widen")
        if region.scope is None:
            raise DescriptorError("this buffer reaches all of its memory; only a scoped one widens")
        with self._widening:
            added = _scope.widen(region.scope, spans, self.nbytes)
            if added:
                _transport.widen(region, added, self._transports)
                self.descriptors = self._describe(region)

    def _owned(self, what: str) -> Region:
        if self._region is None:
            if self._data is None:
                raise DescriptorError(f"only the owner ({self.owner}) can {what} this buffer")
            raise DescriptorError("this buffer was released")
        return self._region

    def __repr__(self) -> str:
        state = "released" if self._region is None and self._data is not None else "live"
        scope = self.spans
        reach = "" if scope is None else f" in {len(scope)} spans"
        return (
            f"<Buffer {self.nbytes} bytes {self.dtype}{self.shape}{reach} of {self.owner} via "
            f"{'/'.join(self.descriptors)} {state}>"
        )

    async def read_into(
        self,
        dst: Any,
        *,
        offset: int = 0,
        transport: str | None = None,
        fallback: str | None = None,
    ) -> str:
        """Copy ``dst.nbytes`` bytes starting at byte ``offset`` of this buffer into ``dst``.

        Returns the transport that moved them. ``transport`` asks for one backend (otherwise
        the natural one for where the owner is); ``fallback`` is ``"allow"`` or ``"error"``
        (default: the job's ``ORCHESTR_TRANSPORT_FALLBACK``). Bound it with
        ``asyncio.timeout``; a cancelled transfer leaves ``dst`` partly written.
        Blocks on the transfer (a copy between processes, or the owner's side channel); raises
        :class:`TransportError` (:class:`TransportUnavailableError`, :class:`FallbackError` under the
        policy, or an owner that made no progress for ``ORCHESTR_TRANSFER_STALL_TIMEOUT``),
        :class:`StaleDescriptorError` for a released buffer, :class:`DescriptorError` for a span out
        of bounds. Not cancel-safe: a cancelled transfer leaves ``dst`` partly written.
        """
        view, _, _ = as_bytes(dst, writable=True)
        t, desc = self._choose(transport, fallback)
        await t.read_into(desc, offset, view)
        return t.scheme

    async def read_pieces(
        self,
        dst: Any,
        piece: int,
        fn: Callable[[memoryview], T],
        *,
        offset: int = 0,
        transport: str | None = None,
        fallback: str | None = None,
    ) -> tuple[str, list[T]]:
        """:meth:`read_into`, and ``fn`` called on each ``piece`` bytes of ``dst`` (the last
        one shorter) as soon as that piece has landed: where the backend copies in threads
        (``shm`` from the owner's shared memory), in the thread that copied it, two pieces at
        a time, so ``fn`` reads bytes still in the cache (a checksum verified while
        copying). ``fn`` must be thread-safe and may run in another thread. Returns the
        transport and ``fn``'s results in piece order. Blocks on the transfer and on ``fn``;
        raises as :meth:`read_into` does, and what ``fn`` raises. Not cancel-safe: a cancelled
        read leaves ``dst`` partly written."""
        view, _, _ = as_bytes(dst, writable=True)
        t, desc = self._choose(transport, fallback)
        reader = getattr(t, "read_pieces", None)
        if reader is not None:
            return t.scheme, await reader(desc, offset, view, piece, fn)
        return t.scheme, await read_pieces_with(t.read_into, desc, offset, view, piece, fn)

    async def read_spans(
        self,
        spans: Sequence[tuple[int, Any]],
        *,
        transport: str | None = None,
        fallback: str | None = None,
    ) -> str:
        """Several :meth:`read_into` at once: for each ``(offset, dst)``, ``dst.nbytes`` bytes
        from byte ``offset`` of this buffer into ``dst``: in one hop off the event loop where
        the backend can (``shm``, into CPU tensors: every span checked before any is copied),
        else concurrently. Returns the transport. Blocks on the transfers and raises as
        :meth:`read_into` does. Not cancel-safe: a cancelled read leaves the destinations
        partly written."""
        return await self._spans(False, spans, transport, fallback)

    async def write_spans(
        self,
        spans: Sequence[tuple[int, Any]],
        *,
        transport: str | None = None,
        fallback: str | None = None,
    ) -> str:
        """Several :meth:`write_from` at once: for each ``(offset, src)``, all of ``src`` into
        this buffer from byte ``offset``; in one hop off the event loop where the backend can
        (``shm``, from CPU tensors), else concurrently. Returns the transport. Blocks on the
        transfers and raises as :meth:`write_from` does. Not cancel-safe: a cancelled write
        leaves this buffer partly written."""
        return await self._spans(True, spans, transport, fallback)

    async def _spans(
        self,
        write: bool,
        spans: Sequence[tuple[int, Any]],
        transport: str | None,
        fallback: str | None,
    ) -> str:
        t, desc = self._choose(transport, fallback)
        direct = getattr(t, "write_addresses" if write else "read_addresses", None)
        if direct is not None and all(_plain_tensor(d) for _, d in spans):
            # CPU tensors name their memory themselves: no view of each to build
            await direct(desc, [(o, d.data_ptr(), d.numel() * d.element_size()) for o, d in spans])
            return t.scheme
        move = t.write_from if write else t.read_into
        views = [(offset, as_bytes(d, writable=not write)[0]) for offset, d in spans]
        try:
            async with asyncio.TaskGroup() as moves:
                for offset, view in views:
                    moves.create_task(move(desc, offset, view))
        except* Exception as group:
            raise group.exceptions[0] from None  # the first failure, as one transfer raises it
        return t.scheme

    async def write_from(
        self,
        src: Any,
        *,
        offset: int = 0,
        transport: str | None = None,
        fallback: str | None = None,
    ) -> str:
        """Copy all of ``src`` into this buffer starting at byte ``offset``; returns the
        transport used.

        Blocks on the transfer and raises as :meth:`read_into` does. Not cancel-safe: a cancelled
        transfer leaves this buffer partly written."""
        view, _, _ = as_bytes(src, writable=False)
        t, desc = self._choose(transport, fallback)
        await t.write_from(desc, offset, view)
        return t.scheme

    def borrow(self) -> Borrowed | None:
        """Use the owner's bytes in place, with no copy: a :class:`~._borrow.Borrowed` whose
        ``view`` is a read-only memoryview of them, unchanged until it is released (the owner
        cannot :meth:`claim` them meanwhile; a borrower that dies lets go with its process).

        ``None`` where that is not possible: the owner is on another host,
        its memory is not in shared memory (only ``orchestr.fabric.empty`` tensors are), or it
        holds a claim now (changing the bytes). Read then, as usual. Raises
        :class:`StaleDescriptorError` for a released buffer.

        Of a scoped buffer the view still spans the whole registration (the mapping the
        ``shm`` backend keeps: mapping each span anew costs 2-10 times the copy), the bytes
        between the spans included; :attr:`Borrowed.spans` says what was granted, and the
        borrower keeps to it (:meth:`Borrowed.reaches`). The owner's user is the boundary on
        its host either way."""
        desc = self.descriptors.get("shm")
        shm = _registry.buffer_transport("shm") if desc is not None else None
        if desc is None or shm is None or shm.probe() is not None or not shm.reaches(self.owner):
            return None
        return _borrow.borrow(shm, desc)  # type: ignore[arg-type]

    def claim(self) -> Claim | None:
        """The owner's hold on its bytes while it changes them: ``None`` while a peer
        :meth:`borrow` s them, else a :class:`~._borrow.Claim` to release (or use ``with``)
        when done, during which no borrow starts. Owner only (:class:`DescriptorError`)."""
        return _borrow.claim(self._owned("claim"))

    def _choose(
        self, want: str | None, fallback: str | None
    ) -> tuple[_transport.BufferTransport, Descriptor]:
        policy = _fallback.check_fallback(fallback or _registry.settings.fallback)
        return _fallback.choose(
            self.descriptors, _registry.buffer_transport, want=want, fallback=policy
        )

    def release(self) -> None:
        """Unregister (owner only). Idempotent.

        Transfers that start afterwards fail with :class:`StaleDescriptorError`. One already
        under way when the owner releases may still complete, so release only when peers are
        done, and keep the memory itself alive until then (as with RDMA deregistration).
        """
        if self._region is None:
            if self._data is None:
                raise DescriptorError(
                    f"only the owner ({self.owner}) can release this buffer; this process is "
                    f"{_local.process_key()}"
                )
            return
        self._finalizer.detach()
        _transport.release(self._region, self._transports)
        self._region = None

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- wire form -----------------------------------------------------------------------------
    def to_wire(self) -> list[Any]:
        if self._region is None and self._data is not None:
            raise DescriptorError("this buffer was released; it cannot be sent")
        return [
            self.nbytes,
            self.dtype,
            self.shape,
            [d.to_wire() for d in self.descriptors.values()],
        ]

    @classmethod
    def from_wire(cls, data: Any) -> Buffer:
        try:
            nbytes, dtype, shape, descs = data
        except (TypeError, ValueError):
            raise DescriptorError(f"malformed buffer handle {data!r}") from None
        if not (isinstance(nbytes, int) and isinstance(descs, list) and descs):
            raise DescriptorError(f"malformed buffer handle {data!r}")
        parsed = [Descriptor.from_wire(d) for d in descs]
        if len({d.owner for d in parsed}) != 1 or any(d.length != nbytes for d in parsed):
            raise DescriptorError("a buffer handle's descriptors disagree on owner or length")
        return cls._from_parts(nbytes, str(dtype), list(shape), {d.transport: d for d in parsed})
