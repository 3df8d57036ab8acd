"""What the head records, as plain data, and the checks on what it is asked to record: nodes,
actors, reservations, resources, mesh sizes and import paths."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from orchestr.errors import ConfigError

__all__ = [
    "STRATEGIES",
    "ActorRecord",
    "NodeRecord",
    "Reservation",
    "check_hosted",
    "check_mesh_size",
    "validate_python_path",
    "validate_resources",
]

#: How a mesh's members are placed over nodes (see :meth:`HeadState.place`).
STRATEGIES = ("SPREAD", "PACK", "STRICT_PACK", "STRICT_SPREAD")


#: The most folders a spawn's ``python_path`` may hold, and the longest one (characters).
MAX_PYTHON_PATH_ENTRIES = 64


MAX_PYTHON_PATH_CHARS = 4096


#: The most members one mesh may have (checked before anything is built for them).
MAX_MESH_SIZE = 65_536


#: The most resource kinds a request or a node may name, and the longest name.
MAX_RESOURCES = 64


MAX_RESOURCE_NAME = 128


def validate_resources(resources: Mapping[str, float]) -> dict[str, float]:
    """Resource amounts by name, checked: at most :data:`MAX_RESOURCES` names of at most
    :data:`MAX_RESOURCE_NAME` characters, each amount a finite number >= 0. Raises
    :class:`ConfigError` naming the first bad one."""
    if len(resources) > MAX_RESOURCES:
        raise ConfigError(f"{len(resources)} resources named; at most {MAX_RESOURCES} are allowed")
    out: dict[str, float] = {}
    for name, amount in resources.items():
        if not isinstance(name, str) or not name or len(name) > MAX_RESOURCE_NAME:
            raise ConfigError(
                f"resource names must be strings of 1 to {MAX_RESOURCE_NAME} characters, "
                f"got {name!r:.200}"
            )
        if (
            isinstance(amount, bool)
            or not isinstance(amount, int | float)
            or not 0 <= amount < math.inf
        ):
            raise ConfigError(
                f"resource {name!r} must be a finite non-negative number, got {amount!r}"
            )
        out[name] = float(amount)
    return out


def check_mesh_size(size: int) -> None:
    """Raise :class:`ConfigError` unless ``1 <= size <= MAX_MESH_SIZE``."""
    if not 1 <= size <= MAX_MESH_SIZE:
        raise ConfigError(f"a mesh has 1 to {MAX_MESH_SIZE} members, got n={size}")


#: Bounds on what a program hosting an actor registers (see :func:`check_hosted`).
MAX_HOSTED_NAME = 128
MAX_HOSTED_ENDPOINTS = 1024
MAX_HOSTED_TEXT = 1024


def check_hosted(name: str, class_path: str, call_address: str, endpoints: Sequence[str]) -> None:
    """Check what a program hosting an actor registers: a name of 1 to
    :data:`MAX_HOSTED_NAME` printable characters, a ``module:Class`` path and a
    ``scheme://`` call address of at most :data:`MAX_HOSTED_TEXT` characters without spaces,
    and at most :data:`MAX_HOSTED_ENDPOINTS` endpoint names that are identifiers. Raises
    :class:`ConfigError` naming the first bad field."""
    if not 1 <= len(name) <= MAX_HOSTED_NAME or not name.isprintable():
        raise ConfigError(
            f"a hosted actor's name has 1 to {MAX_HOSTED_NAME} printable characters, "
            f"got {name[:200]!r}"
        )
    module, colon, qualname = class_path.partition(":")
    if not colon or not module or not qualname or len(class_path) > MAX_HOSTED_TEXT:
        raise ConfigError(f"class_path must be 'module:Class', got {class_path[:200]!r}")
    scheme, sep, rest = call_address.partition("://")
    if (
        not (sep and scheme.isalnum() and rest)
        or len(call_address) > MAX_HOSTED_TEXT
        or any(c.isspace() for c in call_address)
    ):
        raise ConfigError(f"call_address must be 'scheme://...', got {call_address[:200]!r}")
    if len(endpoints) > MAX_HOSTED_ENDPOINTS:
        raise ConfigError(f"at most {MAX_HOSTED_ENDPOINTS} endpoints, got {len(endpoints)}")
    for e in endpoints:
        if not e.isidentifier() or len(e) > MAX_HOSTED_NAME:
            raise ConfigError(f"endpoint names are identifiers, got {e[:200]!r}")


def validate_python_path(entries: Sequence[str]) -> list[str]:
    """Check a spawn's ``python_path`` (folders its workers put first on ``sys.path``): at most
    :data:`MAX_PYTHON_PATH_ENTRIES` entries, each a non-empty string of at most
    :data:`MAX_PYTHON_PATH_CHARS` characters without NUL bytes. Raises :class:`ConfigError`
    naming the first bad entry."""
    if len(entries) > MAX_PYTHON_PATH_ENTRIES:
        raise ConfigError(
            f"python_path has {len(entries)} entries; at most {MAX_PYTHON_PATH_ENTRIES} are allowed"
        )
    out: list[str] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, str):
            raise ConfigError(f"python_path entry {index} is not a string: {entry!r}")
        if not entry:
            problem = "is empty"
        elif "\x00" in entry:
            problem = "contains a NUL byte"
        elif len(entry) > MAX_PYTHON_PATH_CHARS:
            problem = f"is longer than {MAX_PYTHON_PATH_CHARS} characters ({len(entry)})"
        else:
            out.append(entry)
            continue
        shown = repr(entry) if len(entry) <= 200 else f"{entry[:200]!r}..."
        raise ConfigError(f"python_path entry {index} {shown} {problem}")
    return out


@dataclasses.dataclass
class NodeRecord:
    node_id: str
    address: str
    total: dict[str, float]
    free: dict[str, float]
    labels: dict[str, str]
    last_heartbeat: float
    alive: bool = True
    #: Data-plane transports and devices the node reported when it registered.
    transports: list[str] = dataclasses.field(default_factory=list)
    devices: list[str] = dataclasses.field(default_factory=list)
    #: Worker processes it runs, as of its last heartbeat.
    workers: int = 0


@dataclasses.dataclass
class ActorRecord:
    actor_id: str
    mesh_id: str
    name: str
    rank: int
    class_path: str
    node_id: str
    resources: dict[str, float]
    worker_id: str = ""
    call_address: str = ""
    #: host:port of the hosting worker's gRPC service (the head asks it for metrics).
    control_address: str = ""
    pid: int = 0
    # starting -> alive -> stopped | dead | restarting (-> starting again, or dead)
    state: str = "starting"
    exit_code: int = 0
    signal: int = 0
    endpoints: list[str] = dataclasses.field(default_factory=list)
    #: How many times a death may be followed by a restart; the owner decides each one.
    max_restarts: int = 0
    restarts: int = 0
    #: The worker's last output when it died (a fatal-error dump, a traceback).
    last_output: str = ""
    #: The encoded constructor arguments, kept to re-create the actor with the same ones.
    init_args: bytes = b""
    #: The node labels it was placed by; a restart honours them too.
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Folders its workers put first on ``sys.path`` (the spawning job's import path); a
    #: restart uses them too.
    python_path: list[str] = dataclasses.field(default_factory=list)
    #: The reservation whose bundle it occupies (the bundle holds its resources), if any.
    reservation_id: str = ""
    bundle: int = -1

    @property
    def label(self) -> str:
        return f"{self.name}[{self.rank}]"


@dataclasses.dataclass
class Reservation:
    """Resources held on nodes ahead of spawning (a placement group): one bundle of
    ``resources`` on ``node_ids[i]`` for each ``i``; meshes spawned into it take free bundles."""

    reservation_id: str
    name: str
    resources: dict[str, float]
    node_ids: list[str]
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    strategy: str = "SPREAD"
    released: bool = False
