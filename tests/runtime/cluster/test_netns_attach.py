"""The head's fabric manager over an emulated fabric another process opened: choosing the
driver (``sim`` or ``netns:TAG``) and the plans it can drive, attaching by tag, and a ToR on
several OCS ports (``examples/fabric/netns3.toml``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import orchestr as oc
from orchestr._cluster._fabric import open_fabric
from orchestr.fabric.optical import Hint, InvalidProgramError, NetnsFabric, NetnsOcs, netns_missing

pytestmark = pytest.mark.timeout(120)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "fabric"
NETNS3, SMALL = EXAMPLES / "netns3.toml", EXAMPLES / "small.toml"
MB = 10**6


def test_the_driver_is_chosen_by_name_and_the_plan_must_fit_it(tmp_path: Path) -> None:
    assert open_fabric(NETNS3, "sim").endpoints == ["tor0", "tor1", "tor2"]
    for wrong in ("bogus", "netns", "sim:x"):
        with pytest.raises(oc.ConfigError, match="unknown OCS driver .* 'netns:TAG'"):
            open_fabric(NETNS3, wrong)
    with pytest.raises(oc.ConfigError, match=r"every port of ocs0 wired; ports \[4, 5, 6, 7\]"):
        open_fabric(SMALL, "netns:abcdef")
    two = tmp_path / "two.toml"
    two.write_text(NETNS3.read_text() + '\n[[ocs]]\nname = "ocs1"\nradix = 2\n')
    with pytest.raises(oc.ConfigError, match="emulates one OCS; the plan has 2"):
        open_fabric(two, "netns:abcdef")


@pytest.fixture
async def fab() -> AsyncIterator[NetnsFabric]:
    why = netns_missing()
    if why is not None:
        pytest.skip(why)
    async with NetnsFabric(["tor0", "tor1", "tor2", "head"], electrical_mbit=10) as f:
        yield f
    assert f.leftovers() == []


async def test_an_attached_fabric_is_the_same_fabric(fab: NetnsFabric) -> None:
    await asyncio.to_thread(fab.connect, "tor1", "tor2")
    other = await asyncio.to_thread(NetnsFabric.attach, fab.tag)
    assert (other.hosts, other.subnet, other.circuit_subnet) == (
        fab.hosts,
        fab.subnet,
        fab.circuit_subnet,
    )
    assert (other.electrical_mbit, other.circuit_mbit) == (10, fab.circuit_mbit)
    assert other.address("head") == fab.address("head")
    await asyncio.to_thread(other.route_circuit, "tor1", "tor2")  # knows the circuit's subnet
    assert await asyncio.to_thread(fab.route_device, "tor1", "tor2") == "ckt2"
    await asyncio.to_thread(other.connect, "tor0", "tor1")  # and takes a free one
    assert await asyncio.to_thread(fab.circuits) == {("tor0", "tor1"), ("tor1", "tor2")}
    await asyncio.to_thread(other.close)  # not its maker: the namespaces stay
    assert len(await asyncio.to_thread(fab.leftovers)) == 5
    for tag, error in (("nope", "6 hex digits"), ("abcdef", "no emulated fabric abcdef")):
        with pytest.raises(oc.ConfigError, match=error):
            open_fabric(NETNS3, f"netns:{tag}")


async def test_a_fabric_not_named_after_the_tors_is_refused() -> None:
    why = netns_missing()
    if why is not None:
        pytest.skip(why)
    async with NetnsFabric(["h0", "h1", "h2"]) as f:
        with pytest.raises(oc.ConfigError, match="has hosts h0, h1, h2, but ocs0 reaches tor0"):
            open_fabric(NETNS3, f"netns:{f.tag}")


async def test_the_manager_drives_the_emulation_by_tag(fab: NetnsFabric) -> None:
    manager = await asyncio.to_thread(open_fabric, NETNS3, f"netns:{fab.tag}")
    weights = {("tor1", "tor0"): 0.4 * MB, ("tor1", "tor2"): 0.4 * MB}
    record = await manager.hint(Hint("job", "weight_sync", weights))
    assert record.status == "applied", record
    assert record.add == (("tor0", "tor1", 1), ("tor1", "tor2", 1))
    assert await asyncio.to_thread(fab.circuits) == {("tor0", "tor1"), ("tor1", "tor2")}
    for peer in ("tor0", "tor2"):  # routed onto the circuits
        device = await asyncio.to_thread(fab.route_device, "tor1", peer)
        assert device == fab.circuit_device("tor1", peer)
    # tor1's two circuits are on its two OCS ports; a driver reads them back by their labels
    host = ["tor0", "tor0", "tor1", "tor1", "tor2", "tor2"]
    [ocs] = manager.show()["ocs"]
    live = {(p, q) for p, q, *_ in ocs["circuits"]}
    assert sorted(sorted({host[p], host[q]}) for p, q in live) == [
        ["tor0", "tor1"],
        ["tor1", "tor2"],
    ]
    other = NetnsOcs(fab, host)
    assert await other.circuits() == (1, live)
    # the emulation cannot join two hosts twice, nor a host to itself: refused, unchanged
    [(p1, p2)] = [(p, q) for p, q in live if {host[p], host[q]} == {"tor1", "tor2"}]
    [free0] = {0, 1} - {p for c in live for p in c}
    with pytest.raises(InvalidProgramError, match="tor0 and tor1 would have two circuits"):
        await other.program(2, [(free0, p1)], [(p1, p2)])
    with pytest.raises(InvalidProgramError, match="both ports are cabled to host tor2"):
        await other.program(2, [(p2, 9 - p2)], [(p1, p2)])
    assert await other.circuits() == (1, live)
