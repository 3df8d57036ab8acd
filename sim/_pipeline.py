"""A pipeline-parallel step on the simulated network: the same schedule the stage actors run
(``orchestr.roles.pipeline``), its passes timed by a :class:`~orchestr.roles.pipeline.Cost`
and its activations and gradients moved as flows between the ranks' hosts.

Each rank runs its list in order. A pass starts once the rank's previous pass has ended and
its input from another rank has arrived; when it ends, its output for another rank leaves at
once as a flow of ``item_bytes`` over :class:`~._flows.FlowNet` (``cost.latency`` before it
starts), so sends never block (the actors' unbounded links). Ranks on one host hand items
over after the latency alone. With no bytes to move this is
:func:`orchestr.roles.pipeline.run` with unbounded links (tested); on shared or slow links
the bubble grows by what the network costs, which the closed forms cannot say.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestr.fabric.optical import Topology
from orchestr.roles.pipeline import Cost, Link, Schedule, Timing, check, links

from ._engine import NS, Engine
from ._flows import FlowNet

__all__ = ["simulate_pipeline"]


def simulate_pipeline(
    schedule: Schedule,
    cost: Cost | None = None,
    *,
    topology: Topology | None = None,
    hosts: Sequence[str] | None = None,
    item_bytes: float = 0.0,
) -> Timing:
    """Run one step of ``schedule`` on virtual time and return its :class:`Timing` (seconds).

    ``hosts[r]`` is the host of rank ``r`` in ``topology`` (by default every rank on its own
    host, in the topology's order); without a topology nothing but ``cost.latency`` separates
    the ranks. Raises ``ValueError`` for a schedule :func:`check` refuses (unbounded links), a
    host list of the wrong length or an unknown host, or negative ``item_bytes``."""
    cost = Cost() if cost is None else cost
    check(schedule, capacity=None)
    if not item_bytes >= 0:
        raise ValueError(f"item_bytes must be >= 0, got {item_bytes!r}")
    engine = Engine()
    net: FlowNet | None = None
    if topology is not None:
        net = FlowNet.of_topology(engine, topology)
        names = [h.name for h in topology.hosts]
        hosts = list(hosts) if hosts is not None else names[: schedule.ranks]
        if len(hosts) != schedule.ranks:
            raise ValueError(
                f"{schedule.ranks} ranks need {schedule.ranks} hosts, got {len(hosts)}"
            )
        unknown = sorted(set(hosts) - set(names))
        if unknown:
            raise ValueError(f"hosts not in the topology: {', '.join(unknown)}")
    recv, send = links(schedule)
    ops = schedule.ops
    nxt = [0] * schedule.ranks
    busy = [False] * schedule.ranks
    arrived: set[tuple[Link, int]] = set()
    starts: list[list[float]] = [[] for _ in ops]
    ends: list[list[float]] = [[] for _ in ops]

    def try_start(rank: int) -> None:
        i = nxt[rank]
        if busy[rank] or i == len(ops[rank]):
            return
        wanted = recv.get((rank, i))
        if wanted is not None and wanted not in arrived:
            return
        busy[rank] = True
        starts[rank].append(engine.now / NS)
        engine.after(cost.of(ops[rank][i].kind), finish, rank, i, name="pass")

    def finish(rank: int, i: int) -> None:
        ends[rank].append(engine.now / NS)
        out = send.get((rank, i))
        if out is not None:
            link = out[0]
            if net is None or hosts is None or hosts[link.src] == hosts[link.dst]:
                engine.after(cost.latency, arrive, out, name="handed over")
            else:
                net.send(
                    hosts[link.src],
                    hosts[link.dst],
                    item_bytes,
                    lambda: arrive(out),
                    latency=cost.latency,
                )
        busy[rank] = False
        nxt[rank] = i + 1
        try_start(rank)

    def arrive(item: tuple[Link, int]) -> None:
        arrived.add(item)
        try_start(item[0].dst)

    for rank in range(schedule.ranks):
        engine.at(0, try_start, rank, name="rank start")
    engine.run()
    return Timing.of(schedule, cost, tuple(map(tuple, starts)), tuple(map(tuple, ends)))
