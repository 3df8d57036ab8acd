"""Phases: declarations, the fabric-hint seam, and the job's event log and trace."""

from __future__ import annotations

import json
import os

import pytest

import orchestr as oc
from orchestr._job._events import read_events
from orchestr._job._phases import RecordingHints, make_phase
from tests.cluster import open_cluster
from tests.runtime.actors import Counter


def _load(path: str) -> dict[str, list[dict[str, object]]]:
    with open(path) as f:
        return json.load(f)


async def test_phases_reach_the_hints_first_and_land_in_the_log_and_trace() -> None:
    async with open_cluster() as ctx:
        hints = ctx.hints
        assert isinstance(hints, RecordingHints)
        counters = await ctx.spawn(Counter, name="gen", n=2)
        traffic = {("trainer", "gen"): 64 << 20}
        async with ctx.phase("generation", traffic=traffic, expected_s=2.0) as phase:
            assert hints.seen == [("upcoming", phase)]  # told before the block runs
            assert ctx.current_phase is phase
            await counters.add.call(1)
            async with ctx.phase("weight_sync", traffic=oc.Collective("broadcast", "gen", 1024)):
                assert ctx.current_phase is not None and ctx.current_phase.name == "weight_sync"
        assert ctx.current_phase is None
        assert [(what, p.name) for what, p in hints.seen] == [
            ("upcoming", "generation"),
            ("upcoming", "weight_sync"),
            ("ended", "weight_sync"),
            ("ended", "generation"),
        ]
        with pytest.raises(ZeroDivisionError):
            async with ctx.phase("training"):
                1 / 0  # noqa: B018
        assert ctx.current_phase is None and hints.seen[-1][0] == "ended"
        session = ctx.session_dir
    events = read_events(os.path.join(session, "events.jsonl"))
    assert [e["kind"] for e in events if e["kind"] != "call"] == [
        "spawn",
        "phase",
        "phase",
        "phase",
    ]
    gen = next(e for e in events if e.get("name") == "generation")
    assert gen["traffic"] == [["trainer", "gen", 64 << 20]] and gen["expected_s"] == 2.0
    sync = next(e for e in events if e.get("name") == "weight_sync")
    assert sync["traffic"] == {"kind": "broadcast", "mesh": "gen", "nbytes": 1024}
    assert next(e for e in events if e.get("name") == "training")["error"].startswith(
        "ZeroDivisionError"
    )
    trace = _load(os.path.join(session, "trace.json"))["traceEvents"]
    assert {e["name"] for e in trace if e["ph"] == "X"} == {"generation", "weight_sync", "training"}


@pytest.mark.parametrize(
    ("name", "traffic", "expected_s", "match"),
    [
        ("", None, None, "phase name"),
        ("two words", None, None, "phase name"),
        ("gen", {("a",): 1}, None, "traffic keys"),
        ("gen", {("a", "b"): -1}, None, "non-negative"),
        ("gen", {("a", "b"): 1.5}, None, "non-negative integer"),
        ("gen", [1, 2], None, "Collective"),
        ("gen", None, 0, "positive number"),
    ],
)
def test_bad_phase_declarations_are_refused(
    name: str, traffic: object, expected_s: object, match: str
) -> None:
    with pytest.raises(oc.ConfigError, match=match):
        make_phase(name, traffic, expected_s)


def test_bad_collectives_are_refused() -> None:
    with pytest.raises(oc.ConfigError, match="collective kind"):
        oc.Collective("gossip", "gen", 1)
    with pytest.raises(oc.ConfigError, match="names its mesh"):
        oc.Collective("broadcast", "", 1)
    with pytest.raises(oc.ConfigError, match="non-negative"):
        oc.Collective("all_reduce", "gen", -5)
