"""A worker's counters for the head's metrics, as plain data.

A worker answers the ``Stats`` RPC with :func:`worker_stats` (turned into protobuf by
:func:`orchestr._control._convert_stats.worker_stats_to_pb`); the head turns the answers back and
aggregates them in :mod:`._exposition`. Nothing here is read on the call path: the counters themselves are plain
integers bumped where the work happens (``_actorhost``, ``_wire``, ``_bulk`` and
``orchestr.fabric.lowlevel.buffer_stats``), and this module only reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from orchestr import metrics as _metrics
from orchestr._call import _wire
from orchestr.fabric.lowlevel import buffer_stats

__all__ = [
    "ActorStats",
    "EndpointStats",
    "TransportStats",
    "WorkerStats",
    "process_transports",
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
    metrics: list[_metrics.MetricSnapshot] = dataclasses.field(default_factory=list)


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
    return WorkerStats(worker_id, list(actors), process_transports(), _metrics.snapshot())
