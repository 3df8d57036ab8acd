"""The head's SQLite store: what it saves comes back, in WAL mode; bad files are refused."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from orchestr._cluster._headstate import HeadState
from orchestr._cluster._headstore import HeadStore, MeshRecord
from orchestr.errors import ConfigError


def test_state_round_trips_through_the_store(tmp_path: Path) -> None:
    state = HeadState()
    state.register_node("n1", "10.0.0.2:5000", {"cpu": 4}, {"zone": "x"}, now=1.0)
    (record,) = state.place("m1", "w", "pkg:Cls", 1, {"cpu": 1}, {}, {0: "a-1"})
    record.init_args = b"\x00\x01 arguments"
    record.python_path = ["/job"]
    state.actor_started("a-1", "w-1", "tcp://10.0.0.2:6000", 42, ["step"])
    store = HeadStore(tmp_path / "head.sqlite")
    state.reserve("r-1", "gang", 1, {"cpu": 2}, {"zone": "x"}, "STRICT_SPREAD")
    nodes, actors, held = state.take_dirty()
    store.save(nodes, actors, [MeshRecord("m1", "w", "pkg:Cls", 1, "PACK")], held)
    store.close()

    again = HeadStore(tmp_path / "head.sqlite")
    (node,), (actor,), (mesh,), (reservation,) = again.load()
    assert node == state.nodes["n1"]
    assert reservation == state.reservations["r-1"] and reservation.node_ids == ["n1"]
    assert actor == record and actor.init_args == b"\x00\x01 arguments"
    assert mesh.strategy == "PACK" and not mesh.stopped
    mode = sqlite3.connect(tmp_path / "head.sqlite").execute("PRAGMA journal_mode").fetchone()
    assert mode == ("wal",)


def test_jobs_and_packages_round_trip_with_their_digest(tmp_path: Path) -> None:
    store = HeadStore(tmp_path / "head.sqlite")
    store.save_job("job-1", {"job_id": "job-1", "state": "running"}, b"PK zip bytes")
    store.save_job("job-1", {"job_id": "job-1", "state": "succeeded"})  # keeps the package
    assert store.load_jobs() == [{"job_id": "job-1", "state": "succeeded"}]
    assert store.package("job-1") == b"PK zip bytes"
    assert store.package("job-2") is None
    db = sqlite3.connect(tmp_path / "head.sqlite")
    db.execute("UPDATE packages SET data = ? WHERE job_id = 'job-1'", (b"tampered",))
    db.commit()
    with pytest.raises(ConfigError, match="package of job 'job-1' is corrupt"):
        store.package("job-1")


def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "head.sqlite"
    path.write_bytes(b"this is not sqlite" * 100)
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="cannot open the head's database"):
        HeadStore(path)


def test_another_schema_is_refused_not_overwritten(tmp_path: Path) -> None:
    HeadStore(tmp_path / "head.sqlite").set_meta("schema_version", "99")
    with pytest.raises(ConfigError, match="has schema 99"):
        HeadStore(tmp_path / "head.sqlite")


def test_forgotten_actors_and_meshes_leave_the_store(tmp_path: Path) -> None:
    state = HeadState()
    state.register_node("n1", "10.0.0.2:5000", {"cpu": 4}, {}, now=1.0)
    for m in ("m1", "m2"):
        state.place(m, "w", "pkg:Cls", 1, {"cpu": 1}, {}, {0: f"a-{m}"})
    store = HeadStore(tmp_path / "head.sqlite")
    nodes, actors, _ = state.take_dirty()
    store.save(nodes, actors, [MeshRecord(m, "w", "pkg:Cls", 1, "SPREAD") for m in ("m1", "m2")])
    store.forget(["a-m1"], ["m1"])
    _, kept, meshes, _ = store.load()
    assert [a.actor_id for a in kept] == ["a-m2"] and [m.mesh_id for m in meshes] == ["m2"]
