"""Torch execution backends behind one seam, chosen per node by name.

A :class:`Backend` says where a role's model runs and how: the device, the compute dtype, and
eager or compiled (``torch.compile``). Roles never call ``.cuda()`` or ``torch.compile``
themselves; they ask :func:`choose_backend` in their own process, so each node picks what it
has: ``cuda`` where a GPU is visible, ``cpu`` elsewhere. A :class:`BackendSpec` is plain data
(registered for actor calls), so the controller can pass one to every role.

Built-in kinds are ``cpu`` and ``cuda`` (``cuda:1`` names a device). Out-of-tree kinds register
through the ``orchestr.backends`` entry-point group: the entry point's name is the kind's name and
its object a callable (a class) returning an object with ``probe() -> str | None`` (why it
cannot run here, or ``None``) and ``build(spec, index) -> Backend``. Entry points load on the
first lookup of a name this process does not know.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

import structlog
import torch

from orchestr import register
from orchestr.errors import OrchestrError

__all__ = [
    "Backend",
    "BackendError",
    "BackendKind",
    "BackendSpec",
    "BackendUnavailableError",
    "backend_report",
    "backends",
    "choose_backend",
    "register_backend",
]

log = structlog.get_logger("orchestr.roles")
ENTRY_POINT_GROUP = "orchestr.backends"
M = TypeVar("M", bound=torch.nn.Module)


class BackendError(OrchestrError, ValueError):
    """A backend name, device or dtype this process does not know."""


class BackendUnavailableError(BackendError):
    """The backend is known but cannot run on this node (no GPU, no such device)."""


@register
@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """What a role asks for. ``name`` ``None`` means the best this node has (``cuda`` when a
    GPU is visible, else ``cpu``); ``dtype`` ``None`` leaves the module's dtypes as they are;
    ``compile_options`` go to ``torch.compile`` when ``compiled``."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    name: str | None = None
    dtype: str | None = None
    compiled: bool = False
    compile_options: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Backend:
    """Where and how a module runs. Built by :func:`choose_backend`; immutable."""

    name: str
    device: torch.device
    dtype: torch.dtype | None = None
    compiled: bool = False
    compile_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def prepare(self, module: M) -> M:
        """Move ``module`` to the device, cast its floating-point tensors to ``dtype`` (when
        set) and, when compiled, wrap it in ``torch.compile`` (compilation itself happens on the
        first call). Moves in place, as ``Module.to`` does; the result shares the parameters."""
        module = module.to(device=self.device)
        if self.dtype is not None:
            module = module.to(dtype=self.dtype)
        if self.compiled:
            compiled: M = torch.compile(module, **self.compile_options)  # type: ignore[assignment]
            return compiled
        return module

    def tensor(self, data: Any, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``data`` as a tensor on this backend's device; floating-point data takes the
        backend's dtype unless ``dtype`` says otherwise."""
        t = torch.as_tensor(data, device=self.device, dtype=dtype)
        if dtype is None and self.dtype is not None and t.is_floating_point():
            t = t.to(self.dtype)
        return t

    def empty(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.empty(
            shape, device=self.device, dtype=dtype or self.dtype or torch.get_default_dtype()
        )

    def synchronize(self) -> None:
        """Wait for the device's queued work (a no-op on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device": str(self.device),
            "dtype": None if self.dtype is None else str(self.dtype).removeprefix("torch."),
            "compiled": self.compiled,
        }


class BackendKind(Protocol):
    """A family of backends (``cpu``, ``cuda``, a plug-in's)."""

    def probe(self) -> str | None:
        """Why this kind cannot run in this process, or ``None`` when it can."""

    def build(self, spec: BackendSpec, index: int | None) -> Backend:
        """A backend for ``spec``; ``index`` is the device number in ``name:index``."""


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise BackendError(f"unknown torch dtype {name!r}; use a name like 'float32' or 'bfloat16'")
    return dtype


class CpuKind:
    def probe(self) -> str | None:
        return None

    def build(self, spec: BackendSpec, index: int | None) -> Backend:
        if index not in (None, 0):
            raise BackendError(f"the cpu backend has no device {index}; say 'cpu'")
        return Backend(
            "cpu", torch.device("cpu"), _dtype(spec.dtype), spec.compiled, spec.compile_options
        )


class CudaKind:
    def probe(self) -> str | None:
        if torch.version.cuda is None:
            return f"this torch ({torch.__version__}) was built without CUDA"
        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            extra = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
            return f"no CUDA device is visible to this process{extra}"
        return None

    def build(self, spec: BackendSpec, index: int | None) -> Backend:
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if index is None else index
        if not 0 <= index < count:
            raise BackendUnavailableError(
                f"cuda:{index} does not exist on this node, which has {count} GPU(s) "
                f"(cuda:0 to cuda:{count - 1})"
            )
        device = torch.device("cuda", index)
        return Backend("cuda", device, _dtype(spec.dtype), spec.compiled, spec.compile_options)


_lock = threading.Lock()
_kinds: dict[str, BackendKind] = {"cpu": CpuKind(), "cuda": CudaKind()}
_entry_points_loaded = False


def register_backend(name: str, kind: BackendKind) -> None:
    """Make ``name`` (and ``name:N``) choose backends that ``kind`` builds."""
    if not name or ":" in name:
        raise ValueError(f"a backend name is a word without ':', got {name!r}")
    with _lock:
        _kinds[name] = kind


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    import importlib.metadata  # here: it costs every worker's start-up otherwise

    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            kind = ep.load()()
        except Exception as exc:
            log.warning("cannot load backend plug-in", name=ep.name, error=repr(exc))
            continue
        if callable(getattr(kind, "probe", None)) and callable(getattr(kind, "build", None)):
            register_backend(ep.name, kind)
        else:
            log.warning("backend plug-in has no probe() and build()", name=ep.name)


def _kind(name: str) -> BackendKind | None:
    kind = _kinds.get(name)
    if kind is None:
        _load_entry_points()
        kind = _kinds.get(name)
    return kind


def backends() -> list[str]:
    """Every backend name this process knows, plug-ins included."""
    _load_entry_points()
    return sorted(_kinds)


def backend_report() -> list[dict[str, Any]]:
    """One row per backend: ``name``, ``available`` and, when it is not, ``reason``."""
    rows = []
    for name in backends():
        reason = _kinds[name].probe()
        row: dict[str, Any] = {"name": name, "available": reason is None}
        if reason is not None:
            row["reason"] = reason
        rows.append(row)
    return rows


def choose_backend(spec: BackendSpec | Mapping[str, Any] | str | None = None) -> Backend:
    """The backend ``spec`` names, built for this process's node.

    ``None`` (or a spec without a name) picks ``cuda`` when a GPU is visible, else ``cpu``; a
    string is a name (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a plug-in's); a mapping holds a
    spec's fields. Does not block.
    Raises :class:`BackendError` for an unknown name or dtype and
    :class:`BackendUnavailableError` for a backend that cannot run here, each saying what
    would. Idempotent: equal specs give equal backends.
    """
    if spec is None or isinstance(spec, str):
        spec = BackendSpec(name=spec)
    elif isinstance(spec, Mapping):
        fields = dict(spec)
        try:
            spec = BackendSpec(**fields)
        except TypeError as exc:
            raise BackendError(f"bad backend spec {fields!r}: {exc}") from None
    name = spec.name
    if name is None:
        name = "cuda" if _kinds["cuda"].probe() is None else "cpu"
    base, _, number = name.partition(":")
    index: int | None = None
    if number:
        if not number.isdigit():
            raise BackendError(f"bad device in backend {name!r}: say 'cuda' or 'cuda:N'")
        index = int(number)
    kind = _kind(base)
    if kind is None:
        raise BackendError(
            f"unknown torch backend {base!r}; known: {', '.join(backends())}. Out-of-tree "
            f"backends register in the {ENTRY_POINT_GROUP!r} entry-point group"
        )
    reason = kind.probe()
    if reason is not None:
        raise BackendUnavailableError(
            f"backend {name!r} cannot run on this node: {reason}. Ask for 'cpu', or pass no "
            f"name to take what the node has"
        )
    return kind.build(spec, index)
