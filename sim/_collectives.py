"""Collectives as flows: what a training all-reduce or a weight broadcast puts on the network,
moved by :class:`~._flows.FlowNet` rather than predicted by a formula.

Each collective is the schedule its closed form (``orchestr.fabric.optical``'s cost model)
describes, run as flows between the members' hosts, with ``alpha`` seconds of latency before
each flow starts:

- ring all-reduce: ``2(n-1)`` rounds, reduce-scatter and all-gather ``n-1``: in each round
  every member sends ``S/n`` to the next; a round ends when its last flow does;
- broadcast: a pipelined chain root -> ... -> last in chunks of ``chunk`` bytes; a chunk
  leaves a member once it has arrived there and the member's previous chunk has left;
- all-to-all: every member sends ``S/n`` to every other at once (one round, so ``alpha`` is
  paid once; the closed form charges ``(n-1) alpha``, a pairwise schedule's).

On links nothing else crosses these give the closed forms (tested); where flows share links
they give what max-min sharing does, which the formulas cannot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from orchestr.fabric.optical import Topology

from ._engine import NS, Engine
from ._flows import FlowNet

__all__ = ["KINDS", "collective", "collective_time"]

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
DEFAULT_CHUNK_BYTES = 1 << 20


def collective(
    net: FlowNet,
    kind: str,
    members: Sequence[str],
    nbytes: float,
    done: Callable[[], None],
    *,
    alpha: float = 0.0,
    chunk: float = DEFAULT_CHUNK_BYTES,
) -> None:
    """Start collective ``kind`` of ``nbytes`` per member over the hosts ``members`` (in ring
    or chain order) on ``net``; ``done()`` when it completes. Raises ``ValueError`` for an
    unknown kind, no members, or a negative size, latency or chunk."""
    if kind not in KINDS:
        raise ValueError(f"a collective is one of {', '.join(KINDS)}, got {kind!r}")
    if not members or not nbytes >= 0 or not alpha >= 0 or not chunk > 0:
        raise ValueError("a collective has members, bytes >= 0, alpha >= 0 and chunk > 0")
    n = len(members)
    if n == 1 or nbytes == 0:
        net.engine.at(net.engine.now, done, name="collective done")
        return
    if kind == "broadcast":
        _broadcast(net, members, nbytes, done, alpha, min(chunk, nbytes))
    elif kind == "all_to_all":
        pairs = [(a, b) for a in members for b in members if a != b]
        _together(net, pairs, nbytes / n, done, alpha)
    else:
        rounds = 2 * (n - 1) if kind == "all_reduce" else n - 1
        _rounds(net, members, nbytes / n, rounds, done, alpha)


def _together(
    net: FlowNet,
    pairs: Sequence[tuple[str, str]],
    nbytes: float,
    done: Callable[[], None],
    alpha: float,
) -> None:
    left = [len(pairs)]

    def one() -> None:
        left[0] -= 1
        if not left[0]:
            done()

    for src, dst in pairs:
        net.send(src, dst, nbytes, one, latency=alpha)


def _rounds(
    net: FlowNet,
    members: Sequence[str],
    piece: float,
    rounds: int,
    done: Callable[[], None],
    alpha: float,
) -> None:
    ring = [(members[i], members[(i + 1) % len(members)]) for i in range(len(members))]

    def round_(r: int) -> None:
        if r == rounds:
            done()
            return
        _together(net, ring, piece, lambda: round_(r + 1), alpha)

    round_(0)


def _broadcast(
    net: FlowNet,
    members: Sequence[str],
    nbytes: float,
    done: Callable[[], None],
    alpha: float,
    chunk: float,
) -> None:
    hops = len(members) - 1
    chunks = math.ceil(nbytes / chunk)
    sizes = [chunk] * (chunks - 1) + [nbytes - chunk * (chunks - 1)]
    arrived = [[False] * chunks for _ in range(hops)]  # arrived[h][j]: chunk j crossed hop h
    busy = [False] * hops  # hop h is carrying a chunk
    sent = [0] * hops  # next chunk hop h sends
    left = [chunks]  # chunks still to reach the last member

    def try_send(h: int) -> None:
        j = sent[h]
        if busy[h] or j == chunks or (h > 0 and not arrived[h - 1][j]):
            return
        busy[h], sent[h] = True, j + 1
        net.send(members[h], members[h + 1], sizes[j], lambda: crossed(h, j), latency=alpha)

    def crossed(h: int, j: int) -> None:
        arrived[h][j], busy[h] = True, False
        if h + 1 < hops:
            try_send(h + 1)
        else:
            left[0] -= 1
            if not left[0]:
                done()
        try_send(h)

    try_send(0)


def collective_time(
    topology: Topology,
    kind: str,
    members: Sequence[str],
    nbytes: float,
    *,
    alpha: float = 0.0,
    chunk: float = DEFAULT_CHUNK_BYTES,
    ecmp: bool = True,
) -> float:
    """Seconds collective ``kind`` takes alone on ``topology``'s links (an engine and a
    :class:`FlowNet` of its own, routing with ``ecmp`` or not)."""
    engine = Engine()
    net = FlowNet.of_topology(engine, topology, ecmp=ecmp)
    finished: list[int] = []
    collective(
        net, kind, members, nbytes, lambda: finished.append(engine.now), alpha=alpha, chunk=chunk
    )
    engine.run()
    if not finished:
        raise RuntimeError(f"the {kind} never finished")  # a bug in the schedule
    return finished[0] / NS
