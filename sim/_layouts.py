"""A generation pool that changes its tensor-parallel degree (OrchestrRL's adaptive compute
scheduler), on virtual time: the RL job's own policy
(:func:`orchestr.roles.rl.choose_layout`) against every static degree.

One step's requests are dealt evenly over ``accelerators / d`` replicas of degree ``d``.
Each replica decodes its batch, admitting requests while their final KV fits. Each
iteration costs what :class:`~orchestr.roles.rl.LayoutCosts` says. Its two all-reduces a
layer are priced on the flow network (:func:`allreduce_fit`): the replica's devices are
hosts on one switch (an NVSwitch), and a ring all-reduce's schedule runs over its links
(:func:`~._collectives.collective_time`).

The policy sees what a controller would: the tokens each request has produced, and the
output lengths of the last step, never the true lengths. Adaptive, it is asked again each
time the requests in flight have fallen by ``check_fraction`` since it was last asked.
Between steps it is asked with the next step's queue.

A change of degree stops every replica at that moment and costs:

- ``restart_s`` (the engines built again);
- the weights a device lacks for its new share, over its link (a merge needs none: each
  device already holds its new share);
- the KV of the requests in flight moved to their new replicas (the busiest replica's
  bytes, over its link).

The requests then continue where they were, dealt over the new replicas.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Sequence
from typing import Any

from orchestr.roles.rl import LayoutCosts, LayoutView, choose_layout

from ._collectives import collective_time

__all__ = ["LayoutRun", "allreduce_fit", "pool_costs", "simulate_layouts"]


@functools.cache
def allreduce_fit(degree: int, gbps: float, alpha_s: float) -> tuple[float, float]:
    """``(seconds a round, seconds a byte)`` of a ring all-reduce among ``degree`` devices
    on one switch with ``gbps`` links, as :class:`LayoutCosts` takes them (``2 (degree - 1)``
    rounds, each moving a ``1 / degree`` share): fitted to two sizes run on the flow
    network."""
    from orchestr.fabric.optical import fat_tree

    if degree < 2:
        raise ValueError(f"an all-reduce needs 2 or more devices, got {degree}")
    topology = fat_tree(2, hosts_per_tor=degree, accelerators_per_host=1, nic_gbps=gbps)
    members = [f"p0-t0-h{i}" for i in range(degree)]
    small, large = 1 << 20, 1 << 26
    t_small = collective_time(topology, "all_reduce", members, small, alpha=alpha_s)
    t_large = collective_time(topology, "all_reduce", members, large, alpha=alpha_s)
    rounds = 2 * (degree - 1)
    per_byte = (t_large - t_small) / (large - small) / rounds * degree
    per_round = max(0.0, t_small / rounds - small / degree * per_byte)
    return per_round, per_byte


def pool_costs(
    acc: Any,
    model: Any,
    *,
    device_bytes: float,
    link_gbps: float = 3600.0,
    alpha_s: float = 5e-6,
    reshard_s: float = 2.0,
    mfu: float = 0.5,
    mbu: float = 0.8,
    scaling: float = 1.0,
) -> LayoutCosts:
    """:class:`LayoutCosts` of ``model`` (a :class:`~._profiles.ModelShape`) on ``acc``
    (an :class:`~._profiles.Accelerator`) from their published figures (the roofline of
    :func:`~._profiles.roofline` on one device), the all-reduces fitted on the flow network
    over ``link_gbps`` links with ``alpha_s`` a round, each device holding ``device_bytes``.
    ``reshard_s`` is what the policy expects a change of degree to cost; ``scaling`` is
    :attr:`LayoutCosts.scaling`."""
    from ._profiles import roofline

    one = roofline(acc, model, mfu=mfu, mbu=mbu)
    per_round, per_byte = allreduce_fit(8, link_gbps, alpha_s)
    return LayoutCosts(
        base_s=one.base_s,
        decode_s=one.decode_s,
        attention_s=one.decode_attention_s,
        layers=model.layers,
        row_bytes=model.heads * model.head_dim * model.dtype_bytes,
        allreduce_alpha_s=per_round,
        allreduce_byte_s=per_byte,
        device_bytes=device_bytes,
        weight_bytes=model.params * model.dtype_bytes,
        kv_bytes_per_token=model.kv_bytes_per_token,
        reshard_s=reshard_s,
        scaling=scaling,
    )


@dataclasses.dataclass
class LayoutRun:
    """What a pool did: seconds per step, the degree over time ``(seconds, degree)``, the
    changes and what they cost."""

    steps_s: list[float]
    samples: int
    degrees: list[tuple[float, int]]
    changes: int = 0
    change_s: float = 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / sum(self.steps_s)


class _Replica:
    """One replica's batch on the closed form of :func:`orchestr.roles.rl._layout.replica_s`,
    with true lengths: advanced to a moment, it says how far each request got."""

    def __init__(self, costs: LayoutCosts, degree: int, start: float) -> None:
        self.costs, self.degree = costs, degree
        self.capacity = costs.kv_tokens(degree)
        self.now = start
        self.waiting: list[list[float]] = []  # [context, remaining, produced], in order
        self.running: list[list[float]] = []
        self.held = 0.0

    def admit(self) -> None:
        while self.waiting and (
            not self.running or self.held + self.waiting[0][0] + self.waiting[0][1] <= self.capacity
        ):
            r = self.waiting.pop(0)
            self.held += r[0] + r[1]
            self.running.append(r)

    def next_end(self) -> float:
        """When its next request ends (``inf`` with none running)."""
        self.admit()
        if not self.running:
            return math.inf
        m = min(r[1] for r in self.running)
        return self.now + self._span(m)

    def advance(self, until: float) -> int:
        """Decode up to ``until``; returns how many requests ended."""
        ended = 0
        while True:
            self.admit()
            if not self.running:
                self.now = max(self.now, until)
                return ended
            m = min(r[1] for r in self.running)
            if self.now + self._span(m) <= until:
                self._step(m)
                for r in [r for r in self.running if r[1] <= 0]:
                    self.running.remove(r)
                    self.held -= r[0]
                    ended += 1
                continue
            # part of the way: the whole iterations that fit
            lo, hi = 0, int(m)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.now + self._span(mid) <= until:
                    lo = mid
                else:
                    hi = mid - 1
            self._step(lo)
            self.now = until
            return ended

    def unfinished(self) -> list[list[float]]:
        return self.running + self.waiting

    def _span(self, m: float) -> float:
        ctx = sum(r[0] for r in self.running)
        return self.costs.iterations_s(self.degree, len(self.running), ctx, m)

    def _step(self, m: float) -> None:
        self.now += self._span(m)
        for r in self.running:
            r[0] += m
            r[1] -= m
            r[2] += m


def simulate_layouts(
    costs: LayoutCosts,
    accelerators: int,
    steps: Sequence[Sequence[tuple[int, int]]],
    *,
    degrees: tuple[int, ...] = (1, 2, 4, 8),
    policy: int | str = "adaptive",
    history: Sequence[int] = (),
    max_tokens: int = 16384,
    check_fraction: float = 0.1,
    link_gbps: float = 3600.0,
    restart_s: float = 1.0,
) -> LayoutRun:
    """Generation of ``steps`` (each a list of ``(prompt_tokens, output_tokens)``) on a pool
    of ``accelerators`` at a static degree (``policy`` an int) or re-picking it
    (``"adaptive"``); ``history`` is the output lengths the policy knows before the first
    step, and each step's lengths replace them after it. Raises ``ValueError`` for a degree
    not among ``degrees``."""
    adaptive = policy == "adaptive"
    if not adaptive and policy not in degrees:
        raise ValueError(f"policy is 'adaptive' or one of {degrees}, got {policy!r}")
    degree = degrees[0] if adaptive else int(policy)
    run = LayoutRun([], sum(len(s) for s in steps), [(0.0, degree)])
    seen = list(history)
    clock = 0.0
    for step in steps:
        start = clock
        pending = [[float(p), float(n), 0.0] for p, n in step]  # context, left, produced
        if adaptive:
            view = LayoutView(accelerators, degree, degrees, tuple((int(p), 0) for p, _ in step),
                              tuple(seen), max_tokens, "between_steps")  # fmt: skip
            choice = choose_layout(view, costs)
            if choice.changes:
                clock += _change(
                    costs, degree, choice.degree, [], accelerators, link_gbps, restart_s, run
                )
                degree = choice.degree
                run.degrees.append((clock, degree))
        while pending:
            replicas = _deal(costs, degree, accelerators, pending, clock)
            active = len(pending)
            asked_at = active
            ends = [(rep.next_end(), i) for i, rep in enumerate(replicas)]
            heapq.heapify(ends)
            switch = None
            while ends:
                t, i = heapq.heappop(ends)
                if math.isinf(t):
                    continue
                active -= replicas[i].advance(t)
                clock = max(clock, t)
                heapq.heappush(ends, (replicas[i].next_end(), i))
                if adaptive and active and active <= (1 - check_fraction) * asked_at:
                    asked_at = active
                    for rep in replicas:
                        rep.advance(clock)
                    left = [r for rep in replicas for r in rep.unfinished()]
                    view = LayoutView(
                        accelerators, degree, degrees,
                        tuple((int(r[0] - r[2]), int(r[2])) for r in left),
                        tuple(seen), max_tokens,
                    )  # fmt: skip
                    choice = choose_layout(view, costs)
                    if choice.changes:
                        switch = (choice.degree, left)
                        break
            if switch is None:
                pending = []
                continue
            new, left = switch
            clock += _change(costs, degree, new, left, accelerators, link_gbps, restart_s, run)
            degree = new
            run.degrees.append((clock, degree))
            pending = left
        run.steps_s.append(clock - start)
        seen = [n for _, n in step]
    return run


def _deal(
    costs: LayoutCosts, degree: int, accelerators: int, pending: list[list[float]], now: float
) -> list[_Replica]:
    """``pending`` dealt evenly (by count, as a controller that does not know the lengths
    deals them) over the replicas of ``degree``. Each entry keeps its produced count."""
    replicas = [_Replica(costs, degree, now) for _ in range(accelerators // degree)]
    for i, r in enumerate(pending):
        replicas[i % len(replicas)].waiting.append(r)
    return replicas


def _change(
    costs: LayoutCosts,
    old: int,
    new: int,
    left: list[list[float]],
    accelerators: int,
    link_gbps: float,
    restart_s: float,
    run: LayoutRun,
) -> float:
    """Seconds a change of degree takes: the engines' restart, the weights a device lacks
    for its new share (none for a merge), and the KV in flight to its new replicas (dealt as
    :func:`_deal` deals them; the busiest one's, over its devices' links at once)."""
    link = link_gbps * 1e9 / 8
    weights = max(0.0, costs.weight_bytes * (1 / new - 1 / old)) / link
    kv = 0.0
    if left:
        replicas = accelerators // new
        per_replica = [0.0] * replicas
        for i, r in enumerate(left):
            per_replica[i % replicas] += r[0] * costs.kv_bytes_per_token
        kv = max(per_replica) / (link * new)
    seconds = restart_s + weights + kv
    run.changes += 1
    run.change_s += seconds
    return seconds
