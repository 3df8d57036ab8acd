"""The head's state as a plain object: nodes, resources, placement, actors. No I/O here; the
gRPC shell in :mod:`._head` feeds it events and acts on its decisions."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from orchestr import clock
from orchestr.errors import ConfigError, PlacementError

from ._placement import Placement
from ._records import (
    ActorRecord,
    NodeRecord,
    Reservation,
    validate_resources,
)

__all__ = ["HeadState"]


#: Ended actors (stopped or dead) the head keeps for lookups and ``status``; past this many,
#: the oldest are forgotten (see :meth:`HeadState.prune`).
ENDED_KEPT = 10_000


class HeadState:
    """Nodes, actors and reservations, and every transition of them (placement is its part
    :class:`~._placement.Placement`'s)."""

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
        self.placement = Placement(
            self.nodes,
            self.actors,
            self.reservations,
            self.joined,
            self.dirty_reservations,
            self._touch,
        )

    def _touch(self, record: ActorRecord) -> ActorRecord:
        """Mark ``record`` changed (to save), and ended last when it ended."""
        self.dirty_actors.add(record.actor_id)
        self._ended.pop(record.actor_id, None)
        if record.state in ("stopped", "dead"):
            self._ended[record.actor_id] = None  # the newest end
        return record

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
        """Place a mesh's members: :meth:`Placement.place <._placement.Placement.place>`."""
        return self.placement.place(
            mesh_id, name, class_path, size, resources, labels, new_id, strategy, reservation_id
        )

    def reserve(
        self,
        reservation_id: str,
        name: str,
        bundles: int,
        resources: Mapping[str, float],
        labels: Mapping[str, str],
        strategy: str = "SPREAD",
    ) -> Reservation:
        """Take bundles: :meth:`Placement.reserve <._placement.Placement.reserve>`."""
        return self.placement.reserve(reservation_id, name, bundles, resources, labels, strategy)

    def release(self, reservation_id: str) -> list[ActorRecord]:
        """Give bundles back: :meth:`Placement.release <._placement.Placement.release>`."""
        return self.placement.release(reservation_id)

    def take_dirty(self) -> tuple[list[NodeRecord], list[ActorRecord], list[Reservation]]:
        """The records changed since the last call, to save; clears the marks."""
        nodes = [self.nodes[i] for i in self.dirty_nodes if i in self.nodes]
        actors = [self.actors[i] for i in self.dirty_actors if i in self.actors]
        held = [self.reservations[i] for i in self.dirty_reservations if i in self.reservations]
        self.dirty_nodes.clear()
        self.dirty_actors.clear()
        self.dirty_reservations.clear()
        return nodes, actors, held

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
            n.free = self.placement.free_on(n.node_id, n.total)
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
            self.placement.free_on(node_id, total),
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
            if r is None or r.released or old is None or not self.placement.usable(old):
                where = (
                    "released"
                    if r is None or r.released
                    else f"on node {a.node_id}, "
                    + ("unknown" if old is None else self.placement.condition(old))
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
                if self.placement.usable(n)
                and all(n.labels.get(k) == v for k, v in a.labels.items())
                and all(n.free.get(k, 0.0) + 1e-9 >= v for k, v in a.resources.items())
            ]
            if not fits:
                raise PlacementError(
                    self.placement.explain(a.name, a.rank, 1, a.resources, a.labels)
                )
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

    # -- actors hosted by programs of their own -------------------------------------------
    def host(
        self,
        mesh_id: str,
        actor_id: str,
        name: str,
        class_path: str,
        call_address: str,
        endpoints: list[str],
        pid: int,
    ) -> ActorRecord:
        """An actor a program of its own hosts (no node, no worker, no resources) is alive at
        ``call_address``: recorded, or alive again at that address when the program registers
        after this head restarted. Raises :class:`ConfigError` when ``actor_id`` is another
        actor's or one that was stopped."""
        a = self.actors.get(actor_id)
        if a is not None and (
            a.node_id or a.mesh_id != mesh_id or a.class_path != class_path or a.state == "stopped"
        ):
            raise ConfigError(f"actor {actor_id!r} cannot be registered again by this program")
        if a is None:
            a = ActorRecord(actor_id, mesh_id, name, 0, class_path, "", {})
            self.actors[actor_id] = a
        a.worker_id = f"x-{actor_id[2:]}"  # one per actor: nothing else shares its process
        a.call_address, a.endpoints, a.pid = call_address, endpoints, pid
        a.state, a.exit_code, a.signal, a.last_output = "alive", 0, 0, ""
        self.by_worker[a.worker_id] = {actor_id}
        return self._touch(a)

    def host_lost(self, actor_id: str, reason: str) -> ActorRecord | None:
        """The program hosting ``actor_id`` went away without stopping it: it is ``dead``
        (``None`` when it had ended already)."""
        a = self.actors.get(actor_id)
        if a is None or a.node_id or a.state != "alive":
            return None
        self.by_worker.pop(a.worker_id, None)
        a.exit_code, a.last_output = -1, reason
        return self.actor_ended(actor_id, stopped=False, exit_code=-1)

    def mesh_members(self, mesh_id: str) -> list[ActorRecord]:
        return sorted(
            (a for a in self.actors.values() if a.mesh_id == mesh_id), key=lambda a: a.rank
        )

    @staticmethod
    def now() -> float:
        return clock.time()
