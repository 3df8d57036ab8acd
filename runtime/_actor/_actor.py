"""The actor base class and the ``@endpoint`` decorator."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any, TypeVar, overload

from orchestr.errors import SpawnError

__all__ = [
    "Actor",
    "EndpointSpec",
    "class_path",
    "endpoint",
    "endpoints_of",
    "load_actor_class",
    "saves_state",
]

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class EndpointSpec:
    name: str
    is_async: bool
    #: When true, calls run as soon as they arrive instead of one after another in order.
    concurrent: bool
    #: When true (async endpoints only), a call still running when its caller's deadline
    #: passes is cancelled where it runs.
    cancel_safe: bool = False


@overload
def endpoint(fn: F, /) -> F: ...
@overload
def endpoint(*, concurrent: bool = False, cancel_safe: bool = False) -> Callable[[F], F]: ...


def endpoint(fn: Any = None, /, *, concurrent: bool = False, cancel_safe: bool = False) -> Any:
    """Mark an actor method as callable from other processes.

    Calls from one caller run one at a time in the order they were sent. With
    ``concurrent=True`` they start as soon as they arrive: async endpoints interleave on the
    actor's event loop and sync endpoints run in a thread pool.

    A call whose caller's deadline has passed before it starts is dropped, never run. With
    ``cancel_safe=True`` (an async endpoint that may be interrupted at any ``await``), one
    still running when the deadline passes is cancelled too; otherwise it runs to its end.
    """

    def mark(f: F) -> F:
        if not callable(f):
            raise TypeError(f"@endpoint decorates a method, got {f!r}")
        is_async = inspect.iscoroutinefunction(f)
        if cancel_safe and not is_async:
            raise TypeError(
                f"{f.__name__}: cancel_safe=True needs an async endpoint (a running sync "
                f"function cannot be cancelled)"
            )
        spec = EndpointSpec(f.__name__, is_async, concurrent, cancel_safe)
        f._orchestr_endpoint = spec  # type: ignore[attr-defined]
        return f

    return mark(fn) if fn is not None else mark


#: What :meth:`Actor.crash_worker` calls: set by the worker process that hosts actors.
_crash_handler: Callable[[str], None] | None = None


def set_crash_handler(handler: Callable[[str], None] | None) -> None:
    """Install what :meth:`Actor.crash_worker` does in this process (the worker's exit)."""
    global _crash_handler
    _crash_handler = handler


class Actor:
    """Base class of every actor. Subclass it and mark methods with :func:`endpoint`.

    The runtime sets ``rank`` (position in its mesh), ``mesh_name`` and ``actor_id`` before
    ``__init__`` runs, so the constructor can use them.
    """

    rank: int = 0
    mesh_name: str = ""
    actor_id: str = ""
    _orchestr_endpoints: dict[str, EndpointSpec] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        found: dict[str, EndpointSpec] = {}
        for klass in reversed(cls.__mro__):
            for name, value in vars(klass).items():
                spec = getattr(value, "_orchestr_endpoint", None)
                if isinstance(spec, EndpointSpec):
                    found[name] = dataclasses.replace(spec, name=name)
        cls._orchestr_endpoints = found

    def crash_worker(self, reason: str) -> None:
        """End this actor's worker process as a failure, for a fault the actor cannot recover
        from in place (a model that failed mid-step, memory it lost track of): the worker
        exits with status 70 once the replies already given are sent (about 0.2 s; calls in
        flight after that fail with :class:`ActorDiedError`), and the actor's supervision
        restarts it by its :class:`RestartPolicy` as after any death. ``reason`` goes to the
        worker's log. Returns at once. Raises ``RuntimeError`` where the actor is not hosted
        by a worker (an object used in this process), so the caller can fail in place."""
        if _crash_handler is None:
            raise RuntimeError(f"{type(self).__name__} is not hosted by a worker: {reason}")
        _crash_handler(f"{type(self).__name__}[{self.rank}] ({self.mesh_name}): {reason}")

    def save_state(self) -> Any:
        """Optional: return this actor's state as plain values (no tensors). The owner saves
        it on ``ctx.checkpoint(mesh)`` or every ``RestartPolicy.checkpoint_s`` seconds, in
        order with the actor's other calls; a restarted actor gets the last one back through
        :meth:`load_state`, right after ``__init__``."""
        raise NotImplementedError

    def load_state(self, state: Any) -> None:
        """Optional: restore what :meth:`save_state` returned (called after ``__init__`` in a
        restarted actor, before it takes calls)."""
        raise NotImplementedError


def saves_state(cls: type) -> bool:
    """Whether ``cls`` defines its own :meth:`Actor.save_state`."""
    return getattr(cls, "save_state", Actor.save_state) is not Actor.save_state


def endpoints_of(cls: type) -> dict[str, EndpointSpec]:
    return dict(getattr(cls, "_orchestr_endpoints", {}))


def module_name(module: str) -> str:
    """The importable name of ``module``: a script run as ``__main__`` is named after its file."""
    if module != "__main__":
        return module
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if not main_file:
        raise SpawnError(
            "classes defined in an interactive session cannot be imported by workers; "
            "move them into a module"
        )
    from pathlib import Path

    return Path(main_file).stem


def class_path(cls: type) -> str:
    """``module:QualName`` for an actor class, checking that workers can import it."""
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise SpawnError(f"{cls!r} is not an orchestr.Actor subclass")
    if "<locals>" in cls.__qualname__:
        raise SpawnError(
            f"actor class {cls.__qualname__} is defined inside a function; workers import actor "
            f"classes by path, so define it at module level"
        )
    return f"{module_name(cls.__module__)}:{cls.__qualname__}"


def load_actor_class(class_path: str, *, where: str = "") -> type[Actor]:
    """Import ``module:QualName`` (``where`` says in which process, for the message); raises
    :class:`SpawnError` saying what failed."""
    module_name, sep, qualname = class_path.partition(":")
    if not sep or not module_name or not qualname:
        raise SpawnError(
            f"actor class path must look like 'package.module:ClassName', got {class_path!r}"
        )
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise SpawnError(
            f"cannot import actor class {class_path!r}{where}: {type(exc).__name__}: {exc} "
            f"(sys.path: {sys.path[:4]}...)"
        ) from exc
    if not (isinstance(obj, type) and issubclass(obj, Actor)):
        raise SpawnError(f"{class_path!r} is not an orchestr.Actor subclass")
    return obj
