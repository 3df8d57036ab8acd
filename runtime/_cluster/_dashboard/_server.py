"""The dashboard's shell in the head: it gathers what each page shows (the head's records, a
scrape of the workers' metrics, the jobs' event logs, the fabric manager) and serves the app
(:mod:`._app`) with uvicorn on ``Config.dashboard_port``, in the head's event loop.

Scrapes are shared: however many browsers watch, the workers are asked at most once every
``refresh_s`` seconds, and only while a serving page is open. The serving page's rates and
percentiles are over the window since a scrape at least :data:`WINDOW_S` seconds older.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from orchestr.config import Config
from orchestr.errors import ConfigError
from orchestr.tasks import TaskOwner

from ._tail import EventTail
from ._view import Scrape, curve, meshes_view, nodes_view, serving_view, timeline

if TYPE_CHECKING:
    from .._head import HeadService

__all__ = ["DashboardServer", "WatchedJob"]

log = structlog.get_logger("orchestr.dashboard")

#: Seconds between a stream's looks for a change (and between scrapes, at most one each).
REFRESH_S = 1.0
#: Seconds the serving page's rates and percentiles reach back (at least).
WINDOW_S = 10.0
#: Scrapes kept for those windows.
SCRAPES_KEPT = 64
#: Connections served at once.
MAX_CONNECTIONS = 64


@dataclasses.dataclass
class WatchedJob:
    """A job the dashboard shows beside the submitted ones: an embedded cluster's own, or one
    whose controller sends its event log from elsewhere (:mod:`._attached`)."""

    job_id: str
    title: str
    session_dir: str
    started_unix: float = dataclasses.field(default_factory=time.time)
    state: str = "running"


class DashboardServer:
    """Serves the dashboard for ``head``. :meth:`start` and :meth:`aclose` bound its life."""

    def __init__(self, head: HeadService, config: Config, refresh_s: float = REFRESH_S) -> None:
        self.head = head
        self.config = config
        self.refresh_s = refresh_s
        #: ``host:port`` it listens on once started; ``None`` when the dashboard is off.
        self.address: str | None = None
        #: Jobs shown beside the submitted ones (:meth:`watch_job`).
        self.watched: dict[str, WatchedJob] = {}
        self._tails: dict[str, EventTail] = {}
        self._tail_lock = asyncio.Lock()
        self._scrapes: collections.deque[Scrape] = collections.deque(maxlen=SCRAPES_KEPT)
        self._scraping = asyncio.Lock()
        self._closing = asyncio.Event()
        self._tasks = TaskOwner()
        self._server: Any = None
        self._serving: asyncio.Task[None] | None = None

    # -- life ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Listen on ``Config.bind_host`` and ``Config.dashboard_port`` (none when -1); over
        HTTPS with the process's certificate when ``tls_cert`` is set. Raises
        :class:`ConfigError` when the port cannot be bound. Idempotent."""
        port = self.config.dashboard_port
        if port < 0 or self._server is not None:
            return
        import uvicorn

        from ._app import dashboard_app  # starlette and jinja2, only for a head that serves

        ready = asyncio.Event()

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield  # the head's own handlers stop it

            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                try:
                    await super().startup(sockets=sockets)
                finally:
                    ready.set()

        host = self.config.bind_host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise ConfigError(
                f"cannot serve the dashboard on {host}:{port}: {exc.strerror}; set "
                "ORCHESTR_DASHBOARD_PORT to a free port, 0 for any, or -1 for no dashboard"
            ) from None
        tls = bool(self.config.tls_cert)
        app = dashboard_app(
            self.config.metrics_token, self._render, self.refresh_s, self._closing, secure=tls
        )
        settings = uvicorn.Config(
            app,
            log_config=None,
            log_level="warning",
            access_log=False,  # nothing of a request reaches a log
            lifespan="off",
            timeout_graceful_shutdown=2,
            # past this many connections (open pages hold one each), 503: a flood of them
            # costs the head no more than this
            limit_concurrency=MAX_CONNECTIONS,
            ssl_certfile=self.config.tls_cert or None,
            ssl_keyfile=self.config.tls_key or None,
        )
        server = self._server = Server(settings)
        task = self._serving = self._tasks.start(server.serve(sockets=[sock]))
        waiting = self._tasks.start(ready.wait())
        await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if task.done() or not server.started:
            sock.close()
            self._server = self._serving = None
            if task.done():
                task.result()  # its error
            raise ConfigError("the dashboard's server stopped as it started")
        self.address = f"{host}:{sock.getsockname()[1]}"
        scheme = "https" if tls else "http"
        log.info("dashboard served", url=f"{scheme}://{self.address}/")

    async def aclose(self) -> None:
        """Stop serving: streams end, then the server. Idempotent."""
        self._closing.set()
        if self._server is not None:
            self._server.should_exit = True  # seen within 0.1 s; then it closes its socket
            if self._serving is not None:
                await asyncio.wait({self._serving}, timeout=5.0)
        await self._tasks.aclose()
        self._server = self._serving = None

    # -- jobs ------------------------------------------------------------------------------
    def watch_job(self, job_id: str, title: str, session_dir: str) -> WatchedJob:
        """Show the job ``job_id`` whose event log is in ``session_dir``; returns its entry,
        whose ``state`` its owner sets when it ends."""
        entry = self.watched[job_id] = WatchedJob(job_id, title, session_dir)
        return entry

    def forget_job(self, job_id: str) -> None:
        """Show the watched job ``job_id`` no more (nothing when it is not watched)."""
        self.watched.pop(job_id, None)
        self._tails.pop(job_id, None)

    def _jobs(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        manager = self.head.jobs
        if manager is not None:
            for r in manager.jobs.values():
                rows.append(
                    {
                        "id": r.job_id,
                        "title": " ".join([r.entrypoint, *r.args])[:200],
                        "state": r.state,
                        "exit_code": r.exit_code,
                        "started": r.submitted_unix,
                        "ended": r.ended_unix,
                        "events": manager.root / r.job_id / "session" / "events.jsonl",
                    }
                )
        for w in self.watched.values():
            rows.append(
                {
                    "id": w.job_id,
                    "title": w.title,
                    "state": w.state,
                    "exit_code": 0,
                    "started": w.started_unix,
                    "ended": 0.0,
                    "events": Path(w.session_dir) / "events.jsonl",
                }
            )
        rows.sort(key=lambda r: -r["started"])
        return rows

    async def _job_view(self, row: dict[str, Any]) -> dict[str, Any]:
        """The job of ``row`` as its page shows it, its event log read since the last time
        in a thread (up to 4 MiB: not on the head's loop). One view is made at a time, so a
        tail is never read while a thread adds to it."""
        async with self._tail_lock:
            tail = self._tails.get(row["id"])
            if tail is None or tail.path != str(row["events"]):
                tail = self._tails[row["id"]] = EventTail(row["events"])
            await asyncio.to_thread(tail.poll)
            return self._job_view_of(row, tail)

    def _job_view_of(self, row: dict[str, Any], tail: EventTail) -> dict[str, Any]:
        end = row["ended"] or time.time()
        start = tail.first or row["started"]
        steps = tail.steps
        return {
            **row,
            "timeline": timeline(tail.spans, tail.marks, start, max(end, tail.last)),
            "marks": list(tail.marks)[-20:],
            "steps": len(steps),
            "reward": curve([s.reward for s in steps]),
            "length": curve([s.length for s in steps]),
            "accuracy": curve([s.accuracy for s in steps]),
        }

    # -- pages -----------------------------------------------------------------------------
    async def _render(self, page: str, job: str) -> dict[str, Any] | None:
        head = self.head
        if page == "nodes":
            nodes = nodes_view(head.state, head.state.now())
            actors = collections.Counter(a.state for a in head.state.actors.values())
            return {"nodes": nodes, "actor_states": sorted(actors.items())}
        if page == "actors":
            return {"meshes": meshes_view(head.state, head.meshes)}
        if page == "jobs":
            rows = self._jobs()
            return {
                "jobs": [await self._job_view(r) if r["state"] == "running" else r for r in rows]
            }
        if page == "job":
            for row in self._jobs():
                if row["id"] == job:
                    return {"job": await self._job_view(row)}
            return None
        if page == "serving":
            now, before = await self._scrape()
            return {
                "engines": serving_view(now, before),
                "window_s": now.at - before.at if before else 0.0,
            }
        if page == "fabric":
            fabric = head.fabric
            if fabric is None:
                return {"fabric": None, "recent": []}
            recent = [r.to_json() for r in list(fabric.history)[-10:]][::-1]
            return {"fabric": fabric.show(), "recent": recent}
        return None

    async def _scrape(self) -> tuple[Scrape, Scrape | None]:
        """The newest scrape (taken now unless one is under ``refresh_s`` old) and one at
        least :data:`WINDOW_S` older (else the oldest kept, else ``None``)."""
        async with self._scraping:
            loop = asyncio.get_running_loop()
            if not self._scrapes or loop.time() - self._scrapes[-1].at >= self.refresh_s:
                families = await self.head.metrics.families()
                self._scrapes.append(Scrape.of(loop.time(), families))
            now = self._scrapes[-1]
            older = [s for s in self._scrapes if s is not now]
            before = next((s for s in reversed(older) if now.at - s.at >= WINDOW_S), None)
            return now, before or (older[0] if older else None)
