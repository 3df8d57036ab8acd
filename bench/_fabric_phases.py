"""The emulated fabric of ``bench/fabric.py`` as a cabling plan, its phases as flows, and what
the shaping alone allows each phase (the physical limit).

Plan: hosts ``h0..h{N-1}``, each alone under its own ToR ``tor0..tor{N-1}``; the ToRs joined by
one aggregation switch ``agg0`` over links at the electrical rate; one OCS ``ocs0`` whose port
``i`` is wired to an uplink of ``tor_i`` at the circuit rate. The namespace hosts of the
``NetnsFabric`` are named after the ToRs, so a switch pair of the manager is a host pair of the
``NetnsRouter``, and port ``i`` of the ``NetnsOcs`` is namespace host ``tor_i``: every ToR has
one OCS port, so at most N/2 circuits are live at once (a matching).

What the netns fabric shapes (and so what the limits count): each host's ``eth0`` egress to the
bridge at the electrical rate, one token bucket shared by all its flows over the bridge; each
circuit end's egress at the circuit rate. Ingress is not shaped, and the circuit replaces the
bridge for its pair (the route moves), it does not add to it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from _fabric_flows import Flow

PHASES = ("weight_sync", "all_to_all", "weight_sync", "all_to_all")
"""The sequence one run goes through, on each fabric: the circuits must follow the phases."""


def tor_names(n: int) -> list[str]:
    return [f"tor{i}" for i in range(n)]


def topology_dict(
    n: int, electrical_gbps: float, circuit_gbps: float, latency: Mapping[str, float]
) -> dict[str, Any]:
    """The cabling plan (``topology_from_dict``'s schema); ``latency`` is the OCS's model."""
    tors = tor_names(n)
    return {
        "version": 1,
        "switches": [{"name": t, "tier": "tor", "ports": 3} for t in tors]
        + [{"name": "agg0", "tier": "agg", "ports": n}],
        "hosts": [
            {
                "name": f"h{i}",
                "accelerators": 8,
                "nics": [{"name": "eth0", "gbps": electrical_gbps, "port": f"{t}:0"}],
            }
            for i, t in enumerate(tors)
        ],
        "links": [
            {"a": f"{t}:1", "b": f"agg0:{i}", "gbps": electrical_gbps} for i, t in enumerate(tors)
        ],
        "ocs": [{"name": "ocs0", "radix": n, "latency": dict(latency)}],
        "wires": [
            {"ocs": f"ocs0:{i}", "port": f"{t}:2", "gbps": circuit_gbps} for i, t in enumerate(tors)
        ],
    }


def weight_sync_steps(tors: Sequence[str], nbytes: int) -> list[list[Flow]]:
    """A binomial-tree broadcast of ``nbytes`` from ``tors[0]`` (the trainer): in step k
    every host that has the weights sends all of them to the host 2^k further on, so N hosts
    take ceil(log2 N) steps and each step's flows form a matching (one circuit per ToR can
    carry a whole step)."""
    steps: list[list[Flow]] = []
    have = 1
    while have < len(tors):
        steps.append(
            [Flow(tors[i], tors[i + have], 0, nbytes) for i in range(have) if i + have < len(tors)]
        )
        have *= 2
    return steps


def all_to_all_flows(tors: Sequence[str], nbytes: int) -> list[Flow]:
    """Every host sends block j (``nbytes / N`` bytes) of its buffer to host j, all at once."""
    block = nbytes // len(tors)
    return [Flow(a, b, j * block, block) for a in tors for j, b in enumerate(tors) if a != b]


def phase_steps(phase: str, tors: Sequence[str], nbytes: int) -> list[list[Flow]]:
    if phase == "weight_sync":
        return weight_sync_steps(tors, nbytes)
    return [all_to_all_flows(tors, nbytes)]


def demand(flows: Sequence[Flow]) -> dict[tuple[str, str], float]:
    """The step's switch-to-switch bytes, as a hint carries them (host i is under tor_i)."""
    out: dict[tuple[str, str], float] = {}
    for f in flows:
        out[(f.src, f.dst)] = out.get((f.src, f.dst), 0.0) + f.nbytes
    return out


def limit_s(
    flows: Sequence[Flow],
    circuits: Collection[tuple[str, str]],
    electrical_bps: float,
    circuit_bps: float,
) -> float:
    """Seconds the shaping allows ``flows`` with ``circuits`` live (rates in bytes/s): the
    busiest of each host's bridge egress and each circuit end."""
    live = {frozenset(c) for c in circuits}
    egress: Counter[str] = Counter()
    on_circuit: Counter[tuple[str, str]] = Counter()
    for f in flows:
        if frozenset((f.src, f.dst)) in live:
            on_circuit[(f.src, f.dst)] += f.nbytes
        else:
            egress[f.src] += f.nbytes
    times = [b / electrical_bps for b in egress.values()]
    times += [b / circuit_bps for b in on_circuit.values()]
    return max(times, default=0.0)


def broadcast_floor_s(nbytes: int, electrical_bps: float) -> float:
    """The static fabric's floor for any broadcast: the trainer's egress must carry the
    weights once (a pipelined chain approaches it)."""
    return nbytes / electrical_bps
