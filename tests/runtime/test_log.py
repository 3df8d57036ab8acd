"""Daemon logs: rotation by size, oldest dropped."""

from __future__ import annotations

import json
import pathlib


def test_daemon_logs_rotate(tmp_path: pathlib.Path) -> None:
    from orchestr._log import RotatingFile

    log = RotatingFile(str(tmp_path / "d.jsonl"), max_bytes=100, backups=2)
    for i in range(12):
        log.write(f'{{"n": {i:2d}, "pad": "{"x" * 20}"}}\n')  # 41 bytes: 2 lines a file
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["d.jsonl", "d.jsonl.1", "d.jsonl.2"]  # the oldest dropped
    assert all(p.stat().st_size <= 100 for p in tmp_path.iterdir())
    lines = [
        json.loads(x)["n"]
        for f in ("d.jsonl.2", "d.jsonl.1", "d.jsonl")
        for x in (tmp_path / f).read_text().splitlines()
    ]
    assert lines == list(range(6, 12))  # in order; only what rotated out of .2 is gone
