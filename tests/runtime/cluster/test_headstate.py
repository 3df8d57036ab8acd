"""Tests for the head's plain-object state: nodes, placement, actor lifecycle."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import pytest

from orchestr._cluster._headstate import HeadState
from orchestr._cluster._records import ActorRecord, validate_resources
from orchestr.errors import ConfigError, PlacementError, SpawnError

T0 = 1000.0


def ids(prefix: str, n: int) -> dict[int, str]:
    return {rank: f"{prefix}-{rank}" for rank in range(n)}


def state_with(
    nodes: Mapping[str, Mapping[str, float]], labels: Mapping[str, dict[str, str]] | None = None
) -> HeadState:
    state = HeadState()
    for node_id, total in nodes.items():
        state.register_node(node_id, f"{node_id}:1", total, (labels or {}).get(node_id, {}), now=T0)
    return state


def place(
    state: HeadState,
    n: int,
    resources: Mapping[str, float],
    labels: Mapping[str, str] | None = None,
    mesh: str = "m1",
) -> list[ActorRecord]:
    return state.place(mesh, "worker", "pkg.mod:Cls", n, resources, labels or {}, ids(mesh, n))


def free(state: HeadState) -> dict[str, dict[str, float]]:
    return {node_id: dict(node.free) for node_id, node in state.nodes.items()}


# -- validate_resources ----------------------------------------------------------------------


def test_validate_resources_converts_amounts_to_float() -> None:
    out = validate_resources({"cpu": 2, "memory": 1.5, "tpu": 0})
    assert out == {"cpu": 2.0, "memory": 1.5, "tpu": 0.0}
    assert all(type(v) is float for v in out.values())


@pytest.mark.parametrize(
    "resources",
    [
        {"cpu": -1},
        {"cpu": -0.5},
        {"gpu": float("nan")},
        {"cpu": "2"},
        {"cpu": None},
        {"cpu": True},
        {"gpu": False},
        {"": 1},
        {3: 1},
    ],
)
def test_validate_resources_rejects_bad_entries(resources: Mapping[str, float]) -> None:
    with pytest.raises(ConfigError):
        validate_resources(resources)


def test_validate_resources_error_names_the_resource_and_value() -> None:
    with pytest.raises(ConfigError, match=r"'gpu'.*-2"):
        validate_resources({"cpu": 1, "gpu": -2})


# -- placement -------------------------------------------------------------------------------


def test_members_spread_over_nodes_by_free_cpu() -> None:
    state = state_with({"a": {"cpu": 4}, "b": {"cpu": 4}, "c": {"cpu": 4}})
    placed = place(state, 3, {"cpu": 1})
    assert sorted(r.node_id for r in placed) == ["a", "b", "c"]
    assert free(state) == {"a": {"cpu": 3.0}, "b": {"cpu": 3.0}, "c": {"cpu": 3.0}}


def test_member_goes_to_the_node_with_most_free_cpu() -> None:
    state = state_with({"small": {"cpu": 2}, "big": {"cpu": 8}, "mid": {"cpu": 4}})
    placed = place(state, 1, {"cpu": 1})
    assert placed[0].node_id == "big"


def test_placement_fills_the_biggest_node_until_it_is_no_longer_the_biggest() -> None:
    state = state_with({"a": {"cpu": 6}, "b": {"cpu": 2}})
    placed = place(state, 5, {"cpu": 1})
    assert [r.node_id for r in placed].count("a") == 4
    assert [r.node_id for r in placed].count("b") == 1
    assert free(state) == {"a": {"cpu": 2.0}, "b": {"cpu": 1.0}}


def test_placed_records_carry_rank_ids_and_request() -> None:
    state = state_with({"a": {"cpu": 4}})
    placed = place(state, 2, {"cpu": 1.5}, mesh="mx")
    assert [(r.actor_id, r.rank, r.mesh_id, r.name, r.state) for r in placed] == [
        ("mx-0", 0, "mx", "worker", "starting"),
        ("mx-1", 1, "mx", "worker", "starting"),
    ]
    assert all(r.resources == {"cpu": 1.5} for r in placed)
    assert placed[1].label == "worker[1]"
    assert state.mesh_members("mx") == placed


def test_placement_respects_memory_gpu_and_custom_resources() -> None:
    state = state_with(
        {
            "cpu-only": {"cpu": 64, "memory": 512},
            "gpu-box": {"cpu": 8, "memory": 64, "gpu": 2},
            "tpu-box": {"cpu": 8, "memory": 64, "tpu": 4},
        }
    )
    gpu = place(state, 2, {"cpu": 1, "gpu": 1}, mesh="g")
    tpu = place(state, 1, {"tpu": 3}, mesh="t")
    mem = place(state, 1, {"memory": 100}, mesh="mem")
    assert [r.node_id for r in gpu] == ["gpu-box", "gpu-box"]
    assert [r.node_id for r in tpu] == ["tpu-box"]
    assert [r.node_id for r in mem] == ["cpu-only"]
    assert state.nodes["gpu-box"].free == {"cpu": 6.0, "memory": 64.0, "gpu": 0.0}
    assert state.nodes["tpu-box"].free["tpu"] == 1.0
    assert state.nodes["cpu-only"].free["memory"] == 412.0


def test_a_third_gpu_member_does_not_fit_two_gpus() -> None:
    state = state_with({"gpu-box": {"cpu": 8, "gpu": 2}})
    with pytest.raises(PlacementError):
        place(state, 3, {"gpu": 1})


def test_placement_respects_labels() -> None:
    state = state_with(
        {"a": {"cpu": 16}, "b": {"cpu": 2}, "c": {"cpu": 2}},
        labels={"a": {"zone": "x"}, "b": {"zone": "y", "rack": "1"}, "c": {"zone": "y"}},
    )
    placed = place(state, 2, {"cpu": 1}, labels={"zone": "y"})
    assert sorted(r.node_id for r in placed) == ["b", "c"]
    assert [r.node_id for r in place(state, 1, {"cpu": 1}, {"zone": "y", "rack": "1"}, "m2")] == [
        "b"
    ]


def test_no_node_with_the_labels_raises_placement_error() -> None:
    state = state_with({"a": {"cpu": 16}}, labels={"a": {"zone": "x"}})
    with pytest.raises(PlacementError, match="zone"):
        place(state, 1, {"cpu": 1}, labels={"zone": "y"})


def test_exact_fit_is_accepted() -> None:
    state = state_with({"a": {"cpu": 1, "gpu": 1}})
    (record,) = place(state, 1, {"cpu": 1, "gpu": 1})
    assert record.node_id == "a"
    assert state.nodes["a"].free == {"cpu": 0.0, "gpu": 0.0}


def test_fractional_requests_sum_up_to_a_full_node() -> None:
    state = state_with({"a": {"cpu": 1}})
    placed = place(state, 10, {"cpu": 0.1})
    assert len(placed) == 10
    with pytest.raises(PlacementError):
        place(state, 1, {"cpu": 0.1}, mesh="m2")


def test_failed_placement_reserves_nothing_and_records_no_actors() -> None:
    state = state_with({"a": {"cpu": 4, "gpu": 1}, "b": {"cpu": 4, "gpu": 1}})
    before = copy.deepcopy(free(state))
    with pytest.raises(PlacementError):
        place(state, 3, {"cpu": 1, "gpu": 1})
    assert free(state) == before
    assert state.actors == {}
    assert state.mesh_members("m1") == []


def test_failed_placement_keeps_earlier_meshes() -> None:
    state = state_with({"a": {"cpu": 4}})
    kept = place(state, 2, {"cpu": 1}, mesh="kept")
    with pytest.raises(PlacementError):
        place(state, 3, {"cpu": 1}, mesh="failed")
    assert set(state.actors) == {r.actor_id for r in kept}
    assert free(state) == {"a": {"cpu": 2.0}}


def test_placement_error_names_the_request_and_each_nodes_free_resources() -> None:
    state = state_with(
        {"node-a": {"cpu": 2, "gpu": 1}, "node-b": {"cpu": 3}}, labels={"node-b": {"zone": "q"}}
    )
    with pytest.raises(PlacementError) as info:
        place(state, 2, {"cpu": 1, "gpu": 1})
    message = str(info.value)
    assert isinstance(info.value, SpawnError)
    assert "member 1 of 2" in message
    assert "'worker'" in message
    assert "{'cpu': 1.0, 'gpu': 1.0}" in message
    assert "node-a (alive) free {'cpu': 2.0, 'gpu': 1.0}" in message  # reservation rolled back
    assert "node-b (alive) free {'cpu': 3.0}" in message
    assert "'zone': 'q'" in message


def test_placement_error_with_no_nodes_says_so() -> None:
    with pytest.raises(PlacementError, match="no nodes registered"):
        place(HeadState(), 1, {"cpu": 1})


@pytest.mark.parametrize("n", [0, -1])
def test_mesh_of_fewer_than_one_member_is_refused(n: int) -> None:
    state = state_with({"a": {"cpu": 4}})
    with pytest.raises(ConfigError, match=f"n={n}"):
        place(state, n, {"cpu": 1})
    assert state.actors == {}


def test_invalid_request_is_refused_before_reserving() -> None:
    state = state_with({"a": {"cpu": 4}})
    with pytest.raises(ConfigError):
        place(state, 1, {"cpu": -1})
    assert free(state) == {"a": {"cpu": 4.0}}


# -- node liveness ---------------------------------------------------------------------------


def test_expire_nodes_marks_only_silent_nodes_dead_once() -> None:
    state = state_with({"a": {"cpu": 4}, "b": {"cpu": 4}})
    assert state.heartbeat("b", T0 + 8)
    assert state.expire_nodes(T0 + 5, timeout=5) == []  # exactly at the timeout: still alive
    assert state.expire_nodes(T0 + 10, timeout=5) == ["a"]
    assert state.expire_nodes(T0 + 11, timeout=5) == []
    assert (state.nodes["a"].alive, state.nodes["b"].alive) == (False, True)


def test_dead_nodes_are_not_used_for_placement() -> None:
    state = state_with({"big": {"cpu": 64}, "small": {"cpu": 2}})
    state.heartbeat("small", T0 + 9)
    assert state.expire_nodes(T0 + 10, timeout=5) == ["big"]
    placed = place(state, 2, {"cpu": 1})
    assert [r.node_id for r in placed] == ["small", "small"]
    with pytest.raises(PlacementError, match=r"big \(dead\)"):
        place(state, 1, {"cpu": 1}, mesh="m2")


def test_a_dead_node_must_register_again_before_it_counts() -> None:
    state = state_with({"a": {"cpu": 4}})
    state.expire_nodes(T0 + 100, timeout=5)
    assert state.heartbeat("a", T0 + 101) is False  # register again, listing your workers
    assert not state.nodes["a"].alive
    assert state.rejoin("a", [], "gone") == ([], [])
    state.register_node("a", "a:1", {"cpu": 4}, {}, now=T0 + 102)
    assert state.heartbeat("a", T0 + 103)
    assert place(state, 1, {"cpu": 1})[0].node_id == "a"


def _started(state: HeadState, records: list[ActorRecord], worker: str) -> None:
    for r in records:
        state.actor_started(r.actor_id, worker, f"tcp://{worker}", 7, ["f"])


def test_rejoin_adopts_live_workers_and_ends_the_rest() -> None:
    state = state_with({"b": {"cpu": 4}})
    kept, lost = place(state, 1, {"cpu": 1}, mesh="m1"), place(state, 1, {"cpu": 1}, mesh="m2")
    _started(state, kept, "w-kept")
    _started(state, lost, "w-lost")
    lost[0].max_restarts = 1
    ended, stray = state.rejoin("b", ["w-kept", "w-stray"], "its worker was gone")
    assert [r.actor_id for r in ended] == [lost[0].actor_id]
    assert lost[0].state == "restarting" and lost[0].last_output == "its worker was gone"
    assert kept[0].state == "alive"
    assert stray == ["w-stray"]  # hosts nothing the head knows: the node stops it
    state.register_node("b", "b:1", {"cpu": 4}, {}, now=T0 + 1)
    assert free(state) == {"b": {"cpu": 3.0}}  # the adopted actor still holds its CPU


def test_rejoin_ends_actors_whose_creation_was_in_flight() -> None:
    state = state_with({"a": {"cpu": 4}})
    both = place(state, 2, {"cpu": 1})
    _started(state, both[:1], "w-1")
    both[1].worker_id = "w-1"  # the head died while creating the second member in w-1
    ended, stray = state.rejoin("a", ["w-1"], "gone")
    assert {r.state for r in both} == {"dead"}
    assert len(ended) == 2 and stray == ["w-1"]


def test_restore_recomputes_free_resources_and_waits_for_registration() -> None:
    state = state_with({"a": {"cpu": 4}})
    _started(state, place(state, 2, {"cpu": 1}), "w-1")
    saved_nodes, saved_actors = copy.deepcopy(
        (list(state.nodes.values()), list(state.actors.values()))
    )
    again = HeadState()
    again.restore(saved_nodes, saved_actors, now=T0 + 50)
    assert free(again) == {"a": {"cpu": 2.0}}
    assert again.by_worker == {"w-1": {r.actor_id for r in saved_actors}}
    assert again.heartbeat("a", T0 + 51) is False  # loaded, not registered: register again
    assert again.expire_nodes(T0 + 54, timeout=5) == []  # a heartbeat timeout to come back
    assert again.expire_nodes(T0 + 56, timeout=5) == ["a"]


def test_changes_are_marked_for_the_store() -> None:
    state = state_with({"a": {"cpu": 4}})
    assert state.take_dirty()[0][0].node_id == "a"
    records = place(state, 2, {"cpu": 1})
    nodes, actors, _ = state.take_dirty()
    assert nodes == [] and {a.actor_id for a in actors} == {r.actor_id for r in records}
    assert state.take_dirty() == ([], [], [])
    state.actor_ended(records[0].actor_id, stopped=True)
    assert [a.actor_id for a in state.take_dirty()[1]] == [records[0].actor_id]
    with pytest.raises(PlacementError):
        place(state, 9, {"cpu": 1}, mesh="m9")
    assert state.take_dirty() == ([], [], [])  # a failed placement leaves nothing to save


def test_heartbeat_of_unknown_node_returns_false() -> None:
    assert HeadState().heartbeat("ghost", T0) is False


# -- actor lifecycle -------------------------------------------------------------------------


def test_actor_ended_releases_resources_once() -> None:
    state = state_with({"a": {"cpu": 4, "gpu": 2}})
    (record,) = place(state, 1, {"cpu": 2, "gpu": 1})
    ended = state.actor_ended(record.actor_id, stopped=True)
    assert ended is record
    assert record.state == "stopped"
    assert state.nodes["a"].free == {"cpu": 4.0, "gpu": 2.0}
    assert state.actor_ended(record.actor_id, stopped=False, exit_code=9) is None
    assert state.nodes["a"].free == {"cpu": 4.0, "gpu": 2.0}
    assert (record.state, record.exit_code) == ("stopped", 0)


def test_actor_ended_of_unknown_actor_is_a_no_op() -> None:
    state = state_with({"a": {"cpu": 4}})
    assert state.actor_ended("nobody", stopped=True) is None
    assert free(state) == {"a": {"cpu": 4.0}}


def test_actor_started_records_worker_and_marks_alive() -> None:
    state = state_with({"a": {"cpu": 4}})
    (record,) = place(state, 1, {"cpu": 1})
    state.actor_started(record.actor_id, "w-1", "tcp://127.0.0.1:5000", 4242, ["f", "g"])
    assert (record.state, record.worker_id, record.call_address, record.pid) == (
        "alive",
        "w-1",
        "tcp://127.0.0.1:5000",
        4242,
    )
    assert record.endpoints == ["f", "g"]
    assert state.by_worker == {"w-1": {record.actor_id}}


def test_worker_exited_marks_its_actor_dead_with_code_and_signal() -> None:
    state = state_with({"a": {"cpu": 4}})
    first, second = place(state, 2, {"cpu": 1})
    state.actor_started(first.actor_id, "w-1", "addr1", 11, [])
    state.actor_started(second.actor_id, "w-2", "addr2", 12, [])
    ended = state.worker_exited("w-2", exit_code=-9, signal=9)
    assert ended == [second]
    assert (second.state, second.exit_code, second.signal) == ("dead", -9, 9)
    assert first.state == "alive"
    assert state.nodes["a"].free == {"cpu": 3.0}


def test_worker_exited_twice_releases_once() -> None:
    state = state_with({"a": {"cpu": 4}})
    (record,) = place(state, 1, {"cpu": 3})
    state.actor_started(record.actor_id, "w-1", "addr", 1, [])
    assert state.worker_exited("w-1", 1, 0) == [record]
    assert state.worker_exited("w-1", 2, 0) == []
    assert record.exit_code == 1
    assert state.nodes["a"].free == {"cpu": 4.0}


def test_worker_exited_of_unknown_worker_returns_none() -> None:
    assert HeadState().worker_exited("w-unknown", 1, 0) == []


def test_stopped_then_worker_exit_does_not_overwrite_the_stop() -> None:
    state = state_with({"a": {"cpu": 4}})
    (record,) = place(state, 1, {"cpu": 1})
    state.actor_started(record.actor_id, "w-1", "addr", 1, [])
    state.actor_ended(record.actor_id, stopped=True)
    assert state.worker_exited("w-1", 0, 15) == []
    assert (record.state, record.signal) == ("stopped", 0)


def test_a_shared_worker_takes_all_its_actors_with_it() -> None:
    state = state_with({"a": {"cpu": 4}})
    records = place(state, 3, {"cpu": 1})
    for r in records:
        state.actor_started(r.actor_id, "w-shared", "addr", 7, [])
    assert state.worker_exited("w-shared", 0, 9) == sorted(records, key=lambda r: r.actor_id)
    assert {r.state for r in records} == {"dead"}
    assert state.nodes["a"].free == {"cpu": 4.0}


def test_restarting_then_restart_or_abandon() -> None:
    state = state_with({"a": {"cpu": 2}, "b": {"cpu": 2}})
    first, second = place(state, 2, {"cpu": 1})
    for r, w in ((first, "w-1"), (second, "w-2")):
        r.max_restarts = 1
        state.actor_started(r.actor_id, w, f"addr-{w}", 1, [])
    (died,) = state.worker_exited("w-1", 0, 9, "Fatal Python error")
    assert died is first and first.state == "restarting" and first.last_output
    node = first.node_id
    assert state.nodes[node].free["cpu"] == 2.0  # a restarting actor holds nothing
    state.restart(first.actor_id)
    assert (first.state, first.restarts, first.node_id) == ("starting", 1, node)  # same node
    assert state.nodes[node].free["cpu"] == 1.0
    state.actor_started(first.actor_id, "w-1-1", "addr-new", 2, [])
    (again,) = state.worker_exited("w-1-1", 0, 9)
    assert again.state == "dead"  # its one restart is used up
    with pytest.raises(ConfigError, match="not waiting for a restart"):
        state.restart(first.actor_id)
    second.max_restarts = 2
    state.worker_exited("w-2", 3, 0)
    assert state.abandon(second.actor_id) is second and second.state == "dead"
    assert state.abandon(second.actor_id) is None


def test_a_restart_goes_elsewhere_when_its_node_is_gone() -> None:
    state = state_with({"a": {"cpu": 1}, "b": {"cpu": 1}})
    (record,) = place(state, 1, {"cpu": 1})
    record.max_restarts = 1
    state.actor_started(record.actor_id, "w-1", "addr", 1, [])
    state.worker_exited("w-1", 0, 9)
    state.nodes[record.node_id].alive = False
    old = record.node_id
    state.restart(record.actor_id)
    assert record.node_id != old
    state.restart_failed(record.actor_id)
    assert record.state == "dead"  # no restart left after the failed one
    assert all(n.free == {"cpu": 1.0} for n in state.nodes.values())


# -- re-registration -------------------------------------------------------------------------


def test_reregistering_node_accounts_resources_already_used() -> None:
    state = state_with({"a": {"cpu": 8, "gpu": 2}})
    first, _second = place(state, 2, {"cpu": 2, "gpu": 1})
    state.actor_started(first.actor_id, "w-1", "addr", 1, [])
    state.register_node("a", "a:2", {"cpu": 8, "gpu": 2}, {"zone": "new"}, now=T0 + 50)
    node = state.nodes["a"]
    assert node.free == {"cpu": 4.0, "gpu": 0.0}  # one alive + one starting actor
    assert (node.address, node.labels, node.last_heartbeat) == ("a:2", {"zone": "new"}, T0 + 50)
    with pytest.raises(PlacementError):
        place(state, 1, {"gpu": 1}, mesh="m2")


def test_reregistering_node_does_not_count_ended_actors() -> None:
    state = state_with({"a": {"cpu": 8}})
    first, second = place(state, 2, {"cpu": 3})
    state.actor_ended(first.actor_id, stopped=False, exit_code=1)
    state.register_node("a", "a:1", {"cpu": 8}, {}, now=T0 + 1)
    assert state.nodes["a"].free == {"cpu": 5.0}
    state.actor_ended(second.actor_id, stopped=True)
    assert state.nodes["a"].free == {"cpu": 8.0}


def test_reregistering_node_after_it_died_is_alive_again() -> None:
    state = state_with({"a": {"cpu": 8}})
    state.expire_nodes(T0 + 100, timeout=5)
    state.register_node("a", "a:1", {"cpu": 8}, {}, now=T0 + 101)
    assert state.nodes["a"].alive
    assert place(state, 1, {"cpu": 1})[0].node_id == "a"


def test_register_node_copies_its_inputs() -> None:
    total = {"cpu": 4.0}
    labels = {"zone": "x"}
    state = HeadState()
    state.register_node("a", "a:1", total, labels, now=T0)
    place(state, 1, {"cpu": 1})
    total["cpu"] = 100.0
    labels["zone"] = "y"
    assert state.nodes["a"].total == {"cpu": 4.0}
    assert state.nodes["a"].free == {"cpu": 3.0}
    assert state.nodes["a"].labels == {"zone": "x"}


def test_a_restart_honours_the_labels_it_was_placed_by() -> None:
    state = state_with({"a": {"cpu": 1}, "b": {"cpu": 1}}, {"a": {"zone": "x"}, "b": {"zone": "y"}})
    (record,) = place(state, 1, {"cpu": 1}, {"zone": "x"})
    record.max_restarts = 1
    state.actor_started(record.actor_id, "w-1", "addr", 1, [])
    state.worker_exited("w-1", 0, 9)
    state.nodes["a"].alive = False  # node b has room, but the wrong zone
    with pytest.raises(PlacementError, match="labels {'zone': 'x'}"):
        state.restart(record.actor_id)
    assert record.state == "restarting" and state.nodes["b"].free == {"cpu": 1.0}


def place_by(state: HeadState, n: int, strategy: str, cpu: float = 1.0) -> list[str]:
    records = state.place(
        f"m-{strategy}", "w", "pkg.mod:Cls", n, {"cpu": cpu}, {}, ids(strategy, n), strategy
    )
    return [r.node_id for r in records]


def test_spread_and_pack_strategies() -> None:
    nodes = {"a": {"cpu": 4.0}, "b": {"cpu": 4.0}, "c": {"cpu": 2.0}}
    assert place_by(state_with(nodes), 3, "SPREAD") == ["b", "a", "b"]  # most free CPU each
    assert place_by(state_with(nodes), 3, "PACK") == ["c", "c", "b"]  # fullest that fits first
    assert place_by(state_with(nodes), 4, "STRICT_PACK") == ["b"] * 4  # one node holds all
    assert sorted(place_by(state_with(nodes), 3, "STRICT_SPREAD")) == ["a", "b", "c"]


def test_strict_strategies_fail_whole_and_say_why() -> None:
    nodes = {"a": {"cpu": 4.0}, "b": {"cpu": 4.0}}
    state = state_with(nodes)
    before = free(state)
    with pytest.raises(PlacementError, match="STRICT_PACK: no single node fits all"):
        place_by(state, 5, "STRICT_PACK")
    with pytest.raises(PlacementError, match="STRICT_SPREAD: every member needs a node of its own"):
        place_by(state, 3, "STRICT_SPREAD")
    assert free(state) == before and not state.actors  # no half-created mesh
    with pytest.raises(ConfigError, match="unknown placement strategy 'BEST'"):
        place_by(state, 1, "BEST")


def test_nothing_is_placed_on_a_node_until_it_registers_again() -> None:
    old = state_with({"a": {"cpu": 4}})
    again = HeadState()
    again.restore(list(old.nodes.values()), [], now=T0)
    with pytest.raises(PlacementError, match=r"a \(not registered again yet\)"):
        place(again, 1, {"cpu": 1})
    again.register_node("a", "a:1", {"cpu": 4}, {}, now=T0 + 1)
    assert place(again, 1, {"cpu": 1})[0].node_id == "a"


def test_spread_of_members_that_take_no_cpu_spreads_them_by_count() -> None:
    nodes = {"a": {"cpu": 4.0, "gpu": 2.0}, "b": {"cpu": 2.0, "gpu": 2.0}}
    state = state_with(nodes)
    placed = state.place("m", "w", "pkg:Cls", 4, {"gpu": 0.5}, {}, ids("m", 4), "SPREAD")
    assert [r.node_id for r in placed] == ["a", "b", "a", "b"]
    assert place_by(state_with(nodes), 3, "SPREAD", cpu=0.0) == ["a", "b", "a"]


# -- reservations ----------------------------------------------------------------------------
def test_a_reservation_holds_bundles_until_released() -> None:
    state = state_with({"a": {"cpu": 4}, "b": {"cpu": 4}})
    r = state.reserve("r1", "gang", 2, {"cpu": 3}, {}, "STRICT_SPREAD")
    assert sorted(r.node_ids) == ["a", "b"]
    assert free(state) == {"a": {"cpu": 1.0}, "b": {"cpu": 1.0}}
    with pytest.raises(PlacementError, match="cannot place member 0"):
        place(state, 1, {"cpu": 2}, mesh="outside")  # the bundles hold the CPUs
    inside = state.place("m", "w", "pkg:Cls", 2, {}, {}, ids("m", 2), reservation_id="r1")
    assert [x.node_id for x in inside] == r.node_ids and [x.bundle for x in inside] == [0, 1]
    assert [x.resources for x in inside] == [{"cpu": 3.0}] * 2  # a bundle's, by default
    assert free(state) == {"a": {"cpu": 1.0}, "b": {"cpu": 1.0}}  # taken from the bundles
    with pytest.raises(PlacementError, match="0 free bundle"):
        state.place("m2", "w", "pkg:Cls", 1, {}, {}, ids("m2", 1), reservation_id="r1")
    state.actor_ended(inside[0].actor_id, stopped=True)  # its bundle is free again ...
    assert free(state) == {"a": {"cpu": 1.0}, "b": {"cpu": 1.0}}  # ... and keeps the CPUs
    again = state.place("m3", "w", "pkg:Cls", 1, {"cpu": 1}, {}, ids("m3", 1), reservation_id="r1")
    assert again[0].bundle == 0
    live = state.release("r1")
    assert [x.actor_id for x in live] == [inside[1].actor_id, again[0].actor_id]
    assert free(state) == {"a": {"cpu": 4.0}, "b": {"cpu": 4.0}}
    assert state.release("r1") == []  # idempotent
    with pytest.raises(ConfigError, match="'r1' is released"):
        state.place("m4", "w", "pkg:Cls", 1, {}, {}, ids("m4", 1), reservation_id="r1")


def test_reservations_are_all_or_nothing_and_checked() -> None:
    state = state_with({"a": {"cpu": 4}})
    with pytest.raises(PlacementError, match="STRICT_SPREAD"):
        state.reserve("r1", "gang", 2, {"cpu": 1}, {}, "STRICT_SPREAD")
    assert free(state) == {"a": {"cpu": 4.0}} and state.reservations == {}
    state.reserve("r2", "small", 1, {"cpu": 1}, {}, "PACK")
    with pytest.raises(PlacementError, match=r"asks for \{'cpu': 2.0\} a member, more than"):
        state.place("m", "w", "pkg:Cls", 1, {"cpu": 2}, {}, ids("m", 1), reservation_id="r2")
    with pytest.raises(ConfigError, match="'nope' is unknown"):
        state.place("m", "w", "pkg:Cls", 1, {}, {}, ids("m", 1), reservation_id="nope")


def test_a_reserved_actor_restarts_in_its_bundle_and_restore_counts_bundles() -> None:
    state = state_with({"a": {"cpu": 4}, "b": {"cpu": 4}})
    state.reserve("r1", "gang", 1, {"cpu": 2}, {}, "PACK")
    (member,) = state.place("m", "w", "pkg:Cls", 1, {}, {}, ids("m", 1), reservation_id="r1")
    member.max_restarts = 1
    _started(state, [member], "w-1")
    state.worker_exited("w-1", 1, 0)
    restarted = state.restart(member.actor_id)
    assert restarted.node_id == state.reservations["r1"].node_ids[0]
    before = free(state)
    again = HeadState()
    again.restore(
        copy.deepcopy(list(state.nodes.values())),
        copy.deepcopy(list(state.actors.values())),
        now=T0,
        reservations=copy.deepcopy(list(state.reservations.values())),
    )
    assert free(again) == before  # the bundle counted once, not with its actor again


def test_prune_forgets_the_oldest_ended_actors() -> None:
    state = state_with({"a": {"cpu": 8}})
    first, second, live = (place(state, 1, {"cpu": 1}, mesh=m)[0] for m in ("m1", "m2", "m3"))
    _started(state, [first], "w-1")
    _started(state, [second], "w-2")
    _started(state, [live], "w-3")
    state.actor_ended(first.actor_id, stopped=True)
    state.worker_exited("w-2", 1, 0)
    assert state.prune(keep=2) == [] and len(state.actors) == 3
    assert [a.actor_id for a in state.prune(keep=1)] == [first.actor_id]  # ended first
    assert set(state.actors) == {second.actor_id, live.actor_id}
    assert "w-1" not in state.by_worker
    assert state.prune(keep=0) == [second] and set(state.actors) == {live.actor_id}
    assert free(state) == {"a": {"cpu": 7.0}}  # the live one still holds its CPU


def test_an_actor_restarted_after_its_end_is_not_pruned() -> None:
    state = state_with({"a": {"cpu": 8}})
    (member,) = place(state, 1, {"cpu": 1})
    member.max_restarts = 1
    _started(state, [member], "w-1")
    state.worker_exited("w-1", 1, 0)  # ended, waiting for its restart
    state.restart(member.actor_id)
    assert state.prune(keep=0) == [] and member.actor_id in state.actors
