"""A worker's ``Stats`` answer (:mod:`orchestr._stats`) to and from protobuf, for the
head's metrics scrape: the edge where those plain counters meet the wire."""

from __future__ import annotations

from orchestr._stats import ActorStats, EndpointStats, TransportStats, WorkerStats
from orchestr.metrics import MetricSnapshot
from orchestr.protos import orchestr_pb2 as pb

__all__ = ["worker_stats_from_pb", "worker_stats_to_pb"]


def worker_stats_to_pb(stats: WorkerStats) -> pb.WorkerStats:
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
        metrics=[
            pb.MetricFamily(
                name=m.name,
                kind=m.kind,
                description=m.description,
                boundaries=m.boundaries,
                series=[
                    pb.MetricSeries(tags=tags, value=value, bucket_counts=counts)
                    for tags, value, counts in m.series
                ],
            )
            for m in stats.metrics
        ],
    )


def worker_stats_from_pb(msg: pb.WorkerStats) -> WorkerStats:
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
        metrics=[
            MetricSnapshot(
                m.name,
                m.kind,  # checked where it is rendered
                m.description,
                tuple(m.boundaries),
                [(dict(x.tags), x.value, list(x.bucket_counts)) for x in m.series],
            )
            for m in msg.metrics
        ],
    )
