"""Where each MoE layer's experts live: replica counts and their slots on expert hosts.

A *logical* expert is one of a layer's routed experts; a *physical* expert is one slot on one
host holding a replica of a logical expert. ``num_replicas`` physical slots per layer are split
evenly over ``num_hosts`` hosts (host ``h`` holds slots ``h*k .. h*k+k-1``), and the hosts over
``num_nodes`` nodes the same way. Tokens routed to a logical expert are split evenly over its
replicas, so a host's load is the sum of ``load[e] / replicas[e]`` over its slots.

Two modes:

- ``"eplb"`` is DeepSeek's expert-parallel load balancer, written from its description. When
  the expert groups divide evenly over nodes it is hierarchical: (1) pack the groups onto nodes,
  heaviest group first into the lightest node with room, so a group's experts (which a
  group-limited router sends a token to together) stay on one node; (2) inside each node, give
  each extra replica to the expert whose load per replica is highest; (3) pack the node's
  replicas onto its hosts the same heaviest-first way. Otherwise it does (2) and (3) once over
  all experts and hosts. It places from scratch, so a small change of load can move most
  experts.
- ``"stable"`` is ours: it balances as well but starts from the current placement and moves as
  few experts as it can. Replica counts come from step (2) over all experts; each host then
  keeps every replica it already holds that the new counts still want; the replicas still
  wanting a slot go, heaviest first, to the lightest host with a free slot; then, while the
  most loaded host carries more than ``1 + tolerance`` times what ``eplb``'s most loaded host
  would, the one swap of a replica on it with a replica on another host that lowers their
  larger load the most is made (each swap loads at most two experts), until no swap helps. So
  it is about as balanced as ``eplb`` and stops there; a layer whose current placement already
  is stays as it is. It balances hosts, not nodes.

:func:`experts_moved` counts replicas a host must load that it did not hold before; moving a
slot inside one host costs nothing. No I/O here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MODES", "Placement", "balancedness", "experts_moved", "host_loads", "rebalance"]

MODES = ("eplb", "stable")


@dataclass(frozen=True)
class Placement:
    """One placement of every MoE layer's experts (lists indexed ``[layer]``).

    ``phy_to_log[l][p]`` is the logical expert physical slot ``p`` holds; ``log_to_phy[l][e]``
    the slots holding expert ``e`` (ascending, by replica rank ``phy_rank``); ``replicas[l][e]``
    their number; ``num_hosts`` the hosts the slots are split over."""

    phy_to_log: list[list[int]]
    log_to_phy: list[list[list[int]]]
    replicas: list[list[int]]
    num_hosts: int

    @property
    def slots_per_host(self) -> int:
        return len(self.phy_to_log[0]) // self.num_hosts

    def host_of(self, slot: int) -> int:
        return slot // self.slots_per_host

    def experts_on(self, layer: int, host: int) -> list[int]:
        """The logical experts host ``host`` holds for ``layer`` (one entry per replica)."""
        k = self.slots_per_host
        return self.phy_to_log[layer][host * k : (host + 1) * k]


def rebalance(
    load: Sequence[Sequence[float]],
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_hosts: int,
    *,
    mode: str = "eplb",
    current: Placement | None = None,
    tolerance: float = 0.02,
) -> Placement:
    """A placement of ``num_replicas`` replicas per layer for ``load[layer][expert]`` (tokens
    routed to each logical expert) over ``num_hosts`` hosts on ``num_nodes`` nodes.

    ``mode="stable"`` needs ``current`` (the placement now serving; without it, it starts from
    ``eplb``'s). Raises ``ValueError`` for shapes that do not divide: replicas over hosts, hosts
    over nodes, experts over groups, fewer replicas than experts, a negative load."""
    _check(load, num_replicas, num_groups, num_nodes, num_hosts, mode)
    if mode == "eplb" or current is None:
        placed = [_eplb_layer(row, num_replicas, num_groups, num_nodes, num_hosts) for row in load]
        if mode == "eplb":
            return _finish(placed, len(load[0]), num_hosts)
        current = _finish(placed, len(load[0]), num_hosts)
    if len(current.phy_to_log) != len(load) or len(current.phy_to_log[0]) != num_replicas:
        raise ValueError(
            f"the current placement has {len(current.phy_to_log)} layers of "
            f"{len(current.phy_to_log[0])} slots; the load asks for {len(load)} of {num_replicas}"
        )
    placed = []
    for i, row in enumerate(load):
        reference = _eplb_layer(row, num_replicas, num_groups, num_nodes, num_hosts)
        peak = max(host_loads(_finish([reference], len(row), num_hosts), [row])[0])
        now = current.phy_to_log[i]
        if max(host_loads(_finish([now], len(row), num_hosts), [row])[0]) <= peak * (1 + tolerance):
            placed.append(list(now))  # already as balanced as eplb would make it: keep it
        else:
            placed.append(_stable_layer(row, now, num_hosts, peak * (1 + tolerance)))
    return _finish(placed, len(load[0]), num_hosts)


def host_loads(placement: Placement, load: Sequence[Sequence[float]]) -> list[list[float]]:
    """Tokens each host receives per layer under ``placement``: ``[layer][host]``."""
    out = []
    for layer, row in enumerate(load):
        counts = placement.replicas[layer]
        hosts = [0.0] * placement.num_hosts
        for slot, e in enumerate(placement.phy_to_log[layer]):
            hosts[placement.host_of(slot)] += row[e] / counts[e]
        out.append(hosts)
    return out


def balancedness(placement: Placement, load: Sequence[Sequence[float]]) -> float:
    """Mean over max tokens per host, summed over layers (1.0 is perfectly balanced; a layer
    with no load counts as balanced)."""
    per_layer = host_loads(placement, load)
    mean = sum(sum(hosts) / len(hosts) for hosts in per_layer)
    peak = sum(max(hosts) for hosts in per_layer)
    return 1.0 if peak == 0 else mean / peak


def experts_moved(old: Placement, new: Placement) -> int:
    """Replicas, over all layers and hosts, that ``new`` puts on a host that did not hold
    that expert (as many times) under ``old``: the experts that must be loaded."""
    if old.num_hosts != new.num_hosts or len(old.phy_to_log) != len(new.phy_to_log):
        raise ValueError("the two placements have different hosts or layers")
    moved = 0
    for layer in range(len(new.phy_to_log)):
        for host in range(new.num_hosts):
            wanted = Counter(new.experts_on(layer, host))
            wanted.subtract(Counter(old.experts_on(layer, host)))
            moved += sum(n for n in wanted.values() if n > 0)
    return moved


# -- eplb ------------------------------------------------------------------------------------
def _pack(weights: Sequence[float], packs: int) -> list[tuple[int, int]]:
    """Items into ``packs`` equal-sized packs, heaviest first into the lightest pack with room
    (the lowest-numbered on a tie): each item's ``(pack, rank in pack)``."""
    per_pack = len(weights) // packs
    out = [(0, 0)] * len(weights)
    totals, sizes = [0.0] * packs, [0] * packs
    for item in sorted(range(len(weights)), key=lambda i: -weights[i]):
        pack = min((p for p in range(packs) if sizes[p] < per_pack), key=totals.__getitem__)
        out[item] = (pack, sizes[pack])
        totals[pack] += weights[item]
        sizes[pack] += 1
    return out


def _replicate(weights: Sequence[float], slots: int) -> tuple[list[int], list[int], list[int]]:
    """Each expert once, then each extra slot to the expert with the most load per replica
    (the lowest-numbered on a tie): ``(slot -> expert, slot -> replica rank, replicas)``."""
    n = len(weights)
    to_expert, rank, count = list(range(n)), [0] * n, [1] * n
    for _ in range(n, slots):
        e = max(range(n), key=lambda i: (weights[i] / count[i], -i))
        to_expert.append(e)
        rank.append(count[e])
        count[e] += 1
    return to_expert, rank, count


def _eplb_layer(
    load: Sequence[float], replicas: int, groups: int, nodes: int, hosts: int
) -> list[int]:
    if groups % nodes:  # the groups do not divide over nodes: one group, one node
        groups, nodes = 1, 1
    experts = len(load)
    group_size, groups_per_node = experts // groups, groups // nodes
    group_load = [sum(load[g * group_size : (g + 1) * group_size]) for g in range(groups)]
    # (1) groups onto nodes; node n's experts become the contiguous "node-local" ids
    # n*E/N .. (n+1)*E/N - 1, in the order its groups were packed
    local_to_log = [0] * experts
    for g, (node, rank) in enumerate(_pack(group_load, nodes)):
        first = (node * groups_per_node + rank) * group_size
        for j in range(group_size):
            local_to_log[first + j] = g * group_size + j
    per_node, slots_per_node = experts // nodes, replicas // nodes
    hosts_per_node = hosts // nodes
    slots_per_host = slots_per_node // hosts_per_node
    placed = [0] * replicas
    for node in range(nodes):
        logs = local_to_log[node * per_node : (node + 1) * per_node]
        # (2) replicas inside the node; (3) the node's replicas onto its hosts
        to_local, _, count = _replicate([load[e] for e in logs], slots_per_node)
        share = [load[logs[i]] / count[i] for i in to_local]
        for slot, (host, rank) in enumerate(_pack(share, hosts_per_node)):
            placed[node * slots_per_node + host * slots_per_host + rank] = logs[to_local[slot]]
    return placed


# -- stable ----------------------------------------------------------------------------------
def _stable_layer(
    load: Sequence[float], current: Sequence[int], hosts: int, target: float
) -> list[int]:
    slots_per_host = len(current) // hosts
    _, _, count = _replicate(load, len(current))
    share = [load[e] / count[e] for e in range(len(load))]
    wanted = list(count)
    placed: list[list[int]] = [[] for _ in range(hosts)]
    for h in range(hosts):
        for e in current[h * slots_per_host : (h + 1) * slots_per_host]:
            if wanted[e] > 0:
                placed[h].append(e)
                wanted[e] -= 1
    totals = [sum(share[e] for e in experts) for experts in placed]
    pending = [e for e in range(len(load)) for _ in range(wanted[e])]
    for e in sorted(pending, key=lambda e: -share[e]):
        h = min(
            (h for h in range(hosts) if len(placed[h]) < slots_per_host), key=totals.__getitem__
        )
        placed[h].append(e)
        totals[h] += share[e]
    _swap_down(placed, totals, share, target)
    return [e for experts in placed for e in experts]


def _swap_down(
    placed: list[list[int]], totals: list[float], share: Sequence[float], target: float
) -> None:
    """Swap replicas off the most loaded host, while it carries more than ``target``, as long
    as a swap lowers the pair's larger load."""
    while True:
        top = max(range(len(totals)), key=totals.__getitem__)
        if totals[top] <= target + 1e-9:
            return
        best: tuple[float, int, int, int] | None = None
        for other in range(len(totals)):
            if other == top:
                continue
            for i, a in enumerate(placed[top]):
                for j, b in enumerate(placed[other]):
                    delta = share[a] - share[b]
                    if delta <= 0:
                        continue
                    worse = max(totals[top] - delta, totals[other] + delta)
                    if worse < totals[top] - 1e-9 and (best is None or worse < best[0]):
                        best = (worse, other, i, j)
        if best is None:
            return
        _, other, i, j = best
        a, b = placed[top][i], placed[other][j]
        placed[top][i], placed[other][j] = b, a
        delta = share[a] - share[b]
        totals[top] -= delta
        totals[other] += delta


def _finish(placed: list[list[int]], experts: int, hosts: int) -> Placement:
    log_to_phy = []
    for row in placed:
        slots: list[list[int]] = [[] for _ in range(experts)]
        for p, e in enumerate(row):
            slots[e].append(p)
        log_to_phy.append(slots)
    replicas = [[len(s) for s in row] for row in log_to_phy]
    return Placement(phy_to_log=placed, log_to_phy=log_to_phy, replicas=replicas, num_hosts=hosts)


def _check(
    load: Sequence[Sequence[float]], replicas: int, groups: int, nodes: int, hosts: int, mode: str
) -> None:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if not load or not load[0]:
        raise ValueError("the load has no layers or no experts")
    experts = len(load[0])
    if any(len(row) != experts for row in load):
        raise ValueError("every layer's load must name the same number of experts")
    if any(x < 0 for row in load for x in row):
        raise ValueError("a load is a count of tokens and cannot be negative")
    for name, value in (("num_groups", groups), ("num_nodes", nodes), ("num_hosts", hosts)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, not {value}")
    if replicas < experts:
        raise ValueError(f"{replicas} replicas cannot hold {experts} experts")
    if replicas % hosts or hosts % nodes:
        raise ValueError(
            f"{replicas} replicas over {hosts} hosts over {nodes} nodes: each must divide evenly"
        )
    if experts % groups:
        raise ValueError(f"{experts} experts do not split into {groups} equal groups")
