"""The topology model: loading plans, validation messages, queries, fat trees, round trips."""

from __future__ import annotations

import copy
import math
import re
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestr.errors import ConfigError
from orchestr.fabric._optical._elements import (
    CircuitCandidate,
    Host,
    Nic,
    PortRef,
    ReconfigLatency,
    Switch,
    TopologyError,
)
from orchestr.fabric._optical._fattree import OcsLayer, fat_tree
from orchestr.fabric._optical._topology import Topology
from orchestr.fabric._optical._topology_file import dump_topology, load_topology, topology_from_dict

EXAMPLE = Path(__file__).parents[3] / "examples" / "fabric" / "small.toml"


def example() -> dict[str, Any]:
    return tomllib.loads(EXAMPLE.read_text())


def test_example_loads() -> None:
    topo = load_topology(EXAMPLE)
    assert [h.name for h in topo.hosts] == ["h0", "h1", "h2", "h3"]
    assert len(topo.accelerators) == 28
    assert topo.accelerators[:2] == ("h0:0", "h0:1")
    assert topo.accelerators_of("h3") == ("h3:0", "h3:1", "h3:2", "h3:3")
    assert topo.host_of("h2:7") == "h2"
    assert topo.tor_of("h2") == "tor1"
    assert topo.hosts_under("tor0") == ("h0", "h1")
    assert topo.hosts_under("agg0") == ()
    assert topo.switch("agg0").tier == "agg"
    assert [s.name for s in topo.switches_in("tor")] == ["tor0", "tor1"]
    assert topo.free_ports("tor1") == (3, 7)
    assert topo.link_gbps("tor1", "agg0") == 500
    assert topo.ocs_switch("ocs0").latency == ReconfigLatency(25, 100, 500, 0)
    assert topo.wire_at(PortRef("tor0", 7)) == topo.wires[1]
    assert topo.wire_at(PortRef("tor0", 0)) is None
    assert "hosts=4" in repr(topo)


def test_queries_name_unknown_things() -> None:
    topo = load_topology(EXAMPLE)
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: topo.tor_of("h9"), "'h9'"),
        (lambda: topo.hosts_under("h0"), "no switch 'h0'"),
        (lambda: topo.host_of("h0:8"), "'h0:8'"),
        (lambda: topo.host_of("tor0:0"), "'tor0:0'"),
        (lambda: topo.ocs_reach("tor0"), "no OCS 'tor0'"),
        (lambda: topo.circuit_budgets([PortRef("tor0", 6)]), "tor0:6"),
    ]
    for call, name in cases:
        with pytest.raises(TopologyError, match=re.escape(name)):
            call()


def test_latency_model() -> None:
    lat = ReconfigLatency(switch_ms=20, settle_ms=50, control_ms=300, concurrency=0)
    assert lat.expected_ms(0) == 0
    assert lat.expected_ms(1) == lat.expected_ms(64) == 370
    serial = ReconfigLatency(switch_ms=20, settle_ms=50, control_ms=300, concurrency=4)
    assert serial.expected_ms(4) == 370
    assert serial.expected_ms(9) == 300 + 3 * 20 + 50


# -- invalid plans -------------------------------------------------------------------------

Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mutation:
    """Set a value at a dotted path: ``hosts.0.nics.0.port``."""

    def apply(plan: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = plan
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(last) if isinstance(node, list) else last] = value

    return apply


def _append(key: str, item: dict[str, Any]) -> Mutation:
    return lambda plan: plan.setdefault(key, []).append(item)


def _drop_links_of(switch: str) -> Mutation:
    def apply(plan: dict[str, Any]) -> None:
        plan["links"] = [k for k in plan["links"] if not k["a"].startswith(switch + ":")]

    return apply


def _core_wired(plan: dict[str, Any]) -> None:
    plan["switches"].append({"name": "core0", "tier": "core", "ports": 4})
    plan["wires"][0]["port"] = "core0:0"


INVALID: list[tuple[str, Mutation, str, str | None]] = [
    # (id, mutation, exact message fragment, element)
    (
        "unknown-nic-switch",
        _set("hosts.0.nics.0.port", "tor9:0"),
        "NIC h0/nic0 refers to unknown element 'tor9'",
        "tor9",
    ),
    (
        "unknown-link-end",
        _set("links.1.b", "agg7:1"),
        "link links[1] (tor0:5 <-> agg7:1) refers to unknown element 'agg7'",
        "agg7",
    ),
    (
        "unknown-ocs",
        _set("wires.0.ocs", "ocs5:0"),
        "wire wires[0] (ocs5:0 <-> tor0:6) refers to unknown element 'ocs5'",
        "ocs5",
    ),
    (
        "dangling-nic-port",
        _set("hosts.1.nics.0.port", "tor0:8"),
        "dangling port: NIC h1/nic0 uses port tor0:8, but switch tor0 has 8 ports (ports 0..7)",
        "tor0",
    ),
    (
        "dangling-link-port",
        _set("links.2.b", "agg0:6"),
        "dangling port: link links[2] (tor1:4 <-> agg0:6) uses port agg0:6, but switch agg0 has 6",
        "agg0",
    ),
    (
        "dangling-wire-switch-port",
        _set("wires.3.port", "agg0:9"),
        "dangling port: wire wires[3] (ocs0:3 <-> agg0:9) uses port agg0:9",
        "agg0",
    ),
    (
        "two-links-one-port",
        _set("links.1.a", "tor0:4"),
        "port tor0:4 is wired twice: by link links[0] (tor0:4 <-> agg0:0) and by link links[1] "
        "(tor0:4 <-> agg0:1)",
        "tor0",
    ),
    (
        "link-and-wire",
        _set("wires.0.port", "tor0:5"),
        "port tor0:5 is wired twice: by link links[1] (tor0:5 <-> agg0:1) and by wire wires[0] "
        "(ocs0:0 <-> tor0:5)",
        "tor0",
    ),
    (
        "nic-and-link",
        _set("links.0.a", "tor0:1"),
        "port tor0:1 is wired twice: by NIC h1/nic0 and by link links[0] (tor0:1 <-> agg0:0)",
        "tor0",
    ),
    (
        "two-nics",
        _set("hosts.1.nics.0.port", "tor0:0"),
        "port tor0:0 is wired twice: by NIC h0/nic0 and by NIC h1/nic0",
        "tor0",
    ),
    (
        "two-wires-one-ocs-port",
        _set("wires.1.ocs", "ocs0:0"),
        "port ocs0:0 is wired twice: by wire wires[0] (ocs0:0 <-> tor0:6) and by wire wires[1]",
        "ocs0",
    ),
    (
        "ocs-port-beyond-radix",
        _set("wires.2.ocs", "ocs0:8"),
        "radix exceeded: wire wires[2] (ocs0:8 <-> tor1:6) uses port ocs0:8, but OCS ocs0 has "
        "radix 8 (ports 0..7)",
        "ocs0",
    ),
    (
        "more-wires-than-radix",
        _set("ocs.0.radix", 3),
        "radix exceeded: OCS ocs0 has radix 3 but 4 wires",
        "ocs0",
    ),
    (
        "duplicate-host-switch",
        _set("hosts.3.name", "agg0"),
        "duplicate name 'agg0': a host and a switch share it",
        "agg0",
    ),
    (
        "duplicate-host",
        _set("hosts.1.name", "h0"),
        "duplicate name 'h0': a host and a host share it",
        "h0",
    ),
    (
        "duplicate-nic",
        _set("hosts.2.nics.1.name", "nic0"),
        "host h2 has two NICs named 'nic0'",
        "h2",
    ),
    ("zero-gbps", _set("links.3.gbps", 0), "link links[3] (tor1:5 <-> agg0:3): bandwidth", "tor1"),
    (
        "negative-gbps",
        _set("hosts.0.nics.0.gbps", -5),
        "NIC h0/nic0: bandwidth (Gbit/s) is -5",
        "h0",
    ),
    ("string-gbps", _set("wires.1.gbps", "fast"), "is 'fast', not a number", "ocs0"),
    ("bool-gbps", _set("links.0.gbps", True), "is True, not a number", "tor0"),
    ("nan-gbps", _set("links.0.gbps", math.nan), "bandwidth (Gbit/s) is nan", "tor0"),
    ("inf-gbps", _set("links.0.gbps", math.inf), "bandwidth (Gbit/s) is inf", "tor0"),
    (
        "bad-tier",
        _set("switches.2.tier", "spine"),
        "switch agg0: tier 'spine' is not one of",
        "agg0",
    ),
    ("bad-ports", _set("switches.0.ports", 0), "switch tor0: port count is 0", "tor0"),
    ("bad-accelerators", _set("hosts.3.accelerators", 2.5), "host h3: accelerator count", "h3"),
    (
        "bad-latency",
        _set("ocs.0.latency.settle_ms", -1),
        "OCS ocs0: latency settle_ms is -1",
        "ocs0",
    ),
    (
        "ocs-to-host",
        _set("wires.0.port", "h0:0"),
        "OCS ocs0 is wired to h0, a host; OCS ports wire to ToR or aggregation switch uplinks",
        "h0",
    ),
    (
        "ocs-to-core",
        _core_wired,
        "OCS ocs0 is wired to core0, a core switch",
        "core0",
    ),
    ("host-without-nic", _set("hosts.2.nics", []), "host h2 has no NIC", "h2"),
    (
        "nic-on-agg",
        _set("hosts.0.nics.0.port", "agg0:5"),
        "NIC h0/nic0 is cabled to agg0:5, a agg switch; host NICs cable to ToR switch ports",
        "agg0",
    ),
    (
        "nic-on-ocs",
        _set("hosts.0.nics.0.port", "ocs0:7"),
        "NIC h0/nic0 is cabled to ocs0:7, a OCS",
        "ocs0",
    ),
    (
        "link-to-host",
        _set("links.0.b", "h0:0"),
        "ends at h0, a host; links join switch ports",
        "h0",
    ),
    (
        "link-to-ocs",
        _set("links.0.b", "ocs0:5"),
        "ends at ocs0, a OCS; links join switch ports (OCS ports are wired with [[wires]])",
        "ocs0",
    ),
    ("self-loop", _set("links.0.b", "tor0:3"), "joins switch tor0 to itself", "tor0"),
    (
        "disconnected",
        _drop_links_of("tor1"),
        "fabric is disconnected: no electrical up-down path from host h0 (ToR tor0) to host h2 "
        "(ToR tor1)",
        "h2",
    ),
    ("name-with-colon", _set("switches.2.name", "agg:0"), "name 'agg:0' is not usable", "agg:0"),
    ("name-with-space", _set("hosts.0.name", "h 0"), "hosts[0]: name 'h 0' is not usable", "h 0"),
]


@pytest.mark.parametrize(
    ("mutate", "message", "element"),
    [pytest.param(m, msg, el, id=name) for name, m, msg, el in INVALID],
)
def test_invalid_plan_names_the_element(
    mutate: Mutation, message: str, element: str | None
) -> None:
    plan = example()
    mutate(plan)
    with pytest.raises(TopologyError, match=re.escape(message)) as info:
        topology_from_dict(plan)
    assert info.value.element == element
    assert isinstance(info.value, ConfigError)


def test_disconnected_through_a_valley() -> None:
    """tor0 and tor2 are cabled together only through tor1 (down, then up again)."""
    plan: dict[str, Any] = {
        "switches": [{"name": n, "tier": "tor", "ports": 4} for n in ("tor0", "tor1", "tor2")]
        + [{"name": n, "tier": "agg", "ports": 4} for n in ("agg0", "agg1")],
        "hosts": [
            {"name": "a", "accelerators": 1, "nics": [{"name": "n", "gbps": 1, "port": "tor0:0"}]},
            {"name": "b", "accelerators": 1, "nics": [{"name": "n", "gbps": 1, "port": "tor2:0"}]},
        ],
        "links": [
            {"a": "tor0:1", "b": "agg0:0", "gbps": 1},
            {"a": "tor1:1", "b": "agg0:1", "gbps": 1},
            {"a": "tor1:2", "b": "agg1:0", "gbps": 1},
            {"a": "tor2:1", "b": "agg1:1", "gbps": 1},
        ],
    }
    with pytest.raises(TopologyError, match=r"host a \(ToR tor0\) to host b \(ToR tor2\)"):
        topology_from_dict(plan)
    plan["links"].append({"a": "agg0:2", "b": "agg1:2", "gbps": 1})  # across the top: fine
    assert topology_from_dict(plan).path("a", "b").nodes == (
        "a",
        "tor0",
        "agg0",
        "agg1",
        "tor2",
        "b",
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "plan must be a table, not list"),
        ({"version": 2}, "version 2 is not supported"),
        ({"hostz": []}, "plan: unknown key 'hostz'"),
        ({"hosts": {}}, "plan: 'hosts' must be an array of tables, not dict"),
        ({"hosts": [3]}, "hosts[0] must be a table, not int"),
        ({"hosts": [{"name": "h"}]}, "hosts[0]: missing key 'accelerators'"),
        ({"switches": [{"name": "s", "tier": "tor", "ports": 1, "x": 1}]}, "unknown key 'x'"),
        (
            {
                "hosts": [
                    {"name": "h", "accelerators": 1, "nics": [{"name": "n", "gbps": 1, "port": 3}]}
                ]
            },
            "host h (hosts[0]) nics[0]: port 3 must be a string 'element:index'",
        ),
        ({"links": [{"a": "tor0", "b": "x:1", "gbps": 1}]}, "links[0]: port reference 'tor0' is"),
        (
            {"ocs": [{"name": "o", "radix": 2, "latency": {"mirror_ms": 1}}]},
            "OCS o (ocs[0]) latency",
        ),
    ],
)
def test_malformed_data(data: Any, message: str) -> None:
    with pytest.raises(TopologyError, match=re.escape(message)):
        topology_from_dict(data)


def test_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[[hosts]\n")
    with pytest.raises(TopologyError, match="bad.toml: not valid TOML"):
        load_topology(bad)
    bad.write_text('[[hosts]]\nname = "h"\naccelerators = 1\n')
    with pytest.raises(TopologyError, match=r"bad.toml: host h has no NIC") as info:
        load_topology(bad)
    assert info.value.element == "h"
    with pytest.raises(TopologyError, match="end in .toml, .yaml or .yml"):
        load_topology(tmp_path / "plan.json")


def test_yaml_needs_pyyaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # as if PyYAML were not installed
    plan = tmp_path / "plan.yaml"
    plan.write_text("hosts: []\n")
    with pytest.raises(
        TopologyError, match=r"plan.yaml: YAML plans need PyYAML \(pip install pyyaml\)"
    ):
        load_topology(plan)


def test_yaml_round_trip(tmp_path: Path) -> None:
    topo = load_topology(EXAMPLE)
    dump_topology(topo, tmp_path / "plan.yaml")
    assert load_topology(tmp_path / "plan.yaml") == topo


def test_constructing_in_code_is_validated() -> None:
    tor = Switch("t", "tor", 2)
    host = Host("h", 1, [Nic("n", 100, PortRef("t", 0))])
    assert Topology(hosts=[host], switches=[tor]).hosts == (host,)
    with pytest.raises(TopologyError, match="links\\[0\\] is a dict, not a Link"):
        Topology(hosts=(host,), switches=(tor,), links=({"a": 1},))
    with pytest.raises(TopologyError, match="not a port reference"):
        Topology(hosts=(Host("h", 1, (Nic("n", 100, "t:0"),)),), switches=(tor,))


# -- paths and circuits --------------------------------------------------------------------


def test_paths_on_the_example() -> None:
    topo = load_topology(EXAMPLE)
    p = topo.path("h0", "h2")
    assert p.nodes == ("h0", "tor0", "agg0", "tor1", "h2")
    assert p.hop_gbps == (400, 800, 500, 400)  # h2's two 200G NICs add up; tor1 has 400+100
    assert p.hops == 4 and p.bottleneck_gbps == 400
    assert topo.path("h0", "h1").nodes == ("h0", "tor0", "h1")
    assert topo.path("h3", "h3") == topo.path("h3", "h3")
    assert topo.path("h3", "h3").hops == 0 and topo.path("h3", "h3").bottleneck_gbps == math.inf
    assert topo.switch_path("tor1", "agg0").hop_gbps == (500,)


def _two_pod_plan() -> dict[str, Any]:
    """Two ToRs under two aggs (one thin, one wide) and a core above; a multi-homed host."""

    def nic(port: str, gbps: float = 100, name: str = "n0") -> dict[str, Any]:
        return {"name": name, "gbps": gbps, "port": port}

    return {
        "switches": [
            {"name": "t0", "tier": "tor", "ports": 6},
            {"name": "t1", "tier": "tor", "ports": 6},
            {"name": "thin", "tier": "agg", "ports": 4},
            {"name": "wide", "tier": "agg", "ports": 4},
            {"name": "core", "tier": "core", "ports": 2},
        ],
        "hosts": [
            {"name": "a", "accelerators": 2, "nics": [nic("t0:0", 50)]},
            {"name": "b", "accelerators": 2, "nics": [nic("t1:0")]},
            {"name": "m", "accelerators": 2, "nics": [nic("t0:1"), nic("t1:1", 300, "n1")]},
        ],
        "links": [
            {"a": "t0:4", "b": "thin:0", "gbps": 10},
            {"a": "t1:4", "b": "thin:1", "gbps": 10},
            {"a": "t0:5", "b": "wide:0", "gbps": 400},
            {"a": "t1:5", "b": "wide:1", "gbps": 200},
            {"a": "thin:2", "b": "core:0", "gbps": 1000},
            {"a": "wide:2", "b": "core:1", "gbps": 1000},
        ],
    }


def test_path_is_shortest_then_widest() -> None:
    topo = topology_from_dict(_two_pod_plan())
    p = topo.path("a", "b")
    assert p.nodes == ("a", "t0", "wide", "t1", "b")  # not via thin, not via core (longer)
    assert p.hop_gbps == (50, 400, 200, 100) and p.bottleneck_gbps == 50
    assert topo.tors_of("m") == ("t0", "t1")
    with pytest.raises(TopologyError, match="host m is cabled to 2 ToRs"):
        topo.tor_of("m")
    assert topo.path("m", "b").nodes == ("m", "t1", "b")  # its second NIC is on b's ToR
    assert topo.path("m", "b").bottleneck_gbps == 100
    assert topo.hosts_under("t1") == ("b", "m")
    assert topo.switch_path("thin", "wide").nodes == ("thin", "core", "wide")
    # a host on an island ToR and on t0 still reaches b, through t0
    plan = _two_pod_plan()
    plan["switches"].append({"name": "island", "tier": "tor", "ports": 1})
    plan["hosts"][0]["nics"].append({"name": "n1", "gbps": 100, "port": "island:0"})
    island = topology_from_dict(plan)
    assert island.path("a", "b").nodes == ("a", "t0", "wide", "t1", "b")
    with pytest.raises(TopologyError, match="no electrical up-down path from island to t1"):
        island.switch_path("island", "t1")
    # thin is the only way once wide loses its uplink from t1
    plan = _two_pod_plan()
    del plan["links"][3]
    assert topology_from_dict(plan).path("a", "b").nodes == ("a", "t0", "thin", "t1", "b")


def test_circuit_candidates_and_budgets() -> None:
    topo = load_topology(EXAMPLE)
    assert dict(topo.ocs_reach("ocs0")) == {"tor0": (0, 1), "tor1": (2,), "agg0": (3,)}
    assert topo.ocs_wires("ocs0")[2].switch_port == PortRef("tor1", 6)
    assert topo.circuit_candidates() == (
        CircuitCandidate("ocs0", "tor0", "tor1", (0, 1), (2,)),
        CircuitCandidate("ocs0", "tor0", "agg0", (0, 1), (3,)),
        CircuitCandidate("ocs0", "tor1", "agg0", (2,), (3,)),
    )
    assert topo.circuit_candidates()[0].max_circuits == 1
    assert topo.circuit_budgets() == {"tor0": 2, "tor1": 1, "agg0": 1}
    busy = [PortRef("ocs0", 2), PortRef("ocs0", 0)]  # a circuit tor0 <-> tor1
    assert topo.circuit_candidates(busy) == (CircuitCandidate("ocs0", "tor0", "agg0", (1,), (3,)),)
    assert topo.circuit_budgets(busy) == {"tor0": 1, "tor1": 0, "agg0": 1}


def test_fat_tree_circuits_reach_every_switch_of_the_tier() -> None:
    topo = fat_tree(4, ocs=OcsLayer(tier="agg", count=2, uplinks=4))
    aggs = [s.name for s in topo.switches_in("agg")]
    for o in ("ocs0", "ocs1"):
        assert sorted(topo.ocs_reach(o)) == sorted(aggs)
        assert all(len(p) == 2 for p in topo.ocs_reach(o).values())
    assert len(topo.circuit_candidates()) == 2 * (8 * 7 // 2)
    assert len(topo.circuit_candidates(ocs="ocs1")) == 8 * 7 // 2
    assert topo.circuit_budgets() == dict.fromkeys(aggs, 4)


# -- fat trees and round trips -------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 4, 6, 8, 16])
@pytest.mark.parametrize("layer", [None, "tor", "agg"])
def test_fat_tree_counts(k: int, layer: str | None) -> None:
    half = k // 2
    ocs = None if layer is None else OcsLayer(tier=layer, count=2, uplinks=2)
    topo = fat_tree(k, ocs=ocs)
    assert len(topo.hosts) == k**3 // 4
    assert len(topo.accelerators) == 8 * k**3 // 4
    assert len(topo.switches_in("tor")) == len(topo.switches_in("agg")) == k * half
    assert len(topo.switches_in("core")) == half * half
    assert len(topo.links) == k**3 // 2
    assert len(topo.wires) == (0 if ocs is None else 2 * k * half)
    used = sum(s.ports - len(topo.free_ports(s.name)) for s in topo.switches)
    assert used == len(topo.hosts) + 2 * len(topo.links) + len(topo.wires)  # every switch full
    assert all(not topo.free_ports(s.name) for s in topo.switches)
    if ocs is not None:
        assert [o.radix for o in topo.ocs] == [k * half, k * half]


def test_fat_tree_for_8192_accelerators() -> None:
    topo = fat_tree(16, ocs=OcsLayer(count=4, uplinks=4))
    assert len(topo.accelerators) == 8192
    far = topo.path("p0-t0-h0", "p15-t7-h7")
    assert far.hops == 6 and far.bottleneck_gbps == 400
    assert topo.tor_of("p15-t7-h7") == "p15-tor7"
    assert len(topo.hosts_under("p3-tor2")) == 8


def test_fat_tree_options() -> None:
    topo = fat_tree(4, hosts_per_tor=5, nics_per_host=2, accelerators_per_host=4, nic_gbps=100)
    assert len(topo.hosts) == 40 and len(topo.accelerators) == 160
    assert topo.switch("p0-tor0").ports == 12
    assert topo.path("p0-t0-h0", "p0-t0-h1").hop_gbps == (200, 200)
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: fat_tree(3), "k must be an even integer"),
        (lambda: fat_tree(4, hosts_per_tor=0), "hosts_per_tor is 0"),
        (lambda: fat_tree(4, ocs=OcsLayer(count=3, uplinks=2)), "uplinks=2 is below count=3"),
        (lambda: fat_tree(4, ocs=OcsLayer(uplinks=2, radix=8)), "radix 8 is too small"),
        (lambda: fat_tree(4, nic_gbps=0), "NIC p0-t0-h0/nic0: bandwidth (Gbit/s) is 0"),
    ]
    for bad, message in cases:
        with pytest.raises(TopologyError, match=re.escape(message)):
            bad()


def test_round_trip_through_toml(tmp_path: Path) -> None:
    topo = fat_tree(
        4, hosts_per_tor=3, ocs=OcsLayer(count=2, uplinks=2, latency=ReconfigLatency(1.5, 2, 3, 4))
    )
    assert topology_from_dict(topo.to_dict()) == topo
    dump_topology(topo, tmp_path / "tree.toml")
    back = load_topology(tmp_path / "tree.toml")
    assert back == topo and back.to_toml() == topo.to_toml()
    example_topo = load_topology(EXAMPLE)
    dump_topology(example_topo, tmp_path / "small.toml")
    assert load_topology(tmp_path / "small.toml") == example_topo


def test_toml_writer_escapes_names(tmp_path: Path) -> None:
    plan = example()
    plan["hosts"][0]["name"] = 'h"0\\é'
    topo = topology_from_dict(plan)
    dump_topology(topo, tmp_path / "odd.toml")
    assert load_topology(tmp_path / "odd.toml") == topo


@settings(max_examples=40, deadline=None)
@given(
    k=st.sampled_from([2, 4, 6]),
    hosts_per_tor=st.integers(1, 3),
    nics=st.integers(1, 2),
    accelerators=st.integers(0, 8),
    gbps=st.floats(0.5, 1600, allow_nan=False),
    layer=st.sampled_from([None, "tor", "agg"]),
    count=st.integers(1, 3),
    extra=st.integers(0, 2),
    latency=st.builds(
        ReconfigLatency,
        st.floats(0, 100),
        st.floats(0, 100),
        st.floats(0, 1000),
        st.integers(0, 8),
    ),
)
def test_random_fat_trees_round_trip(
    k: int,
    hosts_per_tor: int,
    nics: int,
    accelerators: int,
    gbps: float,
    layer: str | None,
    count: int,
    extra: int,
    latency: ReconfigLatency,
) -> None:
    ocs = None
    if layer is not None:
        ocs = OcsLayer(tier=layer, count=count, uplinks=count + extra, gbps=gbps, latency=latency)
    topo = fat_tree(
        k,
        hosts_per_tor=hosts_per_tor,
        nics_per_host=nics,
        accelerators_per_host=accelerators,
        nic_gbps=gbps,
        tor_agg_gbps=gbps * 2,
        agg_core_gbps=gbps * 4,
        ocs=ocs,
    )
    assert topology_from_dict(tomllib.loads(topo.to_toml())) == topo
    first, last = topo.hosts[0].name, topo.hosts[-1].name
    assert topo.path(first, last).bottleneck_gbps == gbps * nics


# -- random damage: a TopologyError or a valid plan, never another exception -----------------

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 12),
    st.integers(),
    st.floats(),
    st.text(max_size=4),
    st.sampled_from(["tor0:3", "tor1:7", "agg0:5", "ocs0:6", "h0:0", "tor", "agg", "core", "x:"]),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.sampled_from(["name", "gbps", "port", "a"]), st.integers(0, 3), max_size=2),
)


def _places(node: Any) -> Iterator[tuple[Any, Any]]:
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in list(items):
        yield node, key
        if isinstance(value, dict | list):
            yield from _places(value)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_damaged_plans_fail_cleanly(data: st.DataObject) -> None:
    plan = example()
    for _ in range(data.draw(st.integers(1, 3))):
        places = list(_places(plan))
        if not places:
            break
        container, key = data.draw(st.sampled_from(places))
        action = data.draw(st.sampled_from(["set", "delete", "copy", "add"]))
        if action == "set":
            container[key] = data.draw(JUNK)
        elif action == "delete":
            del container[key]
        elif action == "copy" and isinstance(container, list):
            container.append(copy.deepcopy(container[key]))
        elif action == "add" and isinstance(container, dict):
            container[data.draw(st.sampled_from(["extra", "name", "ports"]))] = data.draw(JUNK)
    try:
        topo = topology_from_dict(plan)
    except TopologyError:
        return
    assert topology_from_dict(topo.to_dict()) == topo
