"""Tensors and numpy arrays on the wire: their bytes go out of band, or through a shared-memory
segment when the connection has one; the frame carries dtype, shape and where the bytes are.

The segments are the call path's (:mod:`._bulk`), reached through :class:`BulkSink` when
encoding and :class:`BulkSource` when decoding: the serializer calls them, and never the other
way round, so values flow one way from :mod:`._serde` to the bulk link."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from orchestr.errors import ProtocolError, SerializationError

from ._registry import EXT_NDARRAY, EXT_SHM_NDARRAY, EXT_SHM_TENSOR, EXT_TENSOR

if TYPE_CHECKING:
    from ._serde import _Encoding

__all__ = ["BulkSink", "BulkSource", "count", "ndarray_to_wire", "tensor_to_wire"]


def tensor_to_wire(obj: Any, enc: _Encoding) -> msgpack.ExtType:
    t = obj.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    shape = list(t.shape)
    dtype = str(t.dtype).removeprefix("torch.")
    import torch

    flat = t.reshape(-1).view(torch.uint8)
    buf = memoryview(flat.numpy()).cast("B")
    if enc.bulk is not None and buf.nbytes >= enc.bulk.threshold:
        where = enc.bulk.put(buf)  # None: no shared memory left for it; into the frame then
        if where is not None:
            return msgpack.ExtType(EXT_SHM_TENSOR, msgpack.packb([dtype, shape, where, buf.nbytes]))
    offset = enc.add(buf)
    return msgpack.ExtType(EXT_TENSOR, msgpack.packb([dtype, shape, offset, buf.nbytes]))


def ndarray_to_wire(obj: Any, enc: _Encoding) -> msgpack.ExtType:
    import numpy as np

    if obj.dtype.hasobject:
        raise SerializationError(
            "numpy arrays of Python objects cannot be sent; use a numeric dtype"
        )
    arr = obj if obj.flags.c_contiguous else obj.copy(order="C")  # keeps 0-d arrays 0-d
    buf = memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else memoryview(b"")
    if enc.bulk is not None and buf.nbytes >= enc.bulk.threshold:
        where = enc.bulk.put(buf)
        if where is not None:
            return msgpack.ExtType(
                EXT_SHM_NDARRAY,
                msgpack.packb([arr.dtype.str, list(arr.shape), where, buf.nbytes]),
            )
    offset = enc.add(buf)
    return msgpack.ExtType(
        EXT_NDARRAY, msgpack.packb([arr.dtype.str, list(arr.shape), offset, buf.nbytes])
    )


def count(shape: object) -> int:
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ProtocolError(f"malformed shape {shape!r}")
    count = 1
    for d in shape:
        count *= d
    return count


class BulkSink(Protocol):
    """Where a message's large tensors and arrays go instead of its frame (the call path's
    shared-memory segments, :mod:`._bulk`). The serializer calls it; it never calls the
    serializer back."""

    threshold: int

    def put(self, buf: memoryview) -> list[int] | None:
        """Take ``buf``; returns where the receiver finds it, or ``None`` to leave it in the
        frame (no shared memory left for it)."""
        ...

    def abandon(self) -> None:
        """The message failed to encode: give back everything ``put`` took for it."""
        ...


class BulkSource(Protocol):
    """What a received message's shared-memory descriptors are read through."""

    def view(self, wire: list[Any], nbytes: int) -> Any:
        """The ``nbytes`` at descriptor ``wire``, as a uint8 numpy array over the segment."""
        ...
