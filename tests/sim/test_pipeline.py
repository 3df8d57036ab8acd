"""A pipeline step on the simulated network: the schedules' own timing model when nothing is
moved, and the network's cost on top of it when activations cross links."""

from __future__ import annotations

import pytest

from orchestr.fabric.optical import fat_tree
from orchestr.roles.pipeline import SCHEDULES, Cost, bubble_theory, build, run
from orchestr.sim import simulate_pipeline

GBPS = 100.0
TREE = fat_tree(4, hosts_per_tor=8, nic_gbps=GBPS, tor_agg_gbps=GBPS)
HOSTS = [f"p0-t0-h{i}" for i in range(4)]


@pytest.mark.parametrize("kind", SCHEDULES)
def test_with_nothing_to_move_it_is_the_timing_model(kind: str) -> None:
    chunks = 2 if kind == "interleaved_1f1b" else 1
    schedule = build(kind, 4, 8, chunks)
    cost = Cost(f=1e-3, b=2e-3, bi=1e-3, bw=1e-3, latency=1e-5)
    simulated = simulate_pipeline(schedule, cost)
    model = run(schedule, cost, capacity=None)
    assert simulated.makespan == pytest.approx(model.makespan, abs=1e-8)
    for got, want in zip(simulated.ends, model.ends, strict=True):
        assert got == pytest.approx(want, abs=1e-8)
    # on a network with free links and no bytes, the same; and at latency 0 the closed form
    on_tree = simulate_pipeline(schedule, cost, topology=TREE, hosts=HOSTS)
    assert on_tree.makespan == pytest.approx(model.makespan, abs=1e-8)
    unit = simulate_pipeline(schedule, Cost(), topology=TREE)
    assert unit.bubble == pytest.approx(bubble_theory(kind, 4, 8, chunks))


def test_moving_activations_adds_the_network_to_the_bubble() -> None:
    schedule = build("1f1b", 4, 8)
    cost = Cost(f=1e-3, b=2e-3)
    item = 0.5e-3 * GBPS * 1e9 / 8  # half a forward's time on one NIC
    free = simulate_pipeline(schedule, cost, topology=TREE, hosts=HOSTS)
    moved = simulate_pipeline(schedule, cost, topology=TREE, hosts=HOSTS, item_bytes=item)
    assert moved.bubble > free.bubble
    # the warm-up alone waits for 3 hops of activations, the cool-down for 3 of gradients
    assert moved.makespan >= free.makespan + 6 * 0.5e-3 - 1e-8
    # ranks sharing a host hand items over in memory: no network time at all
    shared = simulate_pipeline(schedule, cost, topology=TREE, hosts=[HOSTS[0]] * 4, item_bytes=item)
    assert shared.makespan == pytest.approx(free.makespan, abs=1e-8)


def test_bad_inputs_are_refused() -> None:
    schedule = build("gpipe", 2, 2)
    with pytest.raises(ValueError, match="2 ranks need 2 hosts, got 1"):
        simulate_pipeline(schedule, topology=TREE, hosts=HOSTS[:1])
    with pytest.raises(ValueError, match="hosts not in the topology: nowhere"):
        simulate_pipeline(schedule, topology=TREE, hosts=[HOSTS[0], "nowhere"])
    with pytest.raises(ValueError, match="item_bytes must be >= 0"):
        simulate_pipeline(schedule, item_bytes=-1)
