"""Placement over the head's nodes: which nodes a mesh's members or a reservation's bundles go
to under a strategy, what each node has free, and why a request cannot be placed. A part of
:class:`~._headstate.HeadState`, over the records it is given; no I/O."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from orchestr.errors import ConfigError, PlacementError

from ._records import (
    STRATEGIES,
    ActorRecord,
    NodeRecord,
    Reservation,
    check_mesh_size,
    validate_resources,
)

__all__ = ["Placement"]


class Placement:
    """Placement over the records of a :class:`~._headstate.HeadState`, which owns them and
    gives it these: its nodes, actors and reservations, the nodes registered with this head,
    the reservations changed since the last save, and ``touch``, which marks an actor record
    changed. It changes them in place (new actor records and reservations, the nodes' free
    resources) and never replaces them."""

    def __init__(
        self,
        nodes: dict[str, NodeRecord],
        actors: dict[str, ActorRecord],
        reservations: dict[str, Reservation],
        joined: set[str],
        dirty_reservations: set[str],
        touch: Callable[[ActorRecord], ActorRecord],
    ) -> None:
        self.nodes = nodes
        self.actors = actors
        self.reservations = reservations
        self.joined = joined
        self.dirty_reservations = dirty_reservations
        self._touch = touch

    def free_on(self, node_id: str, total: Mapping[str, float]) -> dict[str, float]:
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
                    + self.explain(name, 0, size, {k: v * size for k, v in request.items()}, labels)
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
                why = self.explain(name, rank, size, request, labels)
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
                    f"which is {'unknown' if node is None else self.condition(node)}"
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

    def explain(
        self,
        name: str,
        rank: int,
        size: int,
        request: Mapping[str, float],
        labels: Mapping[str, str],
    ) -> str:
        """Why member ``rank`` of ``size`` of mesh ``name`` finds no node: what it asks, and
        what each node has."""
        nodes = (
            "; ".join(
                f"{n.node_id} ({self.condition(n)}) free {n.free} labels {n.labels}"
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

    def condition(self, node: NodeRecord) -> str:
        """``node``'s condition in a message: dead, alive, or not registered again yet."""
        if not node.alive:
            return "dead"
        return "alive" if node.node_id in self.joined else "not registered again yet"
