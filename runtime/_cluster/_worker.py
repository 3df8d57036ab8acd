"""A worker process: hosts actors on a uvloop event loop and serves their endpoints.

Started by a node as ``python -m orchestr._cluster._worker`` with its identity and the cluster token in
``ORCHESTR_*`` environment variables. Exits on SIGTERM, and when its node goes away.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import faulthandler
import os
import signal
import sys
import traceback
from collections.abc import Iterable

import grpc
import structlog

from orchestr import fabric, metrics
from orchestr._actor._actor import load_actor_class, set_crash_handler
from orchestr._actor._host import ActorHost
from orchestr._call import _serde, _wire
from orchestr._call._client import CallClient, set_current_client
from orchestr._call._lookup import ActorLookup, ActorView
from orchestr._call._server import CallServer
from orchestr._control._grpc import ControlChannel, abort_with, add_port, make_server
from orchestr._control._tls import install_stream_tls
from orchestr._log import configure_logging
from orchestr._loop import run_loop
from orchestr._stats import ActorStats, TransportStats, WorkerStats
from orchestr.config import Config, load_config
from orchestr.errors import OrchestrError, SpawnError
from orchestr.fabric.lowlevel import buffer_stats
from orchestr.protos import orchestr_pb2 as pb
from orchestr.protos import orchestr_pb2_grpc as pb_grpc

log = structlog.get_logger("orchestr.worker")


class WorkerService(pb_grpc.WorkerServicer):
    def __init__(self, worker_id: str, token: str, config: Config, calls: CallServer) -> None:
        self.worker_id = worker_id
        self.token = token
        self.config = config
        self.calls = calls
        self.server = make_server(token, config)
        pb_grpc.add_WorkerServicer_to_server(self, self.server)  # type: ignore[no-untyped-call]
        self.port = add_port(self.server, f"{config.bind_host}:0", config)

    async def CreateActor(
        self, request: pb.CreateActorRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateActorReply:
        label = f"{request.name}[{request.rank}]"
        try:
            cls = load_actor_class(request.class_path, where=" in the worker")
            args, kwargs = _serde.decode(request.init_args)
            instance = cls.__new__(cls)
            instance.rank, instance.mesh_name, instance.actor_id = (
                request.rank,
                request.name,
                request.actor_id,
            )
            try:
                cls.__init__(instance, *args, **kwargs)
            except Exception as exc:
                raise SpawnError(
                    f"{label} ({request.class_path}).__init__ raised {type(exc).__name__}: {exc}\n"
                    f"--- remote traceback ---\n{traceback.format_exc().rstrip()}"
                ) from exc
            if request.has_state:  # a restart: the state its owner last saved
                try:
                    instance.load_state(_serde.decode(request.state))
                except Exception as exc:
                    raise SpawnError(
                        f"{label} ({request.class_path}).load_state raised "
                        f"{type(exc).__name__}: {exc}\n"
                        f"--- remote traceback ---\n{traceback.format_exc().rstrip()}"
                    ) from exc
        except OrchestrError as exc:
            log.error("actor creation failed", actor=label, error=str(exc))
            await abort_with(context, exc if isinstance(exc, SpawnError) else SpawnError(str(exc)))
        self.calls.actors[request.actor_id] = ActorHost(instance, label, request.actor_id)
        log.info(
            "actor created", actor=label, actor_id=request.actor_id, class_path=request.class_path
        )
        return pb.CreateActorReply(endpoints=sorted(instance._orchestr_endpoints))

    async def Stats(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.WorkerStats:
        # only the head's metrics scrape asks: not loaded at every start
        from orchestr._control._convert_stats import worker_stats_to_pb

        actors = [host.stats() for host in self.calls.actors.values()]
        return worker_stats_to_pb(worker_stats(self.worker_id, actors))


def process_transports() -> list[TransportStats]:
    """What this process moved so far, by kind and transport.

    ``stream``: call-path frames, counted at both ends; ``bulk``: call values that went through
    shared-memory segments, both ends; ``buffer``: one-sided transfers this process started
    (``read_into`` is received, ``write_from`` sent), with the fallbacks counted under the
    transport used instead (the call path's own fallbacks count under ``tcp``).
    """
    rows = [
        TransportStats("stream", scheme, m.sent, m.received)
        for scheme, m in sorted(_wire.streams.items())
    ]
    moved = _wire.bulk
    if moved.ops:
        rows.append(TransportStats("bulk", "shm", moved.sent, moved.received, moved.ops))
    for scheme, c in sorted(buffer_stats.items()):
        rows.append(
            TransportStats(
                "buffer", scheme, c.bytes_written, c.bytes_read, c.transfers, c.fallbacks
            )
        )
    return rows


def worker_stats(worker_id: str, actors: Iterable[ActorStats]) -> WorkerStats:
    """This worker's answer to the head's ``Stats`` RPC: its actors' counters, what the process
    moved, and its metrics now."""
    return WorkerStats(worker_id, list(actors), process_transports(), metrics.snapshot())


def _actor_lookup(head: ControlChannel, config: Config) -> ActorLookup:
    """:func:`~orchestr._control._head_client.actor_lookup`, imported when a call first
    breaks: a worker that never sees a peer die does not load the head's client for nothing."""

    async def lookup(actor_id: str, address: str, restart_wait: float) -> ActorView:
        from orchestr._control._head_client import actor_lookup

        return await actor_lookup(head, config)(actor_id, address, restart_wait)

    return lookup


#: The exit status of a worker whose actor crashed itself (``Actor.crash_worker``): EX_SOFTWARE.
CRASH_STATUS = 70


def _crash_later(reason: str) -> None:
    """Exit the process as a failure shortly: the loop first sends the replies already given
    (the calls of the step that failed get their errors)."""
    log.error("an actor crashed its worker; exiting so that it is restarted", reason=reason)

    def leave() -> None:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(CRASH_STATUS)

    asyncio.get_running_loop().call_later(0.2, leave)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the node that started it dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


async def serve_worker() -> None:
    env = os.environ
    worker_id, token = env["ORCHESTR_WORKER_ID"], env["ORCHESTR_TOKEN"]
    config = load_config()
    install_stream_tls(config)
    head = ControlChannel(env["ORCHESTR_HEAD_ADDRESS"], token, config)
    node = ControlChannel(env["ORCHESTR_NODE_ADDRESS"], token, config)
    parent = os.getppid()

    client = CallClient(token, config, _actor_lookup(head, config))
    set_current_client(client)
    calls = CallServer(token, config)
    await calls.start(f"tcp://{config.bind_host}:0")
    service = WorkerService(worker_id, token, config, calls)
    await service.server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await node.rpc(
        node.stub(pb_grpc.NodeStub).RegisterWorker,
        pb.WorkerInfo(
            worker_id=worker_id,
            pid=os.getpid(),
            control_address=f"{config.bind_host}:{service.port}",
            call_address=calls.url,
        ),
    )
    set_crash_handler(_crash_later)
    log.info("worker serving", call_address=calls.url)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await stop.wait()
        if os.getppid() != parent:  # the node went away without telling us
            break
    log.info("worker stopping")
    await calls.aclose()
    released = fabric.shutdown()
    if released:
        log.info("released buffers the actor still held", count=released)
    await client.aclose()
    await service.server.stop(grace=0.2)
    await head.aclose()
    await node.aclose()


def main() -> None:
    _die_with_parent()
    # A fatal signal (SIGSEGV, SIGABRT, ...) dumps every thread's stack to stderr, which the
    # node relays and keeps: the head reports it as the death's cause.
    faulthandler.enable()
    env = os.environ
    session_dir = env.get("ORCHESTR_SESSION_DIR")
    log_file = None
    if session_dir:
        os.makedirs(os.path.join(session_dir, "logs"), exist_ok=True)
        log_file = open(
            os.path.join(session_dir, "logs", f"{env['ORCHESTR_WORKER_ID']}.jsonl"), "a"
        )
    configure_logging(json=True, stream=log_file or sys.stderr)
    structlog.contextvars.bind_contextvars(
        node=env.get("ORCHESTR_NODE_ID"),
        worker=env.get("ORCHESTR_WORKER_ID"),
        job=env.get("ORCHESTR_JOB_ID"),
    )
    run_loop(serve_worker())
    # Everything the worker holds is closed by now. The interpreter's own teardown of the
    # modules is what is left, and with torch imported it takes about half a second, in every
    # worker and at every mesh's stop. So the exit handlers run (weakref finalizers, logging's
    # flush, thread joins) and the process ends without that teardown.
    atexit._run_exitfuncs()
    for stream in (log_file, sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
