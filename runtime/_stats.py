"""A worker's counters for the head's metrics, as plain data.

A worker answers the ``Stats`` RPC with these records (turned into protobuf by
:func:`orchestr._control._convert_stats.worker_stats_to_pb`); the head turns the answers back
and aggregates them in :mod:`orchestr._cluster._exposition`. Nothing here is read on the call
path: the counters themselves are plain integers bumped where the work happens
(``_actor._host``, ``_call._wire``, ``_call._bulk`` and
``orchestr.fabric.lowlevel.buffer_stats``), and the worker reads them into these records
(:func:`orchestr._cluster._worker.worker_stats`). This module sits below every importer: it
needs only :mod:`orchestr.metrics`.
"""

from __future__ import annotations

import dataclasses

from orchestr import metrics as _metrics

__all__ = [
    "ActorStats",
    "EndpointStats",
    "TransportStats",
    "WorkerStats",
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
