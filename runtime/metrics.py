"""Metrics an actor exports through the head's ``GET /metrics``: :class:`Counter`,
:class:`Gauge` and :class:`Histogram`, with the constructor and methods Ray's
``ray.util.metrics`` users know (``name``, ``description``, ``tag_keys``; ``inc``, ``set``,
``observe`` with ``tags``).

A metric lives in its process's registry from the moment it is made; each scrape of the head
asks every worker for what its registry holds, and the head renders the series of all workers
together (series with the same name and tags sum, as counters and histograms should; give
gauges a tag that tells their actors apart). Making a metric again with the same name, kind,
tag keys and boundaries returns a handle on the same series; with any of them different it
is a ``ValueError``. Names follow Prometheus's rules (colons allowed, as in
``vllm:num_preemptions``); ``orchestr_`` is the runtime's own prefix and is refused. A
counter is exposed with ``_total`` appended unless its name ends so, as ``prometheus_client``
writes counters; a histogram as ``_bucket`` (cumulative, with ``le``), ``_sum`` and ``_count``.

Recording costs a dict lookup and, for a histogram, a binary search over its boundaries; no
I/O and no lock (an actor's endpoints run on one event loop).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

__all__ = ["Counter", "Gauge", "Histogram", "MetricSnapshot", "snapshot"]

Kind = Literal["counter", "gauge", "histogram"]
Tags = tuple[tuple[str, str], ...]

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_TAG = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


@dataclasses.dataclass
class _Series:
    value: float = 0.0  # a counter's or gauge's value; a histogram's sum
    counts: list[int] = dataclasses.field(default_factory=list)  # per bucket, +Inf last


@dataclasses.dataclass
class _Family:
    name: str
    kind: Kind
    description: str
    tag_keys: tuple[str, ...]
    boundaries: tuple[float, ...]
    series: dict[Tags, _Series] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class MetricSnapshot:
    """One metric's series as they stand: by tags, the value (a histogram's sum) and, for a
    histogram, the count in each bucket (not cumulative; the last is above every boundary)."""

    name: str
    kind: Kind
    description: str
    boundaries: tuple[float, ...]
    series: list[tuple[dict[str, str], float, list[int]]]


_registry: dict[str, _Family] = {}


def snapshot() -> list[MetricSnapshot]:
    """Every metric this process made, as plain data (what a worker tells the head)."""
    return [
        MetricSnapshot(
            f.name,
            f.kind,
            f.description,
            f.boundaries,
            [(dict(tags), s.value, list(s.counts)) for tags, s in f.series.items()],
        )
        for f in _registry.values()
    ]


class _Metric:
    @property
    def _kind(self) -> Kind:
        """Which kind of metric; each kind's class names its own."""
        raise NotImplementedError

    def __init__(
        self,
        name: str,
        description: str = "",
        tag_keys: Sequence[str] = (),
        *,
        _boundaries: tuple[float, ...] = (),
    ) -> None:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a valid metric name ([a-zA-Z_:][a-zA-Z0-9_:]*)")
        if name.startswith("orchestr_"):
            raise ValueError(f"{name!r}: the orchestr_ prefix is the runtime's own metrics'")
        if isinstance(tag_keys, str):
            raise ValueError(f"tag_keys must be a sequence of names, got the string {tag_keys!r}")
        keys = tuple(tag_keys)
        for key in keys:
            if not isinstance(key, str) or not _TAG.fullmatch(key) or key.startswith("__"):
                raise ValueError(f"{key!r} is not a valid tag key")
        if len(set(keys)) != len(keys):
            raise ValueError(f"tag_keys {keys} name a key twice")
        family = _registry.get(name)
        if family is None:
            family = _registry[name] = _Family(name, self._kind, description, keys, _boundaries)
        elif (family.kind, family.tag_keys, family.boundaries) != (self._kind, keys, _boundaries):
            raise ValueError(
                f"metric {name!r} exists already as a {family.kind} with tag keys "
                f"{family.tag_keys}"
                + (f" and boundaries {family.boundaries}" if family.boundaries else "")
            )
        self._family = family

    @property
    def name(self) -> str:
        return self._family.name

    def _series(self, tags: Mapping[str, str] | None) -> _Series:
        keys = self._family.tag_keys
        given = tags or {}
        if set(given) != set(keys):
            raise ValueError(
                f"metric {self._family.name!r} takes tags {sorted(keys)}, got {sorted(given)}"
            )
        key = tuple((k, str(given[k])) for k in keys)
        series = self._family.series.get(key)
        if series is None:
            series = self._family.series[key] = _Series(
                counts=[0] * (len(self._family.boundaries) + 1) if self._kind == "histogram" else []
            )
        return series


class Counter(_Metric):
    """A value that only goes up (requests served, tokens generated)."""

    _kind = "counter"

    def inc(self, value: float = 1.0, tags: Mapping[str, str] | None = None) -> None:
        """Add ``value`` (>= 0) to the series of ``tags``; raises ``ValueError`` for a
        negative value or tags other than the metric's tag keys."""
        if not value >= 0:
            raise ValueError(f"a counter only goes up; got {value!r}")
        self._series(tags).value += value


class Gauge(_Metric):
    """A value that goes up and down (requests waiting, the fraction of a cache in use)."""

    _kind = "gauge"

    def set(self, value: float, tags: Mapping[str, str] | None = None) -> None:
        """Make ``value`` the series' value."""
        self._series(tags).value = float(value)


class Histogram(_Metric):
    """A distribution (latencies): counts of observations at or below each of
    ``boundaries`` (strictly increasing, finite), their sum and their count."""

    _kind = "histogram"

    def __init__(
        self,
        name: str,
        description: str = "",
        boundaries: Iterable[float] = (),
        tag_keys: Sequence[str] = (),
    ) -> None:
        bounds = tuple(float(b) for b in boundaries)
        if not bounds or any(not math.isfinite(b) for b in bounds):
            raise ValueError(f"a histogram needs finite boundaries, got {bounds!r}")
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"boundaries must increase strictly, got {bounds!r}")
        super().__init__(name, description, tag_keys, _boundaries=bounds)

    def observe(self, value: float, tags: Mapping[str, str] | None = None) -> None:
        """Count ``value`` (a finite number) in its bucket."""
        if not math.isfinite(value):
            raise ValueError(f"a histogram observes finite values, got {value!r}")
        series = self._series(tags)
        series.counts[bisect.bisect_left(self._family.boundaries, value)] += 1
        series.value += value
