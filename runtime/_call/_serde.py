"""Values on the wire: msgpack plus extension types, never pickle.

Supported: ``None``, ``bool``, ``int`` (64-bit), ``float``, ``str``, ``bytes``/``bytearray``/
``memoryview``, lists and tuples (both arrive as lists), dicts, numpy scalars (as Python scalars),
and the extension types below. Anything else is refused at the sender with
:class:`SerializationError` naming the type.

Extension types: torch tensors and numpy arrays travel as out-of-band buffers (the frame's
``extra`` area; the receiver views them in place), dataclasses registered with
:func:`register`, and mesh handles (registered by :mod:`orchestr._call._mesh`).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

from orchestr.errors import OrchestrError, ProtocolError, SerializationError

from ._arrays import BulkSink, BulkSource, ndarray_to_wire, tensor_to_wire
from ._arrays import count as count_of
from ._frames import padded
from ._registry import (
    _REGISTERED_BY,
    _REGISTERED_FOR,
    EXT_BYTES,
    EXT_DATACLASS,
    EXT_NDARRAY,
    EXT_SHM_NDARRAY,
    EXT_SHM_TENSOR,
    EXT_TENSOR,
    _dataclass_from_wire,
    _dataclasses_by_type,
    _ext_decoders,
    _ext_encoders,
)

__all__ = [
    "OutOfBand",
    "decode",
    "decode_plain",
    "encode",
    "encode_parts",
    "lift_large",
]


#: ``bytes`` at least this long in call arguments and results travel out of band.
OUT_OF_BAND_BYTES = 16 * 1024

T = TypeVar("T")


class OutOfBand:
    """Wraps a large ``bytes``-like value so it is sent as a buffer, without a packing copy."""

    __slots__ = ("data",)

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.data = data


def _large(value: Any) -> bool:
    return type(value) in (bytes, bytearray) and len(value) >= OUT_OF_BAND_BYTES


def _lift(value: Any) -> Any:
    return OutOfBand(value) if _large(value) else value


def lift_large(values: Any) -> Any:
    """Wrap large ``bytes`` items of a list, tuple or dict (one level), or a large ``bytes``
    value itself, in :class:`OutOfBand`."""
    if isinstance(values, list | tuple):
        if any(map(_large, values)):
            return [_lift(v) for v in values]
    elif isinstance(values, dict):
        if any(map(_large, values.values())):
            return {k: _lift(v) for k, v in values.items()}
    return _lift(values)


class _Encoding:
    """The out-of-band buffers gathered while packing one message."""

    __slots__ = ("buffers", "bulk", "retained", "size")

    def __init__(self, bulk: BulkSink | None = None) -> None:
        #: Where values of at least ``bulk.threshold`` bytes go instead of the frame.
        self.bulk = bulk
        self.buffers: list[memoryview] = []
        self.size = 0
        #: Whether the receiver keeps views of some buffer (tensors, arrays).
        self.retained = False

    def add(self, buf: memoryview, *, retained: bool = True) -> int:
        offset = padded(self.size)
        self.buffers.append(buf)
        self.size = offset + buf.nbytes
        self.retained |= retained
        return offset


_current: list[_Encoding] = []


def _refuse(obj: object) -> SerializationError:
    t = type(obj)
    return SerializationError(
        f"cannot send a value of type {t.__module__}.{t.__qualname__}: orchestr sends msgpack "
        f"types, torch tensors, numpy arrays and dataclasses registered with "
        f"@orchestr.register; convert it or register it"
    )


def _default(obj: Any) -> Any:
    t = type(obj)
    if t is OutOfBand:
        buf = memoryview(obj.data).cast("B")
        offset = _current[-1].add(buf, retained=False)
        return msgpack.ExtType(EXT_BYTES, msgpack.packb([offset, buf.nbytes]))
    if t in _dataclasses_by_type:
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
        payload = msgpack.packb(
            [_dataclasses_by_type[t], fields], default=_default, use_bin_type=True
        )
        return msgpack.ExtType(EXT_DATACLASS, payload)
    ext = _ext_encoders.get(t)
    module = t.__module__
    if ext is None and module in _REGISTERED_FOR:
        importlib.import_module(_REGISTERED_FOR[module])
        ext = _ext_encoders.get(t)
    if ext is not None:
        code, to_wire = ext
        return msgpack.ExtType(code, msgpack.packb(to_wire(obj), use_bin_type=True))
    if module.startswith("torch") and "torch" in sys.modules:  # tensors and nn.Parameter
        import torch

        if isinstance(obj, torch.Tensor):
            return tensor_to_wire(obj, _current[-1])
    if module == "numpy":
        import numpy as np

        if isinstance(obj, np.ndarray):
            return ndarray_to_wire(obj, _current[-1])
        if isinstance(obj, np.bool_ | np.integer | np.floating):
            return obj.item()
    raise _refuse(obj)


_packer = msgpack.Packer(default=_default, use_bin_type=True, autoreset=True)


def encode(obj: object) -> tuple[bytes, list[memoryview]]:
    """Pack ``obj`` into ``(msg, buffers)``; buffers are views, not copies, of tensor memory.

    Raises :class:`SerializationError` naming the first unsupported type.
    """
    msg, buffers, _ = encode_parts(obj)
    return msg, buffers


def encode_parts(obj: object, bulk: BulkSink | None = None) -> tuple[bytes, list[memoryview], bool]:
    """Like :func:`encode`, and also whether the receiver only copies out of the buffers.

    ``bulk`` (a :class:`BulkSink`, or ``None`` to leave every value in the frame) takes tensors and arrays of at least ``threshold`` bytes instead of the
    frame; on failure its ``abandon()`` is called.
    """
    enc = _Encoding(bulk)
    _current.append(enc)
    try:
        msg = _packer.pack(obj)
    except BaseException as exc:
        if bulk is not None:
            bulk.abandon()
        if isinstance(exc, (TypeError, ValueError, OverflowError)) and not isinstance(
            exc, OrchestrError
        ):
            raise SerializationError(f"cannot encode value: {exc}") from exc
        raise
    finally:
        _current.pop()
    return msg, enc.buffers, bool(enc.buffers) and not enc.retained


class _Shared:
    __slots__ = ("where",)

    def __init__(self, where: list[Any]) -> None:
        self.where = where


#: How deep extension values (a dataclass in a dataclass ...) may nest in one message. Each
#: level is a nested unpack on the C stack: a few hundred levels crash the process.
MAX_EXT_DEPTH = 32


class _Decoding:
    __slots__ = ("bulk", "depth", "extra")

    def __init__(self, extra: memoryview, bulk: BulkSource | None = None) -> None:
        self.extra = extra
        self.depth = 0
        #: Maps shared-memory descriptors: ``bulk.view(where, nbytes) -> uint8 array``.
        self.bulk = bulk

    def view(self, offset: int, nbytes: int) -> memoryview:
        if not (isinstance(offset, int) and isinstance(nbytes, int)):
            raise ProtocolError("buffer descriptor has non-integer offset or length")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.extra.nbytes:
            raise ProtocolError(
                f"buffer descriptor [{offset}, +{nbytes}) lies outside the frame's "
                f"{self.extra.nbytes} bytes of buffers"
            )
        return self.extra[offset : offset + nbytes]

    def _shared(self, where: list[Any], nbytes: int) -> Any:
        if self.bulk is None:  # checked when the descriptor arrived; never true here
            raise ProtocolError("a shared-memory value arrived where none is accepted")
        return self.bulk.view(where, nbytes)

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == EXT_TENSOR:
            return self._tensor(*_fields(data, 4))
        if code == EXT_NDARRAY:
            return self._ndarray(*_fields(data, 4))
        if code == EXT_SHM_TENSOR or code == EXT_SHM_NDARRAY:
            dtype, shape, where, nbytes = _fields(data, 4)
            if self.bulk is None:
                raise ProtocolError("a shared-memory value arrived where none is accepted")
            if not (isinstance(where, list) and len(where) == 5 and isinstance(nbytes, int)):
                raise ProtocolError("malformed shared-memory descriptor")
            make = self._tensor if code == EXT_SHM_TENSOR else self._ndarray
            return make(dtype, shape, _Shared(where), nbytes)
        if code == EXT_BYTES:
            offset, nbytes = _fields(data, 2)
            return bytes(self.view(offset, nbytes))
        if code == EXT_DATACLASS:
            if self.depth >= MAX_EXT_DEPTH:
                raise ProtocolError(
                    f"dataclasses nested more than {MAX_EXT_DEPTH} deep in one message"
                )
            self.depth += 1
            try:
                name, fields = _fields(data, 2, self.ext_hook)
            finally:
                self.depth -= 1
            return _dataclass_from_wire(name, fields)
        from_wire = _ext_decoders.get(code)
        if from_wire is None and code in _REGISTERED_BY:
            importlib.import_module(_REGISTERED_BY[code])
            from_wire = _ext_decoders.get(code)
        if from_wire is None:
            raise ProtocolError(f"unknown extension type {code}")
        return from_wire(msgpack.unpackb(data, raw=False))

    def _tensor(self, dtype_name: str, shape: list[int], offset: Any, nbytes: int) -> Any:
        import torch

        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise ProtocolError(f"unknown tensor dtype {dtype_name!r}")
        count = count_of(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if count * itemsize != nbytes:
            raise ProtocolError(
                f"tensor of shape {shape} and dtype {dtype_name} needs {count * itemsize} bytes, descriptor says {nbytes}"
            )
        if type(offset) is _Shared:
            array = self._shared(offset.where, nbytes)
            return torch.from_numpy(array).view(dtype).reshape(shape)
        view = self.view(offset, nbytes)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if view.readonly:  # borrowed memory (a scratch frame): copy out
            view = memoryview(bytearray(view))
        return torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(shape)

    def _ndarray(self, dtype_str: str, shape: list[int], offset: Any, nbytes: int) -> Any:
        import numpy as np

        try:
            dtype = np.dtype(str(dtype_str))
        except TypeError as exc:
            raise ProtocolError(f"unknown array dtype {dtype_str!r}") from exc
        if dtype.hasobject:
            raise ProtocolError("peer sent an array of Python objects")
        count = count_of(shape)
        if count * dtype.itemsize != nbytes:
            raise ProtocolError(
                f"array of shape {shape} and dtype {dtype_str} needs {count * dtype.itemsize} bytes, descriptor says {nbytes}"
            )
        if type(offset) is _Shared:
            return self._shared(offset.where, nbytes).view(dtype).reshape(shape)
        view = self.view(offset, nbytes)
        array = np.frombuffer(view, dtype=dtype).reshape(shape)
        return array.copy() if view.readonly else array


def _fields(data: bytes, n: int, ext_hook: Callable[[int, bytes], Any] | None = None) -> list[Any]:
    kwargs: dict[str, Any] = {"raw": False, "strict_map_key": False}
    if ext_hook is not None:
        kwargs["ext_hook"] = ext_hook
    value = msgpack.unpackb(data, **kwargs)
    if not isinstance(value, list) or len(value) != n:
        raise ProtocolError("malformed extension payload")
    return value


_NO_BUFFERS = memoryview(b"")


def decode(
    msg: bytes | memoryview, extra: memoryview = _NO_BUFFERS, bulk: BulkSource | None = None
) -> Any:
    """Unpack one message; tensors and arrays are views into ``extra`` (no copy), or into
    shared memory that ``bulk`` maps.

    Raises :class:`ProtocolError` for malformed input and :class:`SerializationError` for a
    well-formed value this process cannot rebuild (both :class:`OrchestrError`).
    """
    dec = _Decoding(extra, bulk)
    try:
        return msgpack.unpackb(msg, raw=False, strict_map_key=False, ext_hook=dec.ext_hook)
    except OrchestrError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types for malformed input
        raise ProtocolError(f"malformed message: {type(exc).__name__}: {exc}") from exc


def _no_extensions(code: int, data: bytes) -> Any:
    raise ProtocolError(f"extension type {code} where only plain values are accepted")


def decode_plain(msg: bytes | memoryview) -> Any:
    """Unpack a message of plain msgpack values only (the handshake, before the peer has
    authenticated): any extension type is refused, so nothing is looked up, built or
    allocated beyond the message itself. Raises :class:`ProtocolError`."""
    try:
        return msgpack.unpackb(msg, raw=False, ext_hook=_no_extensions)
    except OrchestrError:
        raise
    except Exception as exc:
        raise ProtocolError(f"malformed message: {type(exc).__name__}: {exc}") from exc


def peek(msg: bytes | memoryview) -> Any:
    """Decode ``msg`` with every extension value as ``None`` (to find the call id of a message
    whose values failed to decode); ``None`` if even that fails."""
    try:
        return msgpack.unpackb(msg, raw=False, strict_map_key=False, ext_hook=lambda c, d: None)
    except Exception:
        return None


def shared_leases(msg: bytes | memoryview) -> list[tuple[int, int]]:
    """The ``(fd, generation)`` of every shared-memory value a message names (best effort, for
    releasing them when the message cannot be decoded)."""
    found: list[tuple[int, int]] = []
    depth = [0]

    def hook(code: int, data: bytes) -> None:
        if code in (EXT_SHM_TENSOR, EXT_SHM_NDARRAY):
            try:
                where = msgpack.unpackb(data, raw=False)[2]
                fd, generation = where[1], where[3]
            except Exception:
                return None
            if type(fd) is int and type(generation) is int:
                found.append((fd, generation))
        elif code == EXT_DATACLASS and depth[0] < MAX_EXT_DEPTH:
            depth[0] += 1
            try:
                msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=hook)
            except Exception:
                return None
            finally:
                depth[0] -= 1
        return None

    try:
        msgpack.unpackb(msg, raw=False, strict_map_key=False, ext_hook=hook)
    except Exception:
        pass
    return found
