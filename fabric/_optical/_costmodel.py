"""Predicted communication times for the fabric manager (issue: fabric manager).

Three pieces, all pure functions:

- **closed forms** for collectives of ``n`` members on links of ``bandwidth`` bytes/s, with
  ``nbytes`` (S) per member and an optional per-step latency ``alpha_s`` (the alpha-beta model);
- :func:`collective_demand`, the endpoint-to-endpoint byte matrix a collective puts on the
  fabric when its members sit under given switches;
- :func:`phase_time`, the *bottleneck-pair* model the circuit planner compares plans with.

And :class:`ReconfigCost`, what changing circuits costs. Units: bytes, seconds, bytes per second.

Closed forms (B = ``bandwidth``, a = ``alpha_s``)::

    ring all-reduce          2(n-1)/n * S/B + 2(n-1) a
    reduce-scatter           (n-1)/n * S/B + (n-1) a          (all-gather the same)
    broadcast                S/B + (n-2) c/B + (k+n-2) a      pipelined chain, chunks of c bytes,
                                                               c = min(chunk, S), k = ceil(S/c)
    all-to-all               max((n-1)/n * S/B, floor(n/2) ceil(n/2) S/(n Bbis)) + (n-1) a

The broadcast is the chain root -> ... -> last member, each hop forwarding a chunk as soon as it
has it: the last chunk leaves the root at S/B and needs n-2 more hops, each behind a full chunk,
so the time is exact for any S (not only multiples of c) and tends to S/B for c << S. All-to-all
sends S/n from every member to every other; with per-member links of B the n-1 pieces leaving a
member take (n-1)/n * S/B, and a bisection of Bbis bytes/s per direction carries
floor(n/2) ceil(n/2) S/n bytes across each way; full bisection (Bbis = n/2 * B) never binds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Literal

from orchestr.errors import ConfigError

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "CollectiveKind",
    "ReconfigCost",
    "all_gather_s",
    "all_to_all_s",
    "broadcast_s",
    "collective_demand",
    "collective_s",
    "phase_time",
    "reduce_scatter_s",
    "ring_all_reduce_s",
]

CollectiveKind = Literal["all_reduce", "all_gather", "broadcast", "all_to_all", "reduce_scatter"]
_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
DEFAULT_CHUNK_BYTES = 1 << 20
#: Per-pair capacity in bytes/s: a mapping keyed by (u, v) in either order, or a function.
Capacity = Mapping[tuple[str, str], float] | Callable[[str, str], float]
Demand = Mapping[tuple[str, str], float]


def _check(n: int, nbytes: float, bandwidth: float, alpha_s: float) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"a collective has at least one member, got n={n!r}")
    if not nbytes >= 0 or math.isinf(nbytes):
        raise ConfigError(f"bytes per member must be finite and >= 0, got {nbytes!r}")
    if not bandwidth > 0:
        raise ConfigError(f"link bandwidth must be > 0 bytes/s, got {bandwidth!r}")
    if not alpha_s >= 0:
        raise ConfigError(f"per-step latency must be >= 0 s, got {alpha_s!r}")


def ring_all_reduce_s(n: int, nbytes: float, bandwidth: float, alpha_s: float = 0.0) -> float:
    """Ring all-reduce: 2(n-1)/n * S/B + 2(n-1) alpha (reduce-scatter then all-gather)."""
    _check(n, nbytes, bandwidth, alpha_s)
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * alpha_s


def reduce_scatter_s(n: int, nbytes: float, bandwidth: float, alpha_s: float = 0.0) -> float:
    """Ring reduce-scatter of S bytes per member: (n-1)/n * S/B + (n-1) alpha."""
    _check(n, nbytes, bandwidth, alpha_s)
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * alpha_s


def all_gather_s(n: int, nbytes: float, bandwidth: float, alpha_s: float = 0.0) -> float:
    """Ring all-gather to S bytes per member: (n-1)/n * S/B + (n-1) alpha."""
    return reduce_scatter_s(n, nbytes, bandwidth, alpha_s)


def broadcast_s(
    n: int,
    nbytes: float,
    bandwidth: float,
    alpha_s: float = 0.0,
    *,
    chunk_bytes: float = DEFAULT_CHUNK_BYTES,
) -> float:
    """Pipelined chain broadcast: S/B + (n-2) c/B + (k+n-2) alpha, c = min(chunk, S)."""
    _check(n, nbytes, bandwidth, alpha_s)
    if not chunk_bytes > 0:
        raise ConfigError(f"chunk_bytes must be > 0, got {chunk_bytes!r}")
    if n == 1 or nbytes == 0:
        return 0.0
    chunk = min(chunk_bytes, nbytes)
    steps = math.ceil(nbytes / chunk) + n - 2
    return nbytes / bandwidth + (n - 2) * chunk / bandwidth + steps * alpha_s


def all_to_all_s(
    n: int,
    nbytes: float,
    bandwidth: float,
    alpha_s: float = 0.0,
    *,
    bisection: float | None = None,
) -> float:
    """All-to-all, S/n to every other member: the member links or the bisection, the slower.

    ``bisection`` is the bytes/s the fabric carries across any halving, per direction; None
    means full bisection (n/2 * B), where the member links bind.
    """
    _check(n, nbytes, bandwidth, alpha_s)
    links = (n - 1) / n * nbytes / bandwidth
    if bisection is not None:
        if not bisection > 0:
            raise ConfigError(f"bisection must be > 0 bytes/s, got {bisection!r}")
        links = max(links, (n // 2) * ((n + 1) // 2) * nbytes / n / bisection)
    return links + (n - 1) * alpha_s


def collective_s(
    kind: CollectiveKind, n: int, nbytes: float, bandwidth: float, alpha_s: float = 0.0
) -> float:
    """The closed form for ``kind`` (broadcast with the default chunk, full bisection)."""
    forms: dict[str, Callable[[int, float, float, float], float]] = {
        "all_reduce": ring_all_reduce_s,
        "all_gather": all_gather_s,
        "reduce_scatter": reduce_scatter_s,
        "broadcast": broadcast_s,
        "all_to_all": all_to_all_s,
    }
    if kind not in forms:
        raise ConfigError(f"collective kind must be one of {', '.join(_KINDS)}, got {kind!r}")
    return forms[kind](n, nbytes, bandwidth, alpha_s)


def collective_demand(
    kind: CollectiveKind, members_by_endpoint: Mapping[str, int], nbytes: float
) -> dict[tuple[str, str], float]:
    """The bytes a collective sends from endpoint to endpoint, ``{(src, dst): bytes}``.

    ``members_by_endpoint`` counts the members under each switch; its order is the ring order,
    so each switch's members are consecutive and their traffic stays local (not in the matrix).
    With m switches holding members and n members in all:

    - all_reduce: each ring edge between switches carries 2(n-1)/n * S one way;
    - reduce_scatter, all_gather: (n-1)/n * S per ring edge;
    - broadcast: a pipeline from the first member along the ring, the chain not closed: S on
      each of the m-1 edges;
    - all_to_all: every ordered pair of members S/n, so c_u * c_v * S/n from u to v.
    """
    if kind not in _KINDS:
        raise ConfigError(f"collective kind must be one of {', '.join(_KINDS)}, got {kind!r}")
    if not nbytes >= 0 or math.isinf(nbytes):
        raise ConfigError(f"bytes per member must be finite and >= 0, got {nbytes!r}")
    for endpoint, count in members_by_endpoint.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(f"member count under {endpoint!r} must be an int >= 0, got {count!r}")
    ring = [e for e, c in members_by_endpoint.items() if c > 0]
    n = sum(members_by_endpoint[e] for e in ring)
    out: dict[tuple[str, str], float] = {}
    if len(ring) < 2 or nbytes == 0:
        return out
    m = len(ring)
    if kind == "all_to_all":
        for u in ring:
            for v in ring:
                if u != v:
                    out[(u, v)] = members_by_endpoint[u] * members_by_endpoint[v] * nbytes / n
        return out
    if kind == "all_reduce":
        per_edge, edges = 2 * (n - 1) / n * nbytes, m
    elif kind in ("all_gather", "reduce_scatter"):
        per_edge, edges = (n - 1) / n * nbytes, m
    else:  # broadcast
        per_edge, edges = float(nbytes), m - 1
    for i in range(edges):
        edge = (ring[i], ring[(i + 1) % m])
        out[edge] = out.get(edge, 0.0) + per_edge
    return out


def _capacity_of(capacity: Capacity) -> Callable[[str, str], float]:
    if callable(capacity):
        return capacity
    table = capacity

    def lookup(u: str, v: str) -> float:
        got = table.get((u, v))
        return table.get((v, u), 0.0) if got is None else got

    return lookup


def phase_time(demand: Demand, capacity: Capacity) -> float:
    """Predicted seconds to move ``demand`` (bytes, directed) over per-pair ``capacity``.

    The bottleneck-pair model: every unordered pair {u, v} has its own full-duplex capacity
    (the electrical share plus its circuits), pairs move their bytes in parallel, and the phase
    ends when the slowest pair does: ``max over pairs of max(d(u,v), d(v,u)) / cap(u, v)``.
    Traffic within a switch (u == v) is local and free. A pair with bytes but no capacity takes
    forever (``inf``); no traffic takes 0. Monotone: more capacity never predicts a longer time.
    Raises ConfigError for negative or non-finite bytes, or negative capacity.
    """
    worst_bytes: dict[tuple[str, str], float] = {}
    for (u, v), nbytes in demand.items():
        if not nbytes >= 0 or math.isinf(nbytes):
            raise ConfigError(f"demand {u} -> {v} must be finite bytes >= 0, got {nbytes!r}")
        if u == v or nbytes == 0:
            continue
        key = (u, v) if u < v else (v, u)
        if nbytes > worst_bytes.get(key, 0.0):
            worst_bytes[key] = nbytes
    cap = _capacity_of(capacity)
    worst = 0.0
    for (u, v), nbytes in worst_bytes.items():
        c = cap(u, v)
        if not c >= 0:
            raise ConfigError(f"capacity of {u} <-> {v} must be >= 0 bytes/s, got {c!r}")
        if c == 0:
            return math.inf
        worst = max(worst, nbytes / c)
    return worst


@dataclasses.dataclass(frozen=True)
class ReconfigCost:
    """Seconds a reconfiguration of ``changes`` ports costs: ``fixed_s + per_change_s * changes``.

    ``fixed_s`` is the part paid once per reconfiguration (drain to the electrical path, verify,
    undrain: seconds end to end for a MEMS OCS); ``per_change_s`` what each port adds
    (programming, light-level checks). No change costs nothing.
    """

    fixed_s: float = 1.0
    per_change_s: float = 0.01

    def __post_init__(self) -> None:
        if not (self.fixed_s >= 0 and self.per_change_s >= 0):
            raise ConfigError(
                f"reconfiguration costs must be >= 0 s, got fixed_s={self.fixed_s!r}, "
                f"per_change_s={self.per_change_s!r}"
            )

    def __call__(self, changes: int) -> float:
        return 0.0 if changes <= 0 else self.fixed_s + self.per_change_s * changes
