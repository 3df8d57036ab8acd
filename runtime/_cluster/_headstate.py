"""The head's state as a plain object: nodes, resources, placement, actors. No I/O here; the
gRPC shell in :mod:`._head` feeds it events and acts on its decisions."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Mapping, Sequence

from orchestr.errors import ConfigError, PlacementError

__all__ = [
    "STRATEGIES",
    "ActorRecord",
    "HeadState",
    "NodeRecord",
    "Reservation",
    "validate_python_path",
    "validate_resources",
]

#: How a mesh's members are placed over nodes (see :meth:`HeadState.place`).
STRATEGIES = ("SPREAD", "PACK", "STRICT_PACK", "STRICT_SPREAD")

#: Ended actors (stopped or dead) the head keeps for lookups and ``status``; past this many,
#: the oldest are forgotten (see :meth:`HeadState.prune`).
ENDED_KEPT = 10_000

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


class HeadState:
    def __init__(self) -> None:
        self.nodes: dict[str, NodeRecord] = {}
        self.actors: dict[str, ActorRecord] = {}
        self.by_worker: dict[str, set[str]] = {}  # worker id -> the actors it hosts
        #: node id -> its workers whose process was stopped at its last heartbeat (not saved)
        self.suspended: dict[str, set[str]] = {}
        self.reservations: dict[str, Reservation] = {}
        #: Nodes that registered with this head (not merely loaded from its store).
        self.joined: set[str] = set()
        #: Records changed since the store last saved them (see :meth:`take_dirty`).
        self.dirty_actors: set[str] = set()
        self.dirty_nodes: set[str] = set()
        self.dirty_reservations: set[str] = set()
        #: Ended actors, oldest end first (for :meth:`prune`).
        self._ended: dict[str, None] = {}

    def take_dirty(self) -> tuple[list[NodeRecord], list[ActorRecord], list[Reservation]]:
        """The records changed since the last call, to save; clears the marks."""
        nodes = [self.nodes[i] for i in self.dirty_nodes if i in self.nodes]
        actors = [self.actors[i] for i in self.dirty_actors if i in self.actors]
        held = [self.reservations[i] for i in self.dirty_reservations if i in self.reservations]
        self.dirty_nodes.clear()
        self.dirty_actors.clear()
        self.dirty_reservations.clear()
        return nodes, actors, held

    def _touch(self, record: ActorRecord) -> ActorRecord:
        self.dirty_actors.add(record.actor_id)
        self._ended.pop(record.actor_id, None)
        if record.state in ("stopped", "dead"):
            self._ended[record.actor_id] = None  # the newest end
        return record

    def prune(self, keep: int | None = None) -> list[ActorRecord]:
        """Forget the actors that ended longest ago, past the ``keep`` (default
        :data:`ENDED_KEPT`) newest ended ones, so a long-lived head does not grow without
        bound. Returns the forgotten records."""
        keep = ENDED_KEPT if keep is None else keep
        gone = []
        while len(self._ended) > keep:
            actor_id = next(iter(self._ended))
            del self._ended[actor_id]
            a = self.actors.get(actor_id)
            if a is None or a.state not in ("stopped", "dead"):
                continue  # ended, then restarted: not ended any more
            del self.actors[actor_id]
            self.dirty_actors.discard(actor_id)
            hosted = self.by_worker.get(a.worker_id)
            if hosted is not None:
                hosted.discard(actor_id)
                if not hosted:
                    del self.by_worker[a.worker_id]
            gone.append(a)
        return gone

    def restore(
        self,
        nodes: Sequence[NodeRecord],
        actors: Sequence[ActorRecord],
        now: float,
        reservations: Sequence[Reservation] = (),
    ) -> None:
        """Take the records a previous head saved. Its nodes count as alive for one heartbeat
        timeout from ``now``, the time they have to register again (see :meth:`rejoin`); each
        node's free resources are recomputed from the actors it holds."""
        self.reservations.update((r.reservation_id, r) for r in reservations)
        for a in actors:
            self.actors[a.actor_id] = a
            if a.state in ("stopped", "dead"):
                self._ended[a.actor_id] = None
            if a.worker_id and a.state in ("starting", "alive"):
                self.by_worker.setdefault(a.worker_id, set()).add(a.actor_id)
        for n in nodes:
            n.last_heartbeat = now
            n.free = self._free_on(n.node_id, n.total)
            self.nodes[n.node_id] = n

    # -- nodes ---------------------------------------------------------------------------
    def register_node(
        self,
        node_id: str,
        address: str,
        total: Mapping[str, float],
        labels: Mapping[str, str],
        now: float,
        *,
        transports: Sequence[str] = (),
        devices: Sequence[str] = (),
    ) -> None:
        total = validate_resources(total)
        self.nodes[node_id] = NodeRecord(
            node_id,
            address,
            total,
            self._free_on(node_id, total),
            dict(labels),
            now,
            transports=list(transports),
            devices=list(devices),
        )
        self.joined.add(node_id)
        self.dirty_nodes.add(node_id)

    def rejoin(
        self, node_id: str, live_workers: Sequence[str], reason: str
    ) -> tuple[list[ActorRecord], list[str]]:
        """A node registers again (this head restarted, or had marked it dead) and lists the
        workers it still runs. Call before :meth:`register_node`.

        Its actors whose worker is among them are adopted as they are. The others, and those
        whose creation was in flight (``starting``), ended with the worker: each is
        ``restarting`` or ``dead`` as :meth:`worker_exited` says, with ``reason``. Returns
        those records, and the listed workers that host no live actor any more (the node
        stops them)."""
        live = set(live_workers)
        ended: list[ActorRecord] = []
        lost_workers = set()
        for a in self.actors.values():
            if a.node_id != node_id or a.state not in ("starting", "alive"):
                continue
            if a.state == "starting" or a.worker_id not in live:
                lost_workers.add(a.worker_id)
        for worker_id in sorted(lost_workers):
            if worker_id:
                ended += self.worker_exited(worker_id, -1, 0, reason)
        for a in self.actors.values():  # starting members not yet given a worker id
            if a.node_id == node_id and a.state == "starting":
                self.actor_ended(a.actor_id, stopped=False, exit_code=-1)
                a.last_output = reason
                if a.restarts < a.max_restarts:
                    a.state = "restarting"
                ended.append(a)
        hosting = {
            a.worker_id for a in self.actors.values() if a.node_id == node_id and a.state == "alive"
        }
        return ended, sorted(live - hosting)

    def heartbeat(
        self, node_id: str, now: float, workers: int = 0, suspended: Iterable[str] = ()
    ) -> bool:
        """Note a node's heartbeat, with the ids of its workers whose process is stopped.
        ``False`` when this head does not know it as a live node that registered with it
        (unknown, marked dead, or only loaded from the store): it must register again, and is
        not counted as alive until it does."""
        node = self.nodes.get(node_id)
        if node is None or not node.alive or node_id not in self.joined:
            return False
        node.last_heartbeat = now
        node.workers = workers
        self.suspended[node_id] = set(suspended)
        return True

    def is_suspended(self, actor: ActorRecord) -> bool:
        """Whether ``actor``'s worker was stopped (SIGSTOP) at its node's last heartbeat."""
        return actor.worker_id in self.suspended.get(actor.node_id, ())

    def expire_nodes(self, now: float, timeout: float) -> list[str]:
        """Mark nodes silent for longer than ``timeout`` dead; returns the newly dead ids."""
        dead = []
        for node in self.nodes.values():
            if node.alive and now - node.last_heartbeat > timeout:
                node.alive = False
                self.joined.discard(node.node_id)
                self.dirty_nodes.add(node.node_id)
                dead.append(node.node_id)
        return dead

    def _free_on(self, node_id: str, total: Mapping[str, float]) -> dict[str, float]:
        """What of ``total`` the node's actors and reservations leave free."""
        used = self._used_on(node_id)
        return {k: v - used.get(k, 0.0) for k, v in total.items()}

    def _used_on(self, node_id: str) -> dict[str, float]:
        """What a node's actors and reservations hold (an actor in a reservation's bundle
        holds nothing of its own)."""
        held = [
            r.resources
            for r in self.reservations.values()
            if not r.released
            for bundle_node in r.node_ids
            if bundle_node == node_id
        ]
        for a in self.actors.values():
            if a.node_id == node_id and a.state in ("starting", "alive") and not a.reservation_id:
                held.append(a.resources)
        used: dict[str, float] = {}
        for resources in held:
            for k, v in resources.items():
                used[k] = used.get(k, 0.0) + v
        return used

    # -- placement -----------------------------------------------------------------------
    def place(
        self,
        mesh_id: str,
        name: str,
        class_path: str,
        size: int,
        resources: Mapping[str, float],
        labels: Mapping[str, str],
        new_id: Mapping[int, str],
        strategy: str = "SPREAD",
        reservation_id: str = "",
    ) -> list[ActorRecord]:
        """Reserve a node for each of ``size`` members by ``strategy`` (:data:`STRATEGIES`):

        - ``SPREAD``: each member on the node with most free CPU at that point (best effort:
          load spreads over the nodes); members that ask for no CPU go to the node holding
          fewest of the mesh so far, then most free CPU;
        - ``PACK``: each member on the node holding most of the mesh so far, then the one
          with least free CPU that fits (best effort: as few nodes as fit);
        - ``STRICT_PACK``: every member on one node, or none;
        - ``STRICT_SPREAD``: every member on a node of its own, or none.

        With ``reservation_id``, the members take that reservation's free bundles instead
        (see :meth:`reserve`).

        All or nothing: raises :class:`PlacementError` naming what was asked and what each node
        has free, with nothing reserved; :class:`ConfigError` for an unknown strategy.
        """
        check_mesh_size(size)
        request = validate_resources(resources)
        if reservation_id:
            return self._place_reserved(
                mesh_id, name, class_path, size, request, new_id, reservation_id
            )
        nodes = self._choose(name, size, request, labels, strategy)
        placed = []
        for rank, node in enumerate(nodes):
            record = ActorRecord(
                new_id[rank], mesh_id, name, rank, class_path, node.node_id, request
            )
            record.labels = dict(labels)
            self.actors[record.actor_id] = record
            placed.append(self._touch(record))
        return placed

    def _choose(
        self,
        name: str,
        size: int,
        request: Mapping[str, float],
        labels: Mapping[str, str],
        strategy: str,
    ) -> list[NodeRecord]:
        """A node for each of ``size`` members (see :meth:`place`), each node's free resources
        taken as it is chosen; all or nothing."""
        if strategy not in STRATEGIES:
            raise ConfigError(
                f"unknown placement strategy {strategy!r}; say one of {', '.join(STRATEGIES)}"
            )
        chosen: list[NodeRecord] = []
        members: dict[str, int] = {}  # node id -> members of this mesh placed there

        def fits(n: NodeRecord, count: int = 1) -> bool:
            return (
                self.usable(n)
                and all(n.labels.get(k) == v for k, v in labels.items())
                and all(n.free.get(k, 0.0) + 1e-9 >= v * count for k, v in request.items())
            )

        only: NodeRecord | None = None
        if strategy == "STRICT_PACK":
            whole = [n for n in self.nodes.values() if fits(n, size)]
            if not whole:
                raise PlacementError(
                    "STRICT_PACK: no single node fits all "
                    + self._explain(
                        name, 0, size, {k: v * size for k, v in request.items()}, labels
                    )
                )
            only = max(whole, key=lambda n: (n.free.get("cpu", 0.0), n.node_id))
        for rank in range(size):
            candidates = [n for n in self.nodes.values() if fits(n)]
            if only is not None:
                candidates = [only]
            elif strategy == "STRICT_SPREAD":
                candidates = [n for n in candidates if n.node_id not in members]
            if not candidates:
                for node in chosen:  # first, so the message shows the nodes without this mesh
                    for k, v in request.items():
                        node.free[k] = node.free.get(k, 0.0) + v
                why = self._explain(name, rank, size, request, labels)
                if strategy == "STRICT_SPREAD":
                    why = f"STRICT_SPREAD: every member needs a node of its own; {why}"
                raise PlacementError(why)
            if strategy == "PACK":
                node = max(
                    candidates,
                    key=lambda n: (members.get(n.node_id, 0), -n.free.get("cpu", 0.0), n.node_id),
                )
            elif not request.get("cpu"):  # SPREAD of members that take no CPU: free CPU
                node = max(  # does not move as they land, so spread them by count
                    candidates,
                    key=lambda n: (-members.get(n.node_id, 0), n.free.get("cpu", 0.0), n.node_id),
                )
            else:
                node = max(candidates, key=lambda n: (n.free.get("cpu", 0.0), n.node_id))
            for k, v in request.items():
                node.free[k] = node.free.get(k, 0.0) - v
            members[node.node_id] = members.get(node.node_id, 0) + 1
            chosen.append(node)
        return chosen

    # -- reservations --------------------------------------------------------------------
    def reserve(
        self,
        reservation_id: str,
        name: str,
        bundles: int,
        resources: Mapping[str, float],
        labels: Mapping[str, str],
        strategy: str = "SPREAD",
    ) -> Reservation:
        """Take ``bundles`` bundles of ``resources`` on nodes chosen by ``strategy`` (as
        :meth:`place` chooses them), all at once or none, for meshes spawned into it later.
        Raises :class:`PlacementError` or :class:`ConfigError`."""
        if bundles < 1:
            raise ConfigError(f"a reservation needs at least one bundle, got {bundles}")
        request = validate_resources(resources)
        nodes = self._choose(name, bundles, request, labels, strategy)
        r = Reservation(
            reservation_id, name, request, [n.node_id for n in nodes], dict(labels), strategy
        )
        self.reservations[reservation_id] = r
        self.dirty_reservations.add(reservation_id)
        return r

    def _place_reserved(
        self,
        mesh_id: str,
        name: str,
        class_path: str,
        size: int,
        request: dict[str, float],
        new_id: Mapping[int, str],
        reservation_id: str,
    ) -> list[ActorRecord]:
        r = self.reservations.get(reservation_id)
        if r is None or r.released:
            state = "released" if r is not None else "unknown"
            raise ConfigError(f"reservation {reservation_id!r} is {state}")
        request = request or dict(r.resources)
        over = {k: v for k, v in request.items() if v > r.resources.get(k, 0.0) + 1e-9}
        if over:
            raise PlacementError(
                f"mesh {name!r} asks for {over} a member, more than a bundle of reservation "
                f"{r.name!r} holds ({r.resources})"
            )
        held = {
            a.bundle
            for a in self.actors.values()
            if a.reservation_id == reservation_id and a.state in ("starting", "alive", "restarting")
        }
        free = [i for i in range(len(r.node_ids)) if i not in held]
        if len(free) < size:
            raise PlacementError(
                f"reservation {r.name!r} has {len(free)} free bundle(s) of {len(r.node_ids)}; "
                f"mesh {name!r} needs {size}"
            )
        for bundle in free[:size]:
            node = self.nodes.get(r.node_ids[bundle])
            if node is None or not self.usable(node):
                raise PlacementError(
                    f"bundle {bundle} of reservation {r.name!r} is on node {r.node_ids[bundle]}, "
                    f"which is {'unknown' if node is None else self._condition(node)}"
                )
        placed = []
        for rank, bundle in enumerate(free[:size]):
            record = ActorRecord(
                new_id[rank], mesh_id, name, rank, class_path, r.node_ids[bundle], request
            )
            record.labels = dict(r.labels)
            record.reservation_id, record.bundle = reservation_id, bundle
            self.actors[record.actor_id] = record
            placed.append(self._touch(record))
        return placed

    def release(self, reservation_id: str) -> list[ActorRecord]:
        """Give a reservation's resources back to its nodes. Returns the actors still placed
        in it (``starting`` or ``alive``: the caller stops them); those waiting for a restart
        are dead. Unknown or released already: nothing."""
        r = self.reservations.get(reservation_id)
        if r is None or r.released:
            return []
        r.released = True
        self.dirty_reservations.add(reservation_id)
        for node_id in r.node_ids:
            node = self.nodes.get(node_id)
            if node is not None:
                for k, v in r.resources.items():
                    node.free[k] = node.free.get(k, 0.0) + v
        live = []
        for a in self.actors.values():
            if a.reservation_id != reservation_id:
                continue
            if a.state == "restarting":
                a.state = "dead"
                self._touch(a)
            elif a.state in ("starting", "alive"):
                live.append(a)
        return live

    def _explain(
        self,
        name: str,
        rank: int,
        size: int,
        request: Mapping[str, float],
        labels: Mapping[str, str],
    ) -> str:
        nodes = (
            "; ".join(
                f"{n.node_id} ({self._condition(n)}) free {n.free} labels {n.labels}"
                for n in self.nodes.values()
            )
            or "no nodes registered"
        )
        return (
            f"cannot place member {rank} of {size} of mesh {name!r}: it needs resources "
            f"{dict(request)} on a node with labels {dict(labels)}; {nodes}"
        )

    def usable(self, node: NodeRecord) -> bool:
        """Whether members may be placed on ``node``: alive, and registered with this head
        (a node known only from the store is not, until it registers again)."""
        return node.alive and node.node_id in self.joined

    def _condition(self, node: NodeRecord) -> str:
        if not node.alive:
            return "dead"
        return "alive" if node.node_id in self.joined else "not registered again yet"

    def _release(self, record: ActorRecord) -> None:
        node = self.nodes.get(record.node_id)
        if node is not None and not record.reservation_id:  # else its bundle keeps them
            for k, v in record.resources.items():
                node.free[k] = node.free.get(k, 0.0) + v

    # -- actor lifecycle -----------------------------------------------------------------
    def actor_started(
        self, actor_id: str, worker_id: str, call_address: str, pid: int, endpoints: list[str]
    ) -> None:
        a = self.actors[actor_id]
        a.worker_id, a.call_address, a.pid, a.endpoints = worker_id, call_address, pid, endpoints
        a.state = "alive"
        self.by_worker.setdefault(worker_id, set()).add(actor_id)
        self._touch(a)

    def actor_ended(
        self, actor_id: str, *, stopped: bool, exit_code: int = 0, signal: int = 0
    ) -> ActorRecord | None:
        """Record an end (a stop we asked for, or a death); releases its resources once."""
        a = self.actors.get(actor_id)
        if a is None or a.state in ("stopped", "dead"):
            return None
        if a.state != "restarting":  # a restarting actor holds nothing
            self._release(a)
        a.state = "stopped" if stopped else "dead"
        a.exit_code, a.signal = exit_code, signal
        return self._touch(a)

    def worker_exited(
        self, worker_id: str, exit_code: int, signal: int, last_output: str = ""
    ) -> list[ActorRecord]:
        """A worker died, and every actor it hosted: each is ``restarting`` while it has
        restarts left (its owner then restarts or abandons it), else ``dead``. Returns those
        records (none for a worker that hosts nothing, or actors that had already ended)."""
        ended = []
        for actor_id in sorted(self.by_worker.pop(worker_id, ())):
            a = self.actor_ended(actor_id, stopped=False, exit_code=exit_code, signal=signal)
            if a is not None:
                a.last_output = last_output
                if a.restarts < a.max_restarts:
                    a.state = "restarting"
                ended.append(a)
        return ended

    def node_lost(self, node_id: str, reason: str) -> list[ActorRecord]:
        """A node went silent (marked dead): every worker it hosted is taken as exited, so each
        of its actors is ``restarting`` or ``dead`` as :meth:`worker_exited` says. Returns
        those records."""
        workers = {
            a.worker_id
            for a in self.actors.values()
            if a.node_id == node_id and a.worker_id and a.state in ("starting", "alive")
        }
        ended: list[ActorRecord] = []
        for worker_id in sorted(workers):
            ended += self.worker_exited(worker_id, -1, 0, reason)
        return ended

    def restart(self, actor_id: str) -> ActorRecord:
        """Reserve a node for a ``restarting`` actor again: its old node when it is alive and
        has room, else the one with most free CPU that fits. Raises :class:`PlacementError`
        (the actor stays ``restarting``) or :class:`ConfigError` for an actor in another state."""
        a = self.actors.get(actor_id)
        if a is None or a.state != "restarting":
            state = "unknown" if a is None else a.state
            raise ConfigError(f"actor {actor_id!r} is {state}, not waiting for a restart")
        old = self.nodes.get(a.node_id)
        if a.reservation_id:  # back into its bundle, which kept its resources
            r = self.reservations.get(a.reservation_id)
            if r is None or r.released or old is None or not self.usable(old):
                where = (
                    "released"
                    if r is None or r.released
                    else f"on node {a.node_id}, "
                    + ("unknown" if old is None else self._condition(old))
                )
                raise PlacementError(
                    f"{a.label} cannot restart in its bundle of reservation "
                    f"{a.reservation_id!r}: it is {where}"
                )
            node = old
        else:
            fits = [
                n
                for n in self.nodes.values()
                if self.usable(n)
                and all(n.labels.get(k) == v for k, v in a.labels.items())
                and all(n.free.get(k, 0.0) + 1e-9 >= v for k, v in a.resources.items())
            ]
            if not fits:
                raise PlacementError(self._explain(a.name, a.rank, 1, a.resources, a.labels))
            node = (
                old if old in fits else max(fits, key=lambda n: (n.free.get("cpu", 0.0), n.node_id))
            )
            for k, v in a.resources.items():
                node.free[k] = node.free.get(k, 0.0) - v
        a.node_id = node.node_id
        a.state = "starting"
        a.restarts += 1
        a.worker_id = a.call_address = ""
        a.pid = a.exit_code = a.signal = 0
        return self._touch(a)

    def restart_failed(self, actor_id: str) -> None:
        """Creating the new incarnation failed: back to ``restarting`` (the owner may try
        again while restarts are left, or abandon it), holding nothing."""
        a = self.actors.get(actor_id)
        if a is not None and a.state in ("starting", "alive"):
            self._release(a)
            if a.worker_id:
                self.by_worker.get(a.worker_id, set()).discard(actor_id)
            a.state = "restarting" if a.restarts < a.max_restarts else "dead"
            self._touch(a)

    def abandon(self, actor_id: str) -> ActorRecord | None:
        """The owner gives up on a ``restarting`` actor: it is ``dead`` for good."""
        a = self.actors.get(actor_id)
        if a is None or a.state != "restarting":
            return None
        a.state = "dead"
        return self._touch(a)

    def mesh_members(self, mesh_id: str) -> list[ActorRecord]:
        return sorted(
            (a for a in self.actors.values() if a.mesh_id == mesh_id), key=lambda a: a.rank
        )

    @staticmethod
    def now() -> float:
        return time.time()
