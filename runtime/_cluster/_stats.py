"""A worker's counters for the head's metrics, as plain data, and their protobuf form.

A worker answers the ``Stats`` RPC with :func:`worker_stats` turned into protobuf by
:func:`to_pb`; the head turns the answers back with :func:`from_pb` and aggregates them in
:mod:`._exposition`. Nothing here is read on the call path: the counters themselves are plain
integers bumped where the work happens (``_actorhost``, ``_wire``, ``_bulk`` and
``orchestr.fabric.lowlevel.buffer_stats``), and this module only reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from orchestr._call import _wire
from orchestr.fabric.lowlevel import buffer_stats
from orchestr.protos import orchestr_pb2 as pb

__all__ = [
    "ActorStats",
    "EndpointStats",
    "TransportStats",
    "WorkerStats",
    "from_pb",
    "process_transports",
    "to_pb",
]


@dataclasses.dataclass(frozen=True)
class EndpointStats:
    endpoint: str
    calls: int  # calls the actor started running, those that raised included
    errors: int  # calls that raised, or did not fit the endpoint's signature


@dataclasses.dataclass(frozen=True)
class ActorStats:
    actor_id: str
    label: str
    queue_depth: int  # calls waiting in the mailbox
    in_flight: int  # calls running now
    endpoints: list[EndpointStats]


@dataclasses.dataclass(frozen=True)
class TransportStats:
    kind: str  # "stream", "bulk" or "buffer"
    transport: str
    bytes_sent: int
    bytes_received: int
    ops: int = 0
    fallbacks: int = 0


@dataclasses.dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    actors: list[ActorStats]
    transports: list[TransportStats]


def process_transports() -> list[TransportStats]:
    """What this process moved so far, by kind and transport.

    ``stream``: call-path frames, counted at both ends; ``bulk``: call values that went through
    shared-memory segments, both ends; ``buffer``: one-sided transfers this process started
    (``read_into`` is received, ``write_from`` sent), with the fallbacks counted under the
    transport used instead (the call path's own fallbacks count under ``tcp``).
    """
    rows = [
        TransportStats("stream", scheme, m.sent, m.received)
        for scheme, m in sorted(_wire.streams.items())
    ]
    moved = _wire.bulk
    if moved.ops:
        rows.append(TransportStats("bulk", "shm", moved.sent, moved.received, moved.ops))
    for scheme, c in sorted(buffer_stats.items()):
        rows.append(
            TransportStats(
                "buffer", scheme, c.bytes_written, c.bytes_read, c.transfers, c.fallbacks
            )
        )
    return rows


def worker_stats(worker_id: str, actors: Iterable[ActorStats]) -> WorkerStats:
    return WorkerStats(worker_id, list(actors), process_transports())


def to_pb(stats: WorkerStats) -> pb.WorkerStats:
    return pb.WorkerStats(
        worker_id=stats.worker_id,
        actors=[
            pb.ActorStats(
                actor_id=a.actor_id,
                label=a.label,
                queue_depth=a.queue_depth,
                in_flight=a.in_flight,
                endpoints=[
                    pb.EndpointStats(endpoint=e.endpoint, calls=e.calls, errors=e.errors)
                    for e in a.endpoints
                ],
            )
            for a in stats.actors
        ],
        transports=[
            pb.TransportStats(
                kind=t.kind,
                transport=t.transport,
                bytes_sent=t.bytes_sent,
                bytes_received=t.bytes_received,
                ops=t.ops,
                fallbacks=t.fallbacks,
            )
            for t in stats.transports
        ],
    )


def from_pb(msg: pb.WorkerStats) -> WorkerStats:
    return WorkerStats(
        worker_id=msg.worker_id,
        actors=[
            ActorStats(
                actor_id=a.actor_id,
                label=a.label,
                queue_depth=a.queue_depth,
                in_flight=a.in_flight,
                endpoints=[EndpointStats(e.endpoint, e.calls, e.errors) for e in a.endpoints],
            )
            for a in msg.actors
        ],
        transports=[
            TransportStats(t.kind, t.transport, t.bytes_sent, t.bytes_received, t.ops, t.fallbacks)
            for t in msg.transports
        ],
    )
