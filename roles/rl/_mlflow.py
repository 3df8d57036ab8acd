"""An RL run's record in a local MLflow store (``[run] mlflow``): :func:`mlflow_store` checks and
resolves the setting when the run is planned (before any process starts, without importing
MLflow); :class:`MlflowLog` writes the run there as it goes, beside its run folder.

Local stores only. A plain folder is a SQLite store in it (``mlflow.db``, the artifacts in
``mlartifacts/``): SQLite is MLflow 3's own default, and its folder store (``file:``) is in
maintenance mode, opened only with ``MLFLOW_ALLOW_FILE_STORE=true`` (``file:`` URIs are taken
when that is set). A tracking server (``http(s)://``, Databricks, a database server) is
refused: a run's steps must not wait on a network, nor fail with it. MLflow is imported only by
a run that logs to it (``mlflow-skinny``, with SQLAlchemy and Alembic for SQLite: the ``rl``
extra).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog

import orchestr as oc

from ._rlconfig import RunSection

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

__all__ = ["RUN_ID_FILE", "MlflowLog", "MlflowStore", "flat", "mlflow_store"]

log = structlog.get_logger("orchestr.roles.rl")

#: The run folder's note of its MLflow run (the store and the run's id), read by ``--resume``.
RUN_ID_FILE = "mlflow.json"
_SERVERS = ("databricks", "databricks-uc", "uc")
_FORMS = "a folder, sqlite:///FILE.db or file:FOLDER"
# MLflow's limits (mlflow.utils.validation): a param's value, params and tags a batch
_PARAM_CHARS, _BATCH = 6000, 100


@dataclasses.dataclass(frozen=True)
class MlflowStore:
    """Where a run is logged: MLflow's ``tracking_uri`` (absolute), the ``experiment``, and
    where a new experiment keeps its artifacts (``artifact_root``; None: the store's own)."""

    tracking_uri: str
    experiment: str
    artifact_root: str | None


def mlflow_store(run: RunSection, source: str) -> MlflowStore | None:
    """The store ``run.mlflow`` names, relative paths taken from the working directory (as
    ``run.dir``'s are); None when unset. Raises :class:`ConfigError` for a server's URI, a
    malformed one, or a store whose packages are not installed. Imports nothing; idempotent."""
    if run.mlflow is None:
        return None
    where = f"{source}: [run] mlflow {run.mlflow!r}"
    value = run.mlflow.strip()
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]+):", value)
    scheme = match.group(1).lower() if match else ""
    if value.lower() in _SERVERS or scheme not in ("", "file", "sqlite"):
        raise oc.ConfigError(
            f"{where}: a run logs to a local MLflow store only ({_FORMS}), not to a server; "
            "copy a local store to a server with MLflow's own tools"
        )
    if not value:
        raise oc.ConfigError(f"{where}: give {_FORMS}, or leave mlflow out")
    if not run.mlflow_experiment.strip():
        raise oc.ConfigError(f"{source}: [run] mlflow_experiment must name an experiment")
    needs = ["mlflow"]
    if scheme == "file":
        store = _file_store(value, where, run.mlflow_experiment)
    else:
        needs += ["sqlalchemy", "alembic"]
        if scheme == "sqlite":
            path, sep, query = value[len("sqlite:///") :].partition("?")
            if not value.startswith("sqlite:///") or not path:
                raise oc.ConfigError(f"{where}: write sqlite:///FILE.db (a file; relative or not)")
            db = os.path.abspath(path)
            uri = "sqlite:///" + db + sep + query
        else:
            db = os.path.join(os.path.abspath(value), "mlflow.db")
            uri = "sqlite:///" + db
        artifacts = os.path.join(os.path.dirname(db), "mlartifacts")
        store = MlflowStore(uri, run.mlflow_experiment, artifacts)
    missing = [name for name in needs if importlib.util.find_spec(name) is None]
    if missing:
        raise oc.ConfigError(
            f"{where}: logging to MLflow needs {', '.join(missing)}, not installed here: "
            "pip install 'orchestr[rl]' (or leave mlflow out)"
        )
    return store


def _file_store(value: str, where: str, experiment: str) -> MlflowStore:
    parts = urllib.parse.urlsplit(value)
    if parts.netloc not in ("", "localhost") or not parts.path:
        raise oc.ConfigError(f"{where}: write file:FOLDER or file:///FOLDER (a local folder)")
    if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
        raise oc.ConfigError(
            f"{where}: MLflow 3 opens its folder store only with MLFLOW_ALLOW_FILE_STORE=true; "
            "set it, or give a plain folder (a SQLite store is made in it)"
        )
    folder = os.path.abspath(urllib.parse.unquote(parts.path))
    return MlflowStore(pathlib.Path(folder).as_uri(), experiment, None)


def flat(table: Any, prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """``table``'s leaves by their dotted path (``schedule.steps``, ``reward.0.function``); a
    list of plain values is one leaf, an empty table none."""
    items: Any
    if isinstance(table, dict):
        items = table.items()
    elif isinstance(table, list) and any(isinstance(v, dict | list) for v in table):
        items = enumerate(table)
    else:
        return {prefix: table}
    out: dict[str, Any] = {}
    for key, value in items:
        out |= flat(value, f"{prefix}{sep}{key}" if prefix else str(key), sep)
    return out


def _name(key: str) -> str:
    """``key`` as MLflow takes a name: letters, digits and ``_-. :/`` only, no empty, ``.``
    or ``..`` path part (each other character becomes ``_``)."""
    key = re.sub(r"[^A-Za-z0-9_\-. :/]", "_", key)
    return "/".join(p for p in key.split("/") if p not in ("", ".", "..")) or "_"


def _text(value: Any) -> str:
    return (value if isinstance(value, str) else json.dumps(value))[:_PARAM_CHARS]


@contextlib.contextmanager
def _store_errors(uri: str) -> Iterator[None]:
    """MLflow's errors (and the disk's) as :class:`ConfigError`: the one place they cross."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except (MlflowException, OSError) as exc:
        raise oc.ConfigError(
            f"the MLflow store {uri}: {exc}; check it (or leave run.mlflow out)"
        ) from exc


class MlflowLog:
    """The run's MLflow run, written as the run goes. Each call blocks on the store's disk
    writes (milliseconds for SQLite), raises :class:`ConfigError` when the store fails, and is
    not thread-safe; :meth:`end` is idempotent."""

    def __init__(self, client: MlflowClient, store: MlflowStore, run_id: str) -> None:
        self.client, self.store, self.run_id = client, store, run_id
        self.ended = False

    @classmethod
    def open(
        cls,
        store: MlflowStore,
        run_dir: str,
        *,
        tags: Mapping[str, str],
        params: Mapping[str, Any],
        resume: bool,
    ) -> MlflowLog:
        """Start a run in ``store`` named after ``run_dir`` (its id noted there in
        :data:`RUN_ID_FILE`), or with ``resume`` reopen the run that note names (when it is in
        this store; else start one). ``params`` already logged are kept: MLflow never changes
        a param, and a resumed run's ``run.*`` and ``schedule.steps`` may differ."""
        from mlflow.tracking import MlflowClient

        note = os.path.join(run_dir, RUN_ID_FILE)
        with _store_errors(store.tracking_uri):
            if store.tracking_uri.startswith("sqlite:///"):  # SQLite makes the file, not its folder
                db = store.tracking_uri[len("sqlite:///") :].partition("?")[0]
                os.makedirs(os.path.dirname(db), exist_ok=True)
            client = MlflowClient(store.tracking_uri)
            run_id = _noted_run(client, store, note) if resume else None
            if run_id is not None:
                client.update_run(run_id, status="RUNNING")
                logged = set(client.get_run(run_id).data.params)
            else:
                experiment = _experiment(client, store)
                run = client.create_run(
                    experiment, tags=dict(tags), run_name=os.path.basename(run_dir)
                )
                run_id, logged = run.info.run_id, set()
        with open(note, "w", encoding="utf-8") as f:
            json.dump({"tracking_uri": store.tracking_uri, "run_id": run_id}, f)
        opened = cls(client, store, run_id)
        opened._params({_name(k): v for k, v in params.items() if v is not None}, logged)
        return opened

    def _params(self, params: Mapping[str, Any], logged: set[str]) -> None:
        from mlflow.entities import Param

        todo = [Param(k, _text(v)) for k, v in sorted(params.items()) if k not in logged]
        with _store_errors(self.store.tracking_uri):
            for i in range(0, len(todo), _BATCH):
                self.client.log_batch(self.run_id, params=todo[i : i + _BATCH])

    def log(self, row: Mapping[str, Any], step: int, prefix: str = "") -> None:
        """``row``'s numbers (nested tables by ``/``-joined names, ``kind`` and ``step`` left
        out) as metrics at ``step``. A step logged again (a resumed run redoes the batches
        after its checkpoint) is not replaced: MLflow keeps every value in the metric's
        history, the redone one after the first."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = flat({k: v for k, v in row.items() if k not in ("kind", "step")}, sep="/")
        metrics = [
            Metric(_name(prefix + key), float(value), now, step)
            for key, value in values.items()
            if isinstance(value, int | float)
        ]
        with _store_errors(self.store.tracking_uri):
            self.client.log_batch(self.run_id, metrics=metrics)

    def end(self, *, failed: bool, artifacts: Sequence[str] = ()) -> None:
        """Log ``artifacts`` (files) and end the run, ``FINISHED`` or ``FAILED``. A failed
        run's end only warns when the store fails too: the run's own error is the one to
        raise."""
        if self.ended:
            return
        self.ended = True
        try:
            with _store_errors(self.store.tracking_uri):
                for path in artifacts:
                    self.client.log_artifact(self.run_id, path)
                self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
        except oc.ConfigError as exc:
            if not failed:
                raise
            log.warning("mlflow_end_failed", run_id=self.run_id, error=str(exc))


def _noted_run(client: MlflowClient, store: MlflowStore, note: str) -> str | None:
    """The run id ``note`` holds, when it is a run of this store."""
    from mlflow.exceptions import MlflowException

    try:
        with open(note, encoding="utf-8") as f:
            noted = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(noted, dict) or noted.get("tracking_uri") != store.tracking_uri:
        return None
    try:
        return str(client.get_run(str(noted.get("run_id"))).info.run_id)
    except MlflowException:
        return None


def _experiment(client: MlflowClient, store: MlflowStore) -> str:
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(store.experiment)
    if found is None:
        try:
            return client.create_experiment(store.experiment, store.artifact_root)
        except MlflowException:  # made meanwhile by another run
            found = client.get_experiment_by_name(store.experiment)
            if found is None:
                raise
    if found.lifecycle_stage != "active":
        raise oc.ConfigError(
            f"the MLflow experiment {store.experiment!r} in {store.tracking_uri} is deleted: "
            "restore it (mlflow experiments restore) or name another (run.mlflow_experiment)"
        )
    return str(found.experiment_id)
