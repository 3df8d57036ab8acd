"""A generation pool that changes its tensor-parallel degree, on virtual time: the
all-reduces priced on the flow network, a static pool's step equal to its closed form, and the
RL job's own policy beating every static degree where the bulk of a step and its tail want
different ones (running low for the queue, high for the tail, low again for the next
queue)."""

from __future__ import annotations

import random

import pytest

from orchestr.fabric.optical import fat_tree
from orchestr.sim import collective_time, pool_costs, simulate_layouts
from orchestr.sim._layouts import LayoutRun, _change, allreduce_fit
from orchestr.sim._profiles import H100_SXM, LLAMA3_8B
from tests.roles.rl.test_layout import COSTS, one_at_a_time


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_the_all_reduce_fit_is_the_flow_networks_time(degree: int) -> None:
    per_round, per_byte = allreduce_fit(degree, 3600.0, 2e-6)
    topology = fat_tree(2, hosts_per_tor=degree, accelerators_per_host=1, nic_gbps=3600.0)
    members = [f"p0-t0-h{i}" for i in range(degree)]
    nbytes = 3 << 22  # a size the fit never saw
    want = collective_time(topology, "all_reduce", members, nbytes, alpha=2e-6)
    got = 2 * (degree - 1) * (per_round + nbytes / degree * per_byte)
    assert got == pytest.approx(want, rel=0.01)
    costs = pool_costs(H100_SXM, LLAMA3_8B, device_bytes=80e9, link_gbps=3600.0, alpha_s=2e-6)
    assert costs.weight_bytes == pytest.approx(16.06e9)
    with pytest.raises(ValueError, match="2 or more devices"):
        allreduce_fit(1, 3600.0, 2e-6)


def test_a_static_pools_step_is_its_replicas_closed_form() -> None:
    requests = [(100, 40 + 10 * i) for i in range(16)]  # two a replica at degree 1
    for degree in (1, 2, 8):
        run = simulate_layouts(COSTS, 8, [requests], policy=degree)
        replicas = 8 // degree
        shares = [requests[r::replicas] for r in range(replicas)]
        want = max(one_at_a_time(degree, s) for s in shares)
        assert run.steps_s == [pytest.approx(want)] and run.changes == 0
    with pytest.raises(ValueError, match="policy is 'adaptive' or one of"):
        simulate_layouts(COSTS, 8, [requests], policy=3)


def test_the_policy_runs_the_queue_low_and_the_tail_high() -> None:
    rng = random.Random(3)
    # a long bulk (near 1,000 tokens each, 250 a device) and ten requests twice as long
    steps = [
        [(100, rng.randint(900, 1000)) for _ in range(1990)]
        + [(100, 2000 + 10 * i) for i in range(10)]
        for _ in range(2)
    ]
    history = [n for _, n in steps[0]]
    runs = {
        policy: simulate_layouts(COSTS, 8, steps, policy=policy, history=history, restart_s=1.0)
        for policy in (1, 2, 4, 8, "adaptive")
    }
    adaptive = runs.pop("adaptive")
    best = max(r.samples_per_s for r in runs.values())
    assert adaptive.samples_per_s > 1.05 * best
    # degree 1 for each queue, 8 for each tail: two changes a step after the first queue
    assert [d for _, d in adaptive.degrees] == [1, 8, 1, 8]
    assert adaptive.changes == 3 and adaptive.change_s >= 3.0
    # a merge needs no weights moved (each device holds its new share); a split moves what
    # each device lacks, over its link; requests in flight take their KV along
    run = LayoutRun([], 0, [])
    link = 3600e9 / 8
    assert _change(COSTS, 1, 8, [], 8, 3600.0, 1.0, run) == pytest.approx(1.0)
    split = _change(COSTS, 8, 1, [], 8, 3600.0, 1.0, run)
    assert split == pytest.approx(1.0 + COSTS.weight_bytes * (1 - 1 / 8) / link)
    moving = _change(COSTS, 1, 8, [[1000.0, 5.0, 900.0]], 8, 3600.0, 1.0, run)
    assert moving == pytest.approx(1.0 + 1000 * COSTS.kv_bytes_per_token / (8 * link))
    assert run.changes == 3
