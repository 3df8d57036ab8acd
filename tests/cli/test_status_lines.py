"""Lines of `orchestr status`."""

from __future__ import annotations


def test_status_says_when_an_actor_is_suspended() -> None:
    from orchestr.cli._daemons import actor_line

    row = {
        "actor_id": "a-1",
        "mesh": "Slow",
        "rank": 0,
        "state": "alive",
        "node_id": "n-1",
        "pid": 42,
        "restarts": 0,
        "max_restarts": 0,
        "suspended": False,
    }
    assert "suspended" not in actor_line(row) and "  alive  on n-1" in actor_line(row)
    row["suspended"] = True
    assert "alive (suspended: its process is stopped)  on n-1" in actor_line(row)
