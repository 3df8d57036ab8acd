"""The head daemon's durable state: one SQLite database in WAL mode under the state directory.

It holds what a restarted head needs to carry on: the nodes it knew, the meshes and actors it
placed (with their constructor arguments, to restart them), and the submitted jobs with their
working-directory packages. The head writes through to it after each change (see
:meth:`HeadStore.save`); a head killed with SIGKILL loses at most the change in flight, and
SQLite's journal keeps the file consistent whatever the moment.

``synchronous=NORMAL`` in WAL mode survives a crash of the process (the case here); a power
loss may lose the last transactions, never the database.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from orchestr.errors import ConfigError, OrchestrError

from ._records import ActorRecord, NodeRecord, Reservation
from ._statedir import check_private_file

__all__ = ["STORE_FILE", "HeadStore", "MeshRecord", "StoreWriteError"]

STORE_FILE = "head.sqlite"
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (node_id TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meshes (mesh_id TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS actors (
    actor_id TEXT PRIMARY KEY,
    mesh_id TEXT NOT NULL,
    record TEXT NOT NULL,
    init_args BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS reservations (reservation_id TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS packages (
    job_id TEXT PRIMARY KEY,
    sha256 TEXT NOT NULL,
    data BLOB NOT NULL
);
"""


@dataclasses.dataclass
class MeshRecord:
    mesh_id: str
    name: str
    class_path: str
    size: int
    strategy: str
    created_unix: float = dataclasses.field(default_factory=time.time)
    stopped: bool = False


class HeadStore:
    """The head's SQLite database. One thread (the head's event loop) uses it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # made private before SQLite opens it (its WAL and shared-memory files take the same
        # mode), and refused if it is a link or not this user's own
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot open the head's database {path}: {exc.strerror}") from None
        try:
            check_private_file(path, os.fstat(fd))
        finally:
            os.close(fd)
        try:
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=True)
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            version = self.get_meta("schema_version")
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"cannot open the head's database {path}: {exc}") from None
        if mode.lower() != "wal":
            raise ConfigError(f"the head's database {path} cannot use WAL mode (got {mode})")
        if version is None:
            self.set_meta("schema_version", str(SCHEMA_VERSION))
        elif version != str(SCHEMA_VERSION):
            raise ConfigError(
                f"the head's database {path} has schema {version}; this orchestr reads "
                f"{SCHEMA_VERSION} (move the state directory aside to start afresh)"
            )

    def close(self) -> None:
        self._db.close()

    # -- meta ----------------------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        self._db.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    # -- cluster state -------------------------------------------------------------------
    def save(
        self,
        nodes: Iterable[NodeRecord] = (),
        actors: Iterable[ActorRecord] = (),
        meshes: Iterable[MeshRecord] = (),
        reservations: Iterable[Reservation] = (),
    ) -> None:
        """Write these records (inserted or replaced) in one transaction."""
        node_rows = [(n.node_id, json.dumps(dataclasses.asdict(n))) for n in nodes]
        actor_rows = [(a.actor_id, a.mesh_id, _actor_json(a), a.init_args) for a in actors]
        mesh_rows = [(m.mesh_id, json.dumps(dataclasses.asdict(m))) for m in meshes]
        held_rows = [(r.reservation_id, json.dumps(dataclasses.asdict(r))) for r in reservations]
        if not (node_rows or actor_rows or mesh_rows or held_rows):
            return
        with self._transaction():
            self._db.executemany("INSERT OR REPLACE INTO nodes VALUES (?, ?)", node_rows)
            self._db.executemany("INSERT OR REPLACE INTO actors VALUES (?, ?, ?, ?)", actor_rows)
            self._db.executemany("INSERT OR REPLACE INTO meshes VALUES (?, ?)", mesh_rows)
            self._db.executemany("INSERT OR REPLACE INTO reservations VALUES (?, ?)", held_rows)

    def forget(self, actor_ids: Iterable[str] = (), mesh_ids: Iterable[str] = ()) -> None:
        """Delete these actors and meshes (ended long ago; see ``HeadState.prune``)."""
        actor_rows = [(i,) for i in actor_ids]
        mesh_rows = [(i,) for i in mesh_ids]
        if not (actor_rows or mesh_rows):
            return
        with self._transaction():
            self._db.executemany("DELETE FROM actors WHERE actor_id = ?", actor_rows)
            self._db.executemany("DELETE FROM meshes WHERE mesh_id = ?", mesh_rows)

    def load(
        self,
    ) -> tuple[list[NodeRecord], list[ActorRecord], list[MeshRecord], list[Reservation]]:
        """Every node, actor, mesh and reservation saved, as records."""
        nodes = [
            NodeRecord(**json.loads(r[0])) for r in self._db.execute("SELECT record FROM nodes")
        ]
        actors = []
        for record, init_args in self._db.execute("SELECT record, init_args FROM actors"):
            fields = json.loads(record)
            fields["init_args"] = bytes(init_args)
            actors.append(ActorRecord(**fields))
        meshes = [
            MeshRecord(**json.loads(r[0])) for r in self._db.execute("SELECT record FROM meshes")
        ]
        held = [
            Reservation(**json.loads(r[0]))
            for r in self._db.execute("SELECT record FROM reservations")
        ]
        return nodes, actors, meshes, held

    # -- jobs ----------------------------------------------------------------------------
    def save_job(self, job_id: str, record: dict[str, Any], package: bytes | None = None) -> None:
        with self._transaction():
            self._db.execute(
                "INSERT OR REPLACE INTO jobs VALUES (?, ?)", (job_id, json.dumps(record))
            )
            if package is not None:
                self._db.execute(
                    "INSERT OR REPLACE INTO packages VALUES (?, ?, ?)",
                    (job_id, hashlib.sha256(package).hexdigest(), package),
                )

    def delete_package(self, job_id: str) -> None:
        with self._transaction():
            self._db.execute("DELETE FROM packages WHERE job_id = ?", (job_id,))

    def load_jobs(self) -> list[dict[str, Any]]:
        return [
            json.loads(r[0]) for r in self._db.execute("SELECT record FROM jobs ORDER BY job_id")
        ]

    def package(self, job_id: str) -> bytes | None:
        """A job's package as it arrived, checked against its stored digest."""
        row = self._db.execute(
            "SELECT sha256, data FROM packages WHERE job_id = ?", (job_id,)
        ).fetchone()
        if row is None:
            return None
        data = bytes(row[1])
        if hashlib.sha256(data).hexdigest() != row[0]:
            raise ConfigError(f"the stored package of job {job_id!r} is corrupt (digest differs)")
        return data

    def _transaction(self) -> Any:
        return _Transaction(self._db, self.path)


class StoreWriteError(OrchestrError):
    """A write to the head's database failed (disk full, I/O error); nothing of it was kept.
    Its message names the database and SQLite's reason."""


class _Transaction:
    """One write transaction. A failure anywhere in it (SQLite's own included: a full disk
    can fail the COMMIT, and may have rolled the transaction back already) is raised as
    :class:`StoreWriteError` with SQLite's reason, never as the rollback's own complaint."""

    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        self._db = db
        self._path = path

    def __enter__(self) -> None:
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise self._failed(exc) from exc

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            try:
                self._db.execute("COMMIT")
                return
            except sqlite3.Error as commit_error:
                exc = commit_error
        if self._db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
        if isinstance(exc, sqlite3.Error):
            raise self._failed(exc) from exc

    def _failed(self, exc: sqlite3.Error) -> StoreWriteError:
        return StoreWriteError(
            f"cannot write the head's database {self._path}: {exc} (is its disk full?)"
        )


def _actor_json(a: ActorRecord) -> str:
    fields = dataclasses.asdict(a)
    del fields["init_args"]  # a blob column of its own
    return json.dumps(fields)
