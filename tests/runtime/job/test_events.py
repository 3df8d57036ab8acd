"""The event log and its Chrome/Perfetto trace."""

from __future__ import annotations

import json
import os
import pathlib
import threading
from typing import Any

import pytest

import orchestr as oc
from orchestr._job._events import EventLog, export_trace, read_events
from orchestr.errors import ConfigError
from tests.cluster import open_cluster
from tests.runtime.actors import Counter


def test_events_spans_and_the_trace(tmp_path: pathlib.Path) -> None:
    log_path, trace_path = tmp_path / "events.jsonl", tmp_path / "trace.json"
    with EventLog(log_path) as log:
        log.record("spawn", mesh="gen", size=2)
        with log.span("generation", track="phases", kind="phase", version=3):
            with log.span("gen.step", track="gen[0]", kind="call"):
                pass
            with pytest.raises(ZeroDivisionError), log.span("reward", track="rew[0]", kind="call"):
                1 / 0  # noqa: B018
        log.record("restart", actor="gen[1]", reason="SIGKILL")
    events = read_events(log_path)
    assert [e["kind"] for e in events] == ["spawn", "call", "call", "phase", "restart"]
    phase = events[3]
    assert phase["name"] == "generation" and phase["version"] == 3 and phase["dur"] >= 0
    assert events[2]["error"] == "ZeroDivisionError: division by zero"
    assert phase["ts"] <= events[1]["ts"]  # a span is stamped with its start

    assert export_trace(log_path, trace_path) == 5
    trace = json.loads(trace_path.read_text())
    names = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert set(names) == {"job", "phases", "gen[0]", "rew[0]"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in spans} == {"generation"}  # calls may overlap: async slices
    begins = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "b"}
    ends = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "e"}
    assert set(begins) == {"gen.step", "reward"}
    for e in spans + list(begins.values()):
        assert e["ts"] >= 0 and e["pid"] == 1
    gen = spans[0]
    step, step_end = begins["gen.step"], ends[begins["gen.step"]["id"]]
    assert gen["ts"] <= step["ts"] <= step_end["ts"] <= gen["ts"] + gen["dur"] + 1
    assert gen["tid"] == names["phases"] and gen["cat"] == "phase"
    instants = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert [e["name"] for e in instants] == ["spawn", "restart"]
    assert instants[1]["args"] == {"actor": "gen[1]", "reason": "SIGKILL"}


def test_threads_write_whole_lines(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        threads = [
            threading.Thread(target=lambda i=i: [log.record("tick", i=i, n=n) for n in range(200)])
            for i in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(read_events(path)) == 800


def test_bad_events_and_bad_logs_get_clear_errors(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    with pytest.raises(ConfigError, match="non-empty string"):
        log.record("")
    with pytest.raises(ConfigError, match="not JSON"):
        log.record("spawn", value=object())
    with pytest.raises(ConfigError, match="not JSON"):
        log.record("spawn", value=float("nan"))
    log.record("ok")
    log.close()
    log.close()  # idempotent
    with pytest.raises(ConfigError, match="closed"):
        log.record("late")
    assert [e["kind"] for e in read_events(path)] == ["ok"]  # the refused ones wrote nothing
    path.write_text('{"ts": 1, "kind": "a"}\n{not json\n')
    with pytest.raises(ConfigError, match=r"events.jsonl:2 is not a JSON line"):
        read_events(path)
    path.write_text('{"ts": 1}\n')
    with pytest.raises(ConfigError, match=":1 is not an event"):
        read_events(path)


def _load_trace(path: pathlib.Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = json.loads(path.read_text())["traceEvents"]
    return events


async def test_calls_from_the_job_are_spans_in_its_log_and_trace() -> None:
    async with open_cluster() as ctx:
        mesh = await ctx.spawn(Counter, n=2, name="traced")
        await mesh.add.call(1)
        with pytest.raises(oc.ActorError):
            await mesh[0].fail.call_one("no")
        session = ctx.session_dir
    calls = [e for e in read_events(os.path.join(session, "events.jsonl")) if e["kind"] == "call"]
    assert sorted(e["name"] for e in calls) == ["traced[0].add", "traced[0].fail", "traced[1].add"]
    assert [e.get("error") for e in calls if e["name"].endswith("fail")] == ["failed"]
    assert all(e["dur"] >= 0 and e["track"].startswith("calls to traced[") for e in calls)
    trace = _load_trace(pathlib.Path(session, "trace.json"))
    begins = [e for e in trace if e["ph"] == "b" and e["cat"] == "call"]
    ends = {e["id"]: e for e in trace if e["ph"] == "e"}
    assert len(begins) == 3 and all(ends[b["id"]]["ts"] >= b["ts"] for b in begins)


def test_call_spans_can_be_turned_off() -> None:
    assert oc.load_config({"ORCHESTR_CALL_SPANS_PER_S": "0"}).call_spans_per_s == 0
    with pytest.raises(oc.ConfigError, match="call_spans_per_s must be from 0"):
        oc.load_config({"ORCHESTR_CALL_SPANS_PER_S": "-1"})


def test_a_full_log_counts_what_it_drops_and_the_export_streams(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, max_bytes=2000)
    for i in range(100):
        log.record("tick", i=i)
    log.record_calls([(1.0, 2.0, "a", "b", True)] * 10)
    log.close()
    events = read_events(path)
    kept = [e for e in events if e["kind"] == "tick"]
    assert 0 < len(kept) < 100 and path.stat().st_size < 2200
    last = events[-1]
    assert last["kind"] == "events_dropped"
    assert last["by_kind"] == {"tick": 100 - len(kept), "call": 10}
    trace = tmp_path / "trace.json"
    assert export_trace(path, trace) == len(events)
    loaded = json.loads(trace.read_text())
    assert sum(1 for e in loaded["traceEvents"] if e.get("cat") == "tick") == len(kept)
