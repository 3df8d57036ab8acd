"""What the dashboard's pages show, as plain data built from the head's records, the metric
families of a scrape and the jobs' event logs; the templates only lay it out.

- :func:`nodes_view`, :func:`meshes_view`: the head's nodes and actors.
- :func:`serving_view`: per generator (the ``engine`` tag of vLLM's metric names), from two
  scrapes a few seconds apart: requests and tokens per second over that window, TTFT and TPOT
  percentiles of the requests in it (all requests so far before a second scrape), KV cache use
  and the prefix cache's hit rate so far.
- :func:`timeline`: a job's phases as bars on tracks, and its marks (deaths, restarts,
  errors), laid out on a 1000-wide axis.
- :func:`curve`: a series as an SVG polyline's points.
- :func:`histogram_quantile`: a quantile from bucket counts, interpolated in the bucket as
  Prometheus's ``histogram_quantile`` does.

No I/O here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .._exposition import Family
from .._headstate import HeadState
from .._headstore import MeshRecord
from ._tail import Mark, Span

__all__ = [
    "Scrape",
    "curve",
    "histogram_quantile",
    "meshes_view",
    "nodes_view",
    "serving_view",
    "timeline",
]

#: Characters of an actor's last output shown.
LAST_ERROR_CHARS = 2000
#: Width of the timeline's axis and the curves' view box.
AXIS = 1000.0


@dataclasses.dataclass(frozen=True)
class Scrape:
    """One scrape's families by name, and when it was taken (monotonic seconds)."""

    at: float
    families: Mapping[str, Family]

    @classmethod
    def of(cls, at: float, families: Iterable[Family]) -> Scrape:
        return cls(at, {f.name: f for f in families})


# -- the head's records ----------------------------------------------------------------------
def nodes_view(state: HeadState, now: float) -> list[dict[str, Any]]:
    """Each node: its id, address, whether alive, seconds since its last heartbeat, its
    resources (free of total, by name), workers, labels, transports and devices."""
    out = []
    for n in sorted(state.nodes.values(), key=lambda n: n.node_id):
        out.append(
            {
                "id": n.node_id,
                "address": n.address,
                "alive": n.alive,
                "heartbeat_s": max(0.0, now - n.last_heartbeat),
                "resources": [
                    (name, n.free.get(name, 0.0), total) for name, total in sorted(n.total.items())
                ],
                "workers": n.workers,
                "labels": sorted(n.labels.items()),
                "transports": list(n.transports),
                "devices": list(n.devices),
            }
        )
    return out


def meshes_view(state: HeadState, meshes: Mapping[str, MeshRecord]) -> list[dict[str, Any]]:
    """Each mesh the head knows (newest first), with its members: rank, state, restarts of
    the most allowed, node, pid, and the last output of one that died (its error)."""
    members: dict[str, list[dict[str, Any]]] = {}
    for a in state.actors.values():
        members.setdefault(a.mesh_id, []).append(
            {
                "id": a.actor_id,
                "rank": a.rank,
                "state": a.state,
                "restarts": a.restarts,
                "max_restarts": a.max_restarts,
                "node": a.node_id,
                "pid": a.pid,
                "exit": _exit(a.exit_code, a.signal) if a.state in ("dead", "restarting") else "",
                "error": a.last_output[-LAST_ERROR_CHARS:],
            }
        )
    out = []
    for mesh_id, ms in members.items():
        record = meshes.get(mesh_id)
        actor = state.actors[ms[0]["id"]]  # its name and class are the mesh's
        ended = all(m["state"] in ("stopped", "dead") for m in ms)
        out.append(
            {
                "id": mesh_id,
                "name": actor.name,
                "class_path": actor.class_path,
                "created": record.created_unix if record else 0.0,
                "stopped": record.stopped if record else ended,
                "restarts": sum(m["restarts"] for m in ms),
                "members": sorted(ms, key=lambda m: m["rank"]),
            }
        )
    out.sort(key=lambda m: (m["stopped"], -m["created"], m["name"]))
    return out


def _exit(code: int, signal: int) -> str:
    return f"signal {signal}" if signal else f"exit code {code}"


# -- serving ---------------------------------------------------------------------------------
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
TOKENS = "vllm:generation_tokens_total"
USAGE = "vllm:kv_cache_usage_perc"
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"


def serving_view(now: Scrape, before: Scrape | None) -> list[dict[str, Any]]:
    """Per generator (``engine`` tag), sorted by name: ``rps`` and ``tokens_s`` over the
    window since ``before`` (``None`` without it), ``ttft_p50/p95`` and ``tpot_p50/p95`` in
    seconds over the window (over everything so far without ``before``; ``None`` with no
    request), ``kv_usage`` (0 to 1), ``prefix_hit`` (0 to 1, ``None`` before any lookup),
    ``running`` and ``waiting``."""
    engines: set[str] = set()
    for name in (TTFT, TOKENS, USAGE, RUNNING):
        family = now.families.get(name)
        if family is not None:
            engines |= {dict(labels).get("engine", "") for labels in family.samples}
    dt = now.at - before.at if before is not None else 0.0
    out = []
    for engine in sorted(engines - {""}):
        row: dict[str, Any] = {"engine": engine}
        ttft_now, ttft_then = _counts(now, TTFT, engine), _counts(before, TTFT, engine)
        itl_now, itl_then = _counts(now, ITL, engine), _counts(before, ITL, engine)
        requests = _window(ttft_now, ttft_then)
        tokens = _window(itl_now, itl_then)
        row["rps"] = sum(requests) / dt if before is not None and dt > 0 else None
        toks_now = _value(now, TOKENS, engine)
        toks_then = _value(before, TOKENS, engine)
        row["tokens_s"] = (
            (toks_now - toks_then) / dt if before is not None and dt > 0 and toks_now else None
        )
        bounds = _bounds(now, TTFT)
        row["ttft_p50"] = histogram_quantile(bounds, requests, 0.5)
        row["ttft_p95"] = histogram_quantile(bounds, requests, 0.95)
        bounds = _bounds(now, ITL)
        row["tpot_p50"] = histogram_quantile(bounds, tokens, 0.5)
        row["tpot_p95"] = histogram_quantile(bounds, tokens, 0.95)
        row["kv_usage"] = _value(now, USAGE, engine)
        queries = _value(now, QUERIES, engine)
        row["prefix_hit"] = _value(now, HITS, engine) / queries if queries else None
        row["running"] = int(_value(now, RUNNING, engine))
        row["waiting"] = int(_value(now, WAITING, engine))
        out.append(row)
    return out


def _series(scrape: Scrape | None, name: str, engine: str) -> list[tuple[str, str]] | None:
    """The label set of ``name``'s series for ``engine``, if the scrape has one."""
    if scrape is None or name not in scrape.families:
        return None
    for labels in scrape.families[name].samples:
        if dict(labels).get("engine") == engine:
            return list(labels)
    return None


def _value(scrape: Scrape | None, name: str, engine: str) -> float:
    labels = _series(scrape, name, engine)
    if scrape is None or labels is None:
        return 0.0
    return float(scrape.families[name].samples[tuple(labels)])


def _counts(scrape: Scrape | None, name: str, engine: str) -> list[int]:
    labels = _series(scrape, name, engine)
    if scrape is None or labels is None:
        return []
    return list(scrape.families[name].buckets.get(tuple(labels), []))


def _bounds(scrape: Scrape, name: str) -> tuple[float, ...]:
    family = scrape.families.get(name)
    return family.boundaries if family is not None else ()


def _window(now: Sequence[int], then: Sequence[int]) -> list[int]:
    """Bucket counts since ``then``; all of ``now`` when ``then`` is missing or from before a
    restart (a count went down)."""
    if len(then) != len(now) or any(b > a for a, b in zip(now, then, strict=True)):
        return list(now)
    return [a - b for a, b in zip(now, then, strict=True)]


def histogram_quantile(
    boundaries: Sequence[float], counts: Sequence[int], q: float
) -> float | None:
    """The ``q`` quantile (0 to 1) of observations in buckets with upper ``boundaries``
    (``counts`` per bucket, not cumulative, one more than the boundaries: the last above them
    all), interpolated linearly inside its bucket from 0 or the bucket below. ``None`` with no
    observation; the highest boundary when the quantile lies above it."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"a quantile is in [0, 1], got {q}")
    total = sum(counts)
    if total <= 0 or len(counts) != len(boundaries) + 1:
        return None
    rank = q * total
    running = 0
    for i, count in enumerate(counts):
        if running + count >= rank and count > 0:
            if i == len(boundaries):
                return float(boundaries[-1]) if boundaries else None
            lower = boundaries[i - 1] if i else 0.0
            return lower + (boundaries[i] - lower) * (rank - running) / count
        running += count
    return float(boundaries[-1]) if boundaries else None


# -- jobs ------------------------------------------------------------------------------------
def timeline(
    spans: Iterable[Span], marks: Iterable[Mark], start: float, end: float
) -> dict[str, Any]:
    """Bars and marks on a :data:`AXIS`-wide axis from ``start`` to ``end`` (unix seconds):
    ``tracks`` (names, in the order they first appear), ``bars`` (track index, x, width,
    name, seconds, error) and ``marks`` (x, kind, text), and ``seconds`` the axis spans."""
    span = max(end - start, 1e-3)
    tracks: list[str] = []
    bars = []
    for s in spans:
        if s.track not in tracks:
            tracks.append(s.track)
        x = _x(s.start, start, span)
        width = max(_x(s.start + s.dur, start, span) - x, 1.0)
        bars.append(
            {
                "track": tracks.index(s.track),
                "x": x,
                "width": width,
                "name": s.name,
                "seconds": s.dur,
                "error": s.error,
            }
        )
    points = [{"x": _x(m.at, start, span), "kind": m.kind, "text": m.text} for m in marks]
    return {"tracks": tracks, "bars": bars, "marks": points, "seconds": span}


def _x(t: float, start: float, span: float) -> float:
    return round(min(max((t - start) / span, 0.0), 1.0) * AXIS, 1)


def curve(values: Sequence[float | None], height: float = 100.0) -> dict[str, Any]:
    """An SVG polyline's ``points`` for ``values`` (``None`` and non-finite ones skipped)
    across :data:`AXIS` and ``height`` (high values up), with ``low``, ``high`` and ``last``."""
    kept = [(i, v) for i, v in enumerate(values) if v is not None and math.isfinite(v)]
    if not kept:
        return {"points": "", "low": None, "high": None, "last": None}
    low = min(v for _, v in kept)
    high = max(v for _, v in kept)
    spread = high - low or 1.0
    last_index = max(len(values) - 1, 1)
    points = " ".join(
        f"{AXIS * i / last_index:.1f},{height - (v - low) / spread * height:.1f}" for i, v in kept
    )
    return {"points": points, "low": low, "high": high, "last": kept[-1][1]}
