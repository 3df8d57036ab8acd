"""Where a job's controller runs: the embedded local cluster, a session on a running cluster, and
:func:`run`, which starts one or the other around the job's ``main(ctx)``."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import secrets
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import structlog

from orchestr import fabric
from orchestr._call._client import CallClient, set_current_client
from orchestr._cluster._head import HeadService
from orchestr._cluster._node import NodeService
from orchestr._control._grpc import ControlChannel
from orchestr._control._head_client import HeadClient, actor_lookup
from orchestr._control._tls import install_stream_tls
from orchestr._loop import run_loop
from orchestr.config import Config, load_config
from orchestr.errors import ConfigError, OrchestrError
from orchestr.tasks import TaskOwner

from ._context import JobContext
from ._events import export_trace
from ._paths import worker_pythonpath
from ._ship import EventShipper

__all__ = ["connect", "job_session", "open_local_cluster", "run"]

log = structlog.get_logger("orchestr.driver")

T = TypeVar("T")


def _export_trace(session_dir: str) -> None:
    try:
        export_trace(
            os.path.join(session_dir, "events.jsonl"), os.path.join(session_dir, "trace.json")
        )
    except (OSError, ConfigError) as exc:
        log.warning("cannot write the job's trace", error=str(exc))


def _new_session() -> tuple[str, str]:
    """A fresh job id and the local folder for its logs and event log; a submitted job's
    controller takes the id and folder its head gave it (``ORCHESTR_SUBMITTED_JOB`` and
    ``ORCHESTR_SUBMITTED_SESSION``), where the head's dashboard reads its event log."""
    given_id = os.environ.get("ORCHESTR_SUBMITTED_JOB", "")
    given_dir = os.environ.get("ORCHESTR_SUBMITTED_SESSION", "")
    if given_id and given_dir:
        os.makedirs(given_dir, mode=0o700, exist_ok=True)
        return given_id, given_dir
    job_id = f"job-{secrets.token_hex(4)}"
    return job_id, tempfile.mkdtemp(prefix=f"orchestr-{job_id}-")


def _program() -> str:
    """What this process runs, as its command line says (the embedded job's title)."""
    return " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:200]


@contextlib.asynccontextmanager
async def open_local_cluster(
    config: Config | None = None,
    *,
    resources: dict[str, float] | None = None,
    labels: dict[str, str] | None = None,
) -> AsyncIterator[JobContext]:
    """Start a head and a local node in this process, yield a :class:`JobContext`, and stop
    everything (workers included) on exit, also when the body raises."""
    config = config or load_config()
    token = secrets.token_urlsafe(32)
    job_id, session_dir = _new_session()
    worker_env = {
        "PYTHONPATH": worker_pythonpath(),
        "ORCHESTR_SESSION_DIR": session_dir,
        "ORCHESTR_JOB_ID": job_id,
    }
    structlog.contextvars.bind_contextvars(job=job_id)
    try:
        async with HeadService(token, config) as head:
            async with NodeService(
                head.address,
                token,
                config,
                resources=resources,
                labels=labels,
                worker_env=worker_env,
            ):
                watched = head.dashboard.watch_job(job_id, _program(), session_dir)
                try:
                    async with job_session(
                        head.address,
                        token,
                        config,
                        job_id=job_id,
                        session_dir=session_dir,
                        metrics_address=head.metrics_address,
                    ) as ctx:
                        ctx.dashboard_address = head.dashboard_address
                        yield ctx
                except BaseException:
                    watched.state = "failed"
                    raise
                watched.state = "succeeded"
    finally:
        structlog.contextvars.unbind_contextvars("job")


@contextlib.asynccontextmanager
async def job_session(
    head_address: str,
    token: str,
    config: Config,
    *,
    job_id: str | None = None,
    session_dir: str | None = None,
    metrics_address: str | None = None,
) -> AsyncIterator[JobContext]:
    """A :class:`JobContext` for a job whose controller is this process, on the cluster whose
    head is at ``head_address``: the embedded cluster's or a running one's. On exit it stops
    the job's meshes, closes its connections and writes its trace."""
    own_session = job_id is None or session_dir is None
    if job_id is None or session_dir is None:
        job_id, session_dir = _new_session()
        structlog.contextvars.bind_contextvars(job=job_id)
    install_stream_tls(config)
    head_channel = ControlChannel(head_address, token, config)
    try:
        client = CallClient(token, config, actor_lookup(head_channel, config))
        set_current_client(client)
        ctx = JobContext(head_channel, client, config, job_id, session_dir)
        ctx.metrics_address = metrics_address
        ctx._host = asyncio.current_task()
        client.record_spans(config.call_spans_per_s, ctx.events.record_calls)
        # a controller of its own (not an embedded cluster's, nor a submitted job's, whose
        # head reads the log from disk) sends its event log to the head's dashboard
        shipper: EventShipper | None = None
        shipping = TaskOwner()
        if own_session and not os.environ.get("ORCHESTR_SUBMITTED_JOB"):
            shipper = EventShipper(HeadClient(head_channel), job_id, _program(), ctx.events.path)
            shipping.start(shipper.run())
        state = "failed"
        try:
            async with ctx.supervisor:
                try:
                    yield ctx
                except asyncio.CancelledError:
                    if ctx.supervisor.escalated is None or ctx._host is None:
                        raise
                    ctx._host.uncancel()
                finally:
                    ctx.supervisor.closing = True
                if ctx.supervisor.escalated is not None:
                    raise ctx.supervisor.escalated
            state = "succeeded"
        finally:
            announced = [task for _, task in ctx._announced.values()]
            for task in announced:  # announced phases the job never entered
                task.cancel()
            await asyncio.gather(*announced, return_exceptions=True)
            with contextlib.suppress(OrchestrError):
                await asyncio.gather(*(ctx.stop(m) for m in ctx._meshes))
                await asyncio.gather(*(ctx.release(r) for r in list(ctx._reservations)))
            await ctx._hosting.aclose()
            set_current_client(None)
            await client.aclose()
            fabric.shutdown()
            ctx.events.close()
            _export_trace(session_dir)
            await shipping.aclose()
            if shipper is not None:
                await shipper.finish(state)
    finally:
        await head_channel.aclose()
        if own_session:
            structlog.contextvars.unbind_contextvars("job")


@contextlib.asynccontextmanager
async def connect(
    address: str | None = None, *, token: str | None = None, config: Config | None = None
) -> AsyncIterator[JobContext]:
    """A job on the running cluster whose head serves at ``address`` (default
    ``$ORCHESTR_ADDRESS``), controlled from an asyncio program of your own: a web service's
    lifespan, a cache service's main. Yields a :class:`JobContext`; on exit the job's meshes
    stop and the cluster stays up. ``token`` is the cluster's (default ``$ORCHESTR_TOKEN``).

    Blocks on the connection; raises :class:`ConfigError` without an address or a token, and
    what the head answers (a wrong token: :class:`AuthenticationError` on the first call)."""
    address = address or os.environ.get("ORCHESTR_ADDRESS")
    token = token or os.environ.get("ORCHESTR_TOKEN")
    if not address:
        raise ConfigError("connect needs the head's address: give address= or $ORCHESTR_ADDRESS")
    if not token:
        raise ConfigError("connect needs the cluster's token: give token= or $ORCHESTR_TOKEN")
    async with job_session(address, token, config or load_config()) as ctx:
        yield ctx


def run(
    main: Callable[[JobContext], Awaitable[T]],
    *,
    config: Config | None = None,
    address: str | None = None,
    token: str | None = None,
) -> T:
    """Run ``main(ctx)`` and return its result: on an embedded local cluster, or with
    ``address`` (and its ``token``) on the running cluster whose head serves there.

    Embedded, it starts a head and a node for the job's lifetime (uvloop when installed) and
    stops them, with every worker, when ``main`` returns or raises. On a running cluster it
    stops the job's meshes and leaves the cluster up.
    """
    if address is not None and not token:
        raise ConfigError("a running cluster needs its token (ORCHESTR_TOKEN or the state dir's)")
    if not inspect.iscoroutinefunction(main):
        raise TypeError(f"orchestr.run needs an async function main(ctx), got {main!r}")

    if not structlog.is_configured():
        from orchestr._log import configure_logging

        configure_logging(json=False, level="WARNING")

    async def body() -> T:
        if address is not None and token:
            async with job_session(address, token, config or load_config()) as ctx:
                return await main(ctx)
        async with open_local_cluster(config) as ctx:
            return await main(ctx)

    return run_loop(body())
