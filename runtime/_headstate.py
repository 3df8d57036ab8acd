"""The head's state as a plain object: nodes, resources, placement, actors. No I/O here; the
gRPC shell in :mod:`._head` feeds it events and acts on its decisions."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

from .errors import ConfigError, PlacementError

__all__ = ["ActorRecord", "HeadState", "NodeRecord", "validate_resources"]


def validate_resources(resources: Mapping[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, amount in resources.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"resource names must be non-empty strings, got {name!r}")
        if isinstance(amount, bool) or not isinstance(amount, int | float) or not amount >= 0:
            raise ConfigError(f"resource {name!r} must be a non-negative number, got {amount!r}")
        out[name] = float(amount)
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
    pid: int = 0
    state: str = "starting"  # starting -> alive -> stopped | dead
    exit_code: int = 0
    signal: int = 0
    endpoints: list[str] = dataclasses.field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.name}[{self.rank}]"


class HeadState:
    def __init__(self) -> None:
        self.nodes: dict[str, NodeRecord] = {}
        self.actors: dict[str, ActorRecord] = {}
        self.by_worker: dict[str, str] = {}  # worker id -> actor id

    # -- nodes ---------------------------------------------------------------------------
    def register_node(
        self,
        node_id: str,
        address: str,
        total: Mapping[str, float],
        labels: Mapping[str, str],
        now: float,
    ) -> None:
        used = self._used_on(node_id)
        free = {k: v - used.get(k, 0.0) for k, v in total.items()}
        self.nodes[node_id] = NodeRecord(node_id, address, dict(total), free, dict(labels), now)

    def heartbeat(self, node_id: str, now: float) -> bool:
        node = self.nodes.get(node_id)
        if node is None:
            return False
        node.last_heartbeat = now
        node.alive = True
        return True

    def expire_nodes(self, now: float, timeout: float) -> list[str]:
        """Mark nodes silent for longer than ``timeout`` dead; returns the newly dead ids."""
        dead = []
        for node in self.nodes.values():
            if node.alive and now - node.last_heartbeat > timeout:
                node.alive = False
                dead.append(node.node_id)
        return dead

    def _used_on(self, node_id: str) -> dict[str, float]:
        used: dict[str, float] = {}
        for a in self.actors.values():
            if a.node_id == node_id and a.state in ("starting", "alive"):
                for k, v in a.resources.items():
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
    ) -> list[ActorRecord]:
        """Reserve a node for each of ``size`` members, spreading by most free CPU.

        All or nothing: raises :class:`PlacementError` naming what was asked and what each node
        has free, with nothing reserved.
        """
        if size < 1:
            raise ConfigError(f"a mesh needs at least one member, got n={size}")
        request = validate_resources(resources)
        placed: list[ActorRecord] = []
        for rank in range(size):
            candidates = [
                n
                for n in self.nodes.values()
                if n.alive
                and all(n.labels.get(k) == v for k, v in labels.items())
                and all(n.free.get(k, 0.0) + 1e-9 >= v for k, v in request.items())
            ]
            if not candidates:
                for record in placed:
                    self._release(record)
                    del self.actors[record.actor_id]
                raise PlacementError(self._explain(name, rank, size, request, labels))
            node = max(candidates, key=lambda n: (n.free.get("cpu", 0.0), n.node_id))
            for k, v in request.items():
                node.free[k] = node.free.get(k, 0.0) - v
            record = ActorRecord(
                new_id[rank], mesh_id, name, rank, class_path, node.node_id, request
            )
            self.actors[record.actor_id] = record
            placed.append(record)
        return placed

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
                f"{n.node_id} ({'alive' if n.alive else 'dead'}) free {n.free} labels {n.labels}"
                for n in self.nodes.values()
            )
            or "no nodes registered"
        )
        return (
            f"cannot place member {rank} of {size} of mesh {name!r}: it needs resources "
            f"{dict(request)} on a node with labels {dict(labels)}; {nodes}"
        )

    def _release(self, record: ActorRecord) -> None:
        node = self.nodes.get(record.node_id)
        if node is not None:
            for k, v in record.resources.items():
                node.free[k] = node.free.get(k, 0.0) + v

    # -- actor lifecycle -----------------------------------------------------------------
    def actor_started(
        self, actor_id: str, worker_id: str, call_address: str, pid: int, endpoints: list[str]
    ) -> None:
        a = self.actors[actor_id]
        a.worker_id, a.call_address, a.pid, a.endpoints = worker_id, call_address, pid, endpoints
        a.state = "alive"
        self.by_worker[worker_id] = actor_id

    def actor_ended(
        self, actor_id: str, *, stopped: bool, exit_code: int = 0, signal: int = 0
    ) -> ActorRecord | None:
        """Record an end (a stop we asked for, or a death); releases its resources once."""
        a = self.actors.get(actor_id)
        if a is None or a.state in ("stopped", "dead"):
            return None
        self._release(a)
        a.state = "stopped" if stopped else "dead"
        a.exit_code, a.signal = exit_code, signal
        return a

    def worker_exited(self, worker_id: str, exit_code: int, signal: int) -> ActorRecord | None:
        actor_id = self.by_worker.get(worker_id)
        if actor_id is None:
            return None
        return self.actor_ended(actor_id, stopped=False, exit_code=exit_code, signal=signal)

    def mesh_members(self, mesh_id: str) -> list[ActorRecord]:
        return sorted(
            (a for a in self.actors.values() if a.mesh_id == mesh_id), key=lambda a: a.rank
        )

    @staticmethod
    def now() -> float:
        return time.time()
