"""Protobuf to dataclasses and back: the one place where control-plane messages meet the rest.

Everything outside ``_control/`` and the services (the head, node and worker servicers) sees
the dataclasses here: :class:`NodeInfo` and :class:`ActorInfo` (what ``JobContext.nodes()`` and
``actors()`` return), :class:`MeshInfo`, :class:`ReservationInfo`, :class:`JobInfo`, and the
fabric manager's :class:`~orchestr.fabric.optical.PlanRecord` and state. The services build
their replies with the ``*_to_pb`` functions, clients read them with the ``*_from_pb`` ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from orchestr.protos import orchestr_pb2 as pb

if TYPE_CHECKING:
    from orchestr._cluster._records import ActorRecord, NodeRecord
    from orchestr._job._policy import RestartPolicy
    from orchestr.fabric.optical import PlanRecord

__all__ = [
    "ActorInfo",
    "JobInfo",
    "MeshInfo",
    "NodeInfo",
    "ReservationInfo",
    "actor_from_pb",
    "actor_to_pb",
    "fabric_state_from_pb",
    "fabric_state_to_pb",
    "job_from_pb",
    "mesh_from_pb",
    "node_from_pb",
    "node_to_pb",
    "plan_from_pb",
    "plan_to_pb",
    "restart_policy_to_pb",
]


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """A node as the head last heard of it: resources (``total``, ``free``; "cpu", "memory"
    in bytes, "gpu", ...), labels, the data-plane transports and devices it offers, and how
    many worker processes it runs."""

    __module__ = "orchestr"

    node_id: str
    address: str
    total: dict[str, float]
    free: dict[str, float]
    labels: dict[str, str]
    last_heartbeat_unix: float
    alive: bool
    transports: list[str]
    devices: list[str]
    workers: int


@dataclasses.dataclass(frozen=True)
class ActorInfo:
    """One member of a mesh as the head records it. ``state`` is ``starting``, ``alive``,
    ``restarting``, ``stopped`` or ``dead``; ``pid``, ``exit_code`` and ``signal`` describe its
    worker process (the last one, for an ended actor), ``last_output`` the worker's last lines
    when it died; ``suspended``: the process is stopped (SIGSTOP)."""

    __module__ = "orchestr"

    actor_id: str
    mesh_id: str
    name: str
    rank: int
    class_path: str
    node_id: str
    worker_id: str
    call_address: str
    state: str
    pid: int
    exit_code: int
    signal: int
    endpoints: list[str]
    restarts: int
    max_restarts: int
    last_output: str
    suspended: bool


@dataclasses.dataclass(frozen=True)
class MeshInfo:
    mesh_id: str
    name: str
    class_path: str
    members: list[ActorInfo]


@dataclasses.dataclass(frozen=True)
class ReservationInfo:
    reservation_id: str
    name: str
    resources: dict[str, float]
    node_ids: list[str]


@dataclasses.dataclass(frozen=True)
class JobInfo:
    """A submitted job: ``state`` is ``running``, ``succeeded``, ``failed`` or ``stopped``."""

    job_id: str
    entrypoint: str
    args: list[str]
    state: str
    exit_code: int
    submitted_unix: float
    ended_unix: float
    pid: int
    reason: str


def node_to_pb(n: NodeRecord) -> pb.NodeInfo:
    return pb.NodeInfo(
        node_id=n.node_id,
        address=n.address,
        total=pb.Resources(amounts=n.total),
        free=pb.Resources(amounts=n.free),
        labels=n.labels,
        last_heartbeat_unix=n.last_heartbeat,
        alive=n.alive,
        transports=n.transports,
        devices=n.devices,
        workers=n.workers,
    )


def node_from_pb(m: pb.NodeInfo) -> NodeInfo:
    return NodeInfo(
        node_id=m.node_id,
        address=m.address,
        total=dict(m.total.amounts),
        free=dict(m.free.amounts),
        labels=dict(m.labels),
        last_heartbeat_unix=m.last_heartbeat_unix,
        alive=m.alive,
        transports=list(m.transports),
        devices=list(m.devices),
        workers=m.workers,
    )


def actor_to_pb(a: ActorRecord, suspended: bool = False) -> pb.ActorInfo:
    return pb.ActorInfo(
        actor_id=a.actor_id,
        mesh_id=a.mesh_id,
        name=a.name,
        rank=a.rank,
        class_path=a.class_path,
        node_id=a.node_id,
        worker_id=a.worker_id,
        call_address=a.call_address,
        state=a.state,
        pid=a.pid,
        exit_code=a.exit_code,
        signal=a.signal,
        endpoints=a.endpoints,
        restarts=a.restarts,
        max_restarts=a.max_restarts,
        last_output=a.last_output,
        suspended=suspended,
    )


def actor_from_pb(m: pb.ActorInfo) -> ActorInfo:
    return ActorInfo(
        actor_id=m.actor_id,
        mesh_id=m.mesh_id,
        name=m.name,
        rank=m.rank,
        class_path=m.class_path,
        node_id=m.node_id,
        worker_id=m.worker_id,
        call_address=m.call_address,
        state=m.state,
        pid=m.pid,
        exit_code=m.exit_code,
        signal=m.signal,
        endpoints=list(m.endpoints),
        restarts=m.restarts,
        max_restarts=m.max_restarts,
        last_output=m.last_output,
        suspended=m.suspended,
    )


def mesh_from_pb(m: pb.MeshInfo) -> MeshInfo:
    return MeshInfo(m.mesh_id, m.name, m.class_path, [actor_from_pb(a) for a in m.members])


def reservation_from_pb(m: pb.ReservationInfo) -> ReservationInfo:
    return ReservationInfo(m.reservation_id, m.name, dict(m.resources.amounts), list(m.node_ids))


def job_from_pb(m: pb.JobInfo) -> JobInfo:
    return JobInfo(
        job_id=m.job_id,
        entrypoint=m.entrypoint,
        args=list(m.args),
        state=m.state,
        exit_code=m.exit_code,
        submitted_unix=m.submitted_unix,
        ended_unix=m.ended_unix,
        pid=m.pid,
        reason=m.reason,
    )


def restart_policy_to_pb(policy: RestartPolicy) -> pb.RestartPolicy:
    return pb.RestartPolicy(
        max_restarts=policy.max_restarts,
        backoff_s=policy.backoff_s,
        backoff_max_s=policy.backoff_max_s,
        retry=policy.retry,
    )


def _counts(rows: Sequence[Sequence[Any]]) -> list[pb.CircuitCount]:
    return [pb.CircuitCount(a=a, b=b, count=n) for a, b, n in rows]


def _rows(counts: Sequence[pb.CircuitCount]) -> list[list[Any]]:
    return [[c.a, c.b, c.count] for c in counts]


def plan_to_pb(record: PlanRecord | Mapping[str, Any]) -> pb.FabricPlan:
    """A plan record, or a dry run's plan: a mapping with ``demand`` and no ``seq``."""
    d = dataclasses.asdict(record) if dataclasses.is_dataclass(record) else dict(record)
    dry = "seq" not in d
    return pb.FabricPlan(
        seq=d.get("seq", 0),
        at_unix=d.get("at_unix", 0.0),
        job_id=d.get("job_id", ""),
        phase=d["phase"],
        add=_counts(d["add"]),
        remove=_counts(d["remove"]),
        keep=_counts(d["keep"]),
        predicted_s_static=d["predicted_s_static"],
        predicted_s_with=d["predicted_s_with"],
        saving_s=d["saving_s"],
        reconfig_cost_s=d["reconfig_cost_s"],
        port_changes=d.get("port_changes", 0),
        commit=d["commit"],
        reason=d["reason"],
        status=d.get("status", ""),
        generation=d.get("generation", 0),
        timings=dict(d.get("timings", {})),
        events=list(d.get("events", ())),
        dry_run=dry,
        demand=[pb.SwitchTraffic(src=a, dst=b, nbytes=n) for a, b, n in d.get("demand", ())],
    )


def plan_from_pb(m: pb.FabricPlan) -> dict[str, Any]:
    """The plan as plain data: a :class:`~orchestr.fabric.optical.PlanRecord`'s fields, or for
    a dry run the plan's (``phase``, ``demand``, the circuits, predictions and decision)."""
    out: dict[str, Any] = {"phase": m.phase}
    if m.dry_run:
        out["demand"] = [[t.src, t.dst, t.nbytes] for t in m.demand]
    else:
        out = {"seq": m.seq, "at_unix": m.at_unix, "job_id": m.job_id, **out}
    out |= {
        "add": _rows(m.add),
        "remove": _rows(m.remove),
        "keep": _rows(m.keep),
        "predicted_s_static": m.predicted_s_static,
        "predicted_s_with": m.predicted_s_with,
        "saving_s": m.saving_s,
        "reconfig_cost_s": m.reconfig_cost_s,
    }
    if not m.dry_run:
        out["port_changes"] = m.port_changes
    out |= {"commit": m.commit, "reason": m.reason}
    if not m.dry_run:
        out |= {
            "status": m.status,
            "generation": m.generation,
            "timings": dict(m.timings),
            "events": list(m.events),
        }
    return out


def fabric_state_to_pb(show: Mapping[str, Any]) -> pb.FabricState:
    """The fabric manager's ``show()``."""
    return pb.FabricState(
        hosts=show["hosts"],
        accelerators=show["accelerators"],
        switches=dict(show["switches"]),
        endpoints=list(show["endpoints"]),
        circuit_gbps=show["circuit_gbps"],
        generation=show["generation"],
        ocs=[
            pb.OcsState(
                name=o["name"],
                radix=o["radix"],
                wired=o["wired"],
                circuits=[
                    pb.OcsCircuit(port_a=pa, port_b=pb_, a=a, b=b)
                    for pa, pb_, a, b in o["circuits"]
                ],
            )
            for o in show["ocs"]
        ],
    )


def fabric_state_from_pb(m: pb.FabricState) -> dict[str, Any]:
    """The inverse of :func:`fabric_state_to_pb`: what the manager's ``show()`` returned."""
    return {
        "hosts": m.hosts,
        "accelerators": m.accelerators,
        "switches": dict(m.switches),
        "endpoints": list(m.endpoints),
        "circuit_gbps": m.circuit_gbps,
        "generation": m.generation,
        "ocs": [
            {
                "name": o.name,
                "radix": o.radix,
                "wired": o.wired,
                "circuits": [[c.port_a, c.port_b, c.a, c.b] for c in o.circuits],
            }
            for o in m.ocs
        ],
    }
