"""What the serializer knows by name: the extension type codes, the registered dataclasses
(:func:`register`) and extension types, and the older names a head's store may hold."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from orchestr.errors import ProtocolError, SerializationError

__all__ = ["register", "register_ext"]

T = TypeVar("T")


EXT_TENSOR = 1
EXT_NDARRAY = 2
EXT_DATACLASS = 3
EXT_BYTES = 4
EXT_BUFFER = 5  # an orchestr.fabric.Buffer handle
EXT_SHM_TENSOR = 6  # a tensor in a shared-memory segment of the sender (see _bulk)
EXT_SHM_NDARRAY = 7
EXT_MESH = 16  # an orchestr.Mesh handle (registered by _mesh)


#: Extension types that another module registers when it is imported, by code: decoding one
#: imports that module first, so a process that has not needed it yet can still receive the
#: value (a worker imports only what it serves; ``import orchestr`` loads its submodules
#: lazily).
_REGISTERED_BY = {EXT_BUFFER: "orchestr._call._bulk", EXT_MESH: "orchestr._call._mesh"}


#: The same for sending, by the module that defines the type (a ``Mesh`` registers itself).
_REGISTERED_FOR = {"orchestr.fabric": "orchestr._call._bulk"}  # Buffer (pinned there)


_dataclasses_by_type: dict[type, str] = {}


_dataclasses_by_name: dict[str, type] = {}


_ext_encoders: dict[type, tuple[int, Callable[[Any], Any]]] = {}


_ext_decoders: dict[int, Callable[[Any], Any]] = {}


def register(cls: type[T]) -> type[T]:
    """Allow instances of the dataclass ``cls`` in actor arguments and results.

    Use as a class decorator. The class travels by import path, so the receiving process must be
    able to import its module. Raises :class:`SerializationError` if ``cls`` is not a dataclass
    or cannot be imported by name. Idempotent.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise SerializationError(f"register() takes a dataclass, got {cls!r}")
    if "<locals>" in cls.__qualname__:
        raise SerializationError(
            f"{cls.__qualname__} is defined inside a function and cannot be imported by other "
            f"processes; define it at module level"
        )
    from orchestr._actor._actor import module_name

    name = f"{module_name(cls.__module__)}:{cls.__qualname__}"
    _dataclasses_by_type[cls] = name
    _dataclasses_by_name[name] = cls
    return cls


def register_ext(
    cls: type, code: int, to_wire: Callable[[Any], Any], from_wire: Callable[[Any], Any]
) -> None:
    """Internal: add an extension type (``to_wire`` returns a msgpack-able value)."""
    _ext_encoders[cls] = (code, to_wire)
    _ext_decoders[code] = from_wire


def _by_old_name(name: str) -> type | None:
    """The registered dataclass an older name means: one written as ``pkg._private:Name``
    before ``Name`` was pinned to its public module ``pkg`` (a head's store keeps such names
    across upgrades). Only names under the public module's package match."""
    module, _, qualname = name.partition(":")
    while "." in module:
        module = module.rpartition(".")[0]
        cls = _dataclasses_by_name.get(f"{module}:{qualname}")
        if cls is not None:
            return cls
    return None


def _dataclass_from_wire(name: object, fields: object) -> Any:
    if not isinstance(name, str) or not isinstance(fields, dict):
        raise ProtocolError("malformed dataclass payload")
    # Only the registry: a name from the wire never makes this process import anything.
    cls = _dataclasses_by_name.get(name) or _by_old_name(name)
    if cls is None:
        raise SerializationError(
            f"dataclass {name} is not registered in this process; the module that defines it "
            f"(with @orchestr.register) must be imported here first, for example by the "
            f"actor's own module"
        )
    try:
        return cls(**fields)
    except TypeError as exc:
        raise SerializationError(f"cannot rebuild {name}: {exc}") from exc
