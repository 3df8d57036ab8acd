"""The cluster's metrics as plain data, and their Prometheus text form (exposition format 0.0.4).

:func:`cluster_families` turns the head's state and the workers' ``Stats`` answers into metric
families, summing series that meet (transports over workers, restarts over a mesh's members,
and the metrics actors made with :mod:`orchestr.metrics`, over workers); :func:`render` writes
families out: ``# HELP`` and ``# TYPE`` once per family, then its samples (a histogram's as
cumulative ``_bucket`` series with ``le``, then ``_sum`` and ``_count``), label values
escaped. No I/O here: :mod:`._metrics` asks the workers and serves the text.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from typing import Literal

from orchestr._stats import WorkerStats

from ._headstate import HeadState

__all__ = [
    "CONTENT_TYPE",
    "Family",
    "ScrapeReport",
    "actor_families",
    "cluster_families",
    "render",
    "workers_to_scrape",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
#: States an actor record can be in; each gets a sample, zero or not, so the series never vanish.
ACTOR_STATES = ("starting", "alive", "restarting", "stopped", "dead")

Labels = tuple[tuple[str, str], ...]


class Family:
    """One metric family: a name, a type, a help text and its samples by label set. Adding to
    a label set that is already there sums the values (a histogram's bucket counts too)."""

    def __init__(
        self,
        name: str,
        kind: Literal["counter", "gauge", "histogram"],
        help: str,
        boundaries: Sequence[float] = (),
    ) -> None:
        if not _METRIC_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a valid Prometheus metric name")
        self.name = name
        self.kind = kind
        self.help = help
        self.boundaries = tuple(boundaries)
        self.samples: dict[Labels, float] = {}  # a histogram's: the sums
        self.buckets: dict[Labels, list[int]] = {}  # per bucket, not cumulative, +Inf last

    def add(self, value: float, **labels: str) -> None:
        key = _labels(labels)
        self.samples[key] = self.samples.get(key, 0) + value

    def add_histogram(self, counts: Sequence[int], total: float, **labels: str) -> None:
        if len(counts) != len(self.boundaries) + 1:
            raise ValueError(
                f"{self.name}: {len(counts)} bucket counts for {len(self.boundaries)} boundaries"
            )
        key = _labels(labels)
        have = self.buckets.setdefault(key, [0] * len(counts))
        for i, c in enumerate(counts):
            have[i] += c
        self.samples[key] = self.samples.get(key, 0) + total


def _labels(labels: dict[str, str]) -> Labels:
    for label in labels:
        if not _LABEL_NAME.fullmatch(label) or label.startswith("__") or label == "le":
            raise ValueError(f"{label!r} is not a valid Prometheus label name")
    return tuple(labels.items())


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def render(families: Iterable[Family]) -> str:
    """The text exposition of ``families``, in order. Raises ValueError for a name used twice."""
    lines: list[str] = []
    seen: set[str] = set()
    for family in families:
        if family.name in seen:
            raise ValueError(f"metric family {family.name!r} appears twice")
        seen.add(family.name)
        lines.append(f"# HELP {family.name} {escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        if family.kind == "histogram":
            lines += _histogram_lines(family)
            continue
        for labels, value in family.samples.items():
            lines.append(_sample(family.name, labels, value))
    return "\n".join(lines) + "\n"


def _sample(name: str, labels: Labels, value: float) -> str:
    if not labels:
        return f"{name} {format_value(value)}"
    inner = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels)
    return f"{name}{{{inner}}} {format_value(value)}"


def _histogram_lines(family: Family) -> list[str]:
    lines = []
    bounds = [format_value(b) for b in family.boundaries] + ["+Inf"]
    for labels, counts in family.buckets.items():
        running = 0
        for le, count in zip(bounds, counts, strict=True):
            running += count
            lines.append(_sample(f"{family.name}_bucket", (*labels, ("le", le)), running))
        lines.append(_sample(f"{family.name}_sum", labels, family.samples.get(labels, 0.0)))
        lines.append(_sample(f"{family.name}_count", labels, running))
    return lines


@dataclasses.dataclass(frozen=True)
class ScrapeReport:
    """How asking the workers went: this scrape's counts, and the failures since the head
    started."""

    asked: int
    answered: int
    errors_total: int


def workers_to_scrape(state: HeadState) -> list[str]:
    """The control addresses of the workers that host a live actor on a live node, each once
    (a node that missed its heartbeats would only make the scrape wait)."""
    return sorted(
        {
            a.control_address
            for a in state.actors.values()
            if a.state == "alive" and a.node_id in state.nodes and state.nodes[a.node_id].alive
        }
        - {""}
    )


def cluster_families(
    state: HeadState, answers: Sequence[WorkerStats], scrape: ScrapeReport
) -> list[Family]:
    """Every metric family of one scrape: from the workers' answers (calls, queues,
    transports) and from the head's own state (nodes, actors, restarts, resources)."""
    calls = Family(
        "orchestr_calls_total",
        "counter",
        "Calls an actor started running (those that raised included), by endpoint.",
    )
    errors = Family(
        "orchestr_call_errors_total",
        "counter",
        "Calls that raised, or did not fit the endpoint's signature, by endpoint.",
    )
    queue = Family("orchestr_queue_depth", "gauge", "Calls waiting in an actor's mailbox.")
    in_flight = Family("orchestr_calls_in_flight", "gauge", "Calls an actor is running now.")
    for worker in answers:
        for a in worker.actors:
            record = state.actors.get(a.actor_id)
            who = {
                "mesh": record.name if record else "",
                "mesh_id": record.mesh_id if record else "",
                "actor": a.label,
            }
            queue.add(a.queue_depth, **who)
            in_flight.add(a.in_flight, **who)
            for e in a.endpoints:
                calls.add(e.calls, **who, endpoint=e.endpoint)
                errors.add(e.errors, **who, endpoint=e.endpoint)
    return [
        calls,
        errors,
        queue,
        in_flight,
        *_transport_families(answers),
        *_head_families(state),
        *_scrape_families(scrape),
        *actor_families(answers),
    ]


def actor_families(answers: Sequence[WorkerStats]) -> list[Family]:
    """The metrics the workers' actors made (:mod:`orchestr.metrics`), series of the same
    name and tags summed over workers, tags in name order; a counter's name gets ``_total``
    unless it ends so. A family whose kind or boundaries differ from the
    first worker's that had it, or whose name or tags are not valid, is left out of the
    scrape rather than failing it (a worker does not get to break the endpoint)."""
    out: dict[str, Family] = {}
    for worker in answers:
        for m in worker.metrics:
            if m.kind not in ("counter", "gauge", "histogram") or m.name.startswith("orchestr_"):
                continue
            family = out.get(m.name)
            try:
                if family is None:
                    name = m.name
                    if m.kind == "counter" and not name.endswith("_total"):
                        name += "_total"  # as prometheus_client writes counters
                    family = Family(name, m.kind, m.description, m.boundaries)
                if (family.kind, family.boundaries) != (m.kind, tuple(m.boundaries)):
                    continue
                for tags, value, counts in m.series:
                    labels = dict(sorted(tags.items()))  # a protobuf map keeps no order
                    if m.kind == "histogram":
                        family.add_histogram(counts, value, **labels)
                    else:
                        family.add(value, **labels)
            except ValueError:
                continue
            out.setdefault(m.name, family)
    return list(out.values())


def _transport_families(answers: Sequence[WorkerStats]) -> list[Family]:
    moved = Family(
        "orchestr_transport_bytes_total",
        "counter",
        "Bytes the workers moved, by kind (stream: call frames; bulk: call values through "
        "shared memory; buffer: one-sided transfers), transport and direction as each worker "
        "saw it.",
    )
    ops = Family(
        "orchestr_transport_ops_total",
        "counter",
        "Values (bulk) and transfers (buffer) the workers moved, by kind and transport.",
    )
    fallbacks = Family(
        "orchestr_transport_fallbacks_total",
        "counter",
        "Times a worker used this transport because the one wanted could not be used.",
    )
    for worker in answers:
        for t in worker.transports:
            moved.add(t.bytes_sent, kind=t.kind, transport=t.transport, direction="sent")
            moved.add(t.bytes_received, kind=t.kind, transport=t.transport, direction="received")
            if t.kind != "stream":
                ops.add(t.ops, kind=t.kind, transport=t.transport)
            if t.fallbacks:
                fallbacks.add(t.fallbacks, transport=t.transport)
    return [moved, ops, fallbacks]


def _head_families(state: HeadState) -> list[Family]:
    nodes = Family("orchestr_nodes", "gauge", "Nodes the head knows, by state.")
    alive = sum(n.alive for n in state.nodes.values())
    nodes.add(alive, state="alive")
    nodes.add(len(state.nodes) - alive, state="dead")
    actors = Family("orchestr_actors", "gauge", "Actors the head knows, by state.")
    for s in ACTOR_STATES:
        actors.add(0, state=s)
    restarts = Family(
        "orchestr_actor_restarts_total", "counter", "Times a mesh's members were re-created."
    )
    for a in state.actors.values():
        actors.add(1, state=a.state)
        restarts.add(a.restarts, mesh=a.name, mesh_id=a.mesh_id)
    free = Family("orchestr_node_resources_free", "gauge", "Resources not reserved on a live node.")
    capacity = Family(
        "orchestr_node_resources_capacity", "gauge", "Resources a live node offers in all."
    )
    for n in state.nodes.values():
        if n.alive:
            for resource, amount in sorted(n.free.items()):
                free.add(amount, node=n.node_id, resource=resource)
            for resource, amount in sorted(n.total.items()):
                capacity.add(amount, node=n.node_id, resource=resource)
    return [nodes, actors, restarts, free, capacity]


def _scrape_families(scrape: ScrapeReport) -> list[Family]:
    workers = Family(
        "orchestr_scrape_workers", "gauge", "Workers asked for their counters in this scrape."
    )
    workers.add(scrape.answered, result="answered")
    workers.add(scrape.asked - scrape.answered, result="failed")
    errors = Family(
        "orchestr_scrape_errors_total",
        "counter",
        "Workers that did not answer a scrape in time, since the head started (their "
        "counters are missing from that scrape).",
    )
    errors.add(scrape.errors_total)
    return [workers, errors]
