"""The node service: starts worker processes, reports their exits at once, heartbeats.

Run on its own, it joins an existing cluster as one more node and serves until SIGTERM::

    ORCHESTR_TOKEN=... ORCHESTR_BIND_HOST=10.0.0.2 \\
        python -m orchestr._cluster._node --head 10.0.0.1:40123 --labels host=b,zone=x
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
import structlog

from orchestr._control._grpc import ControlChannel, abort_with, add_port, make_server
from orchestr._control._head_client import describe_exit
from orchestr._log import LineCutter, RotatingFile, configure_logging, read_daemon_log
from orchestr._loop import run_loop
from orchestr.config import Config, config_environ, load_config
from orchestr.errors import ConfigError, OrchestrError, SpawnError
from orchestr.protos import orchestr_pb2 as pb
from orchestr.protos import orchestr_pb2_grpc as pb_grpc
from orchestr.tasks import TaskOwner

from ._hostinfo import detect_fabric, detect_resources, is_stopped, merge_pythonpath, parse_labels

__all__ = ["NodeService", "main", "serve_node"]

log = structlog.get_logger("orchestr.node")


class _Worker:
    def __init__(self, worker_id: str, proc: asyncio.subprocess.Process) -> None:
        self.worker_id = worker_id
        self.proc = proc
        self.registered: asyncio.Future[pb.WorkerInfo] = asyncio.get_running_loop().create_future()
        self.output: collections.deque[str] = collections.deque(maxlen=60)
        self.tasks: list[asyncio.Task[None]] = []


class NodeService(pb_grpc.NodeServicer):
    """Serves the ``Node`` gRPC service and owns this host's worker processes."""

    def __init__(
        self,
        head_address: str,
        token: str,
        config: Config,
        *,
        resources: dict[str, float] | None = None,
        labels: dict[str, str] | None = None,
        worker_env: dict[str, str] | None = None,
        output: Any = None,
        log_dir: Path | None = None,
        port: int = 0,
    ) -> None:
        self.node_id = f"n-{secrets.token_hex(4)}"
        self.head_address = head_address
        self.token = token
        self.config = config
        self.resources = resources if resources is not None else detect_resources()
        self.labels = labels or {}
        self.worker_env = worker_env or {}
        self.output = output if output is not None else sys.stdout
        #: Where this node daemon's JSON-lines log is (served through the head), if anywhere.
        self.log_dir = log_dir
        self.transports, self.devices = detect_fabric()
        #: The incarnation of the head this node registered with (see ``_beat``).
        self.head_epoch = ""
        self.server = make_server(token, config)
        pb_grpc.add_NodeServicer_to_server(self, self.server)  # type: ignore[no-untyped-call]
        self.port = add_port(self.server, f"{config.bind_host}:{port}", config)
        self.address = f"{config.bind_host}:{self.port}"
        self.head = ControlChannel(head_address, token, config)
        self.workers: dict[str, _Worker] = {}
        self._starting = asyncio.Semaphore(
            config.max_starting_workers or int(detect_resources()["cpu"])
        )
        self._tasks = TaskOwner()  # the heartbeat, and each worker's output relay and watch
        self._heartbeat: asyncio.Task[None] | None = None
        self._missing_folders: set[str] = set()  # job folders not here, warned about once

    async def __aenter__(self) -> NodeService:
        await self.server.start()
        try:
            await self._register(rejoin=False)
        except BaseException:
            await self.aclose()  # a refused node leaves no server behind
            raise
        self._heartbeat = self._tasks.start(self._beat())
        log.info("node started", node=self.node_id, address=self.address, resources=self.resources)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop every worker (SIGTERM, then SIGKILL after the grace period) and the service."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        await asyncio.gather(
            *(self._stop(w, self.config.worker_stop_grace) for w in list(self.workers.values()))
        )
        await self.server.stop(grace=0.5)
        await self._tasks.aclose()  # the watches of workers that had exited, still reporting
        await self.head.aclose()

    async def _register(self, *, rejoin: bool) -> None:
        """Register with the head; on a rejoin, list the workers still running so the head
        adopts their actors, and stop those it has given up."""
        workers = [
            w.registered.result()
            for w in self.workers.values()
            if w.registered.done() and not w.registered.exception()
        ]
        reply = await self.head.rpc(
            self.head.stub(pb_grpc.HeadStub).RegisterNode,
            pb.RegisterNodeRequest(
                node_id=self.node_id,
                address=self.address,
                total=pb.Resources(amounts=self.resources),
                labels=self.labels,
                transports=self.transports,
                devices=self.devices,
                workers=workers,
                rejoin=rejoin,
            ),
            timeout=10,
        )
        self.head_epoch = reply.epoch
        stray = [self.workers[w] for w in reply.stop_workers if w in self.workers]
        if rejoin:
            log.info(
                "registered with the head again",
                node=self.node_id,
                kept=len(workers) - len(stray),
                stopping=len(stray),
            )
        await asyncio.gather(*(self._stop(w, self.config.worker_stop_grace) for w in stray))

    async def _beat(self) -> None:
        """Heartbeat the head every ``heartbeat_interval``. When the head does not know this
        node as alive (it restarted, or marked the node dead while it was cut off), or another
        incarnation of the head answers, register again. Failures are logged and retried:
        the node outlives its head's restarts."""
        stub = self.head.stub(pb_grpc.HeadStub)
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)
            try:
                suspended = [w.worker_id for w in self.workers.values() if is_stopped(w.proc.pid)]
                beat = pb.HeartbeatRequest(
                    node_id=self.node_id, workers=len(self.workers), suspended=suspended
                )
                reply = await self.head.rpc(stub.Heartbeat, beat, timeout=5)
                if reply.register_again or reply.epoch != self.head_epoch:
                    await self._register(rejoin=True)
            except OrchestrError as exc:
                log.warning("heartbeat failed", error=str(exc))

    async def GetDaemonLog(
        self, request: pb.DaemonLogRequest, context: grpc.aio.ServicerContext
    ) -> pb.DaemonLog:
        if self.log_dir is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {self.node_id} keeps no log files (it logs to its console)",
            )
        assert self.log_dir is not None
        try:
            names, data, offset = read_daemon_log(
                self.log_dir, request.name, request.offset, request.max_bytes
            )
        except ConfigError as exc:
            await abort_with(context, exc)
        return pb.DaemonLog(data=data, offset=offset, names=names)

    # -- workers -------------------------------------------------------------------------
    async def StartWorker(
        self, request: pb.StartWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.WorkerInfo:
        async with self._starting:  # a few processes start at a time; the rest wait here
            return await self._start_worker(request, context)

    async def _start_worker(
        self, request: pb.StartWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.WorkerInfo:
        worker_id = request.worker_id or f"w-{secrets.token_hex(6)}"
        env = dict(os.environ)
        env.update(config_environ(self.config))  # workers run under the node's settings
        env.update(self.worker_env)
        # gRPC core's INFO lines (a server closing an idle channel, say) would go to the
        # job's console through the output relay; a worker shows its errors only, unless
        # GRPC_VERBOSITY says otherwise
        env.setdefault("GRPC_VERBOSITY", "ERROR")
        pythonpath, missing = merge_pythonpath(request.python_path, env.get("PYTHONPATH", ""))
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        for folder in missing:
            if folder not in self._missing_folders:  # once per folder, not per worker
                self._missing_folders.add(folder)
                log.warning(
                    "a folder of the job's import path is not on this node; its workers "
                    "start without it",
                    node=self.node_id,
                    folder=folder,
                )
        env.update(
            ORCHESTR_WORKER_ID=worker_id,
            ORCHESTR_NODE_ID=self.node_id,
            ORCHESTR_NODE_ADDRESS=self.address,
            ORCHESTR_HEAD_ADDRESS=self.head_address,
            ORCHESTR_TOKEN=self.token,
            PYTHONUNBUFFERED="1",
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "orchestr._cluster._worker",
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        worker = _Worker(worker_id, proc)
        self.workers[worker_id] = worker
        worker.tasks = [
            self._tasks.start(self._forward(worker)),
            self._tasks.start(self._watch(worker)),
        ]
        try:
            async with asyncio.timeout(self.config.worker_start_timeout):
                return await worker.registered
        except TimeoutError:
            await self._stop(worker, 0)
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"worker {worker_id} did not register within {self.config.worker_start_timeout} s",
            )
        except SpawnError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        raise AssertionError("unreachable")

    async def RegisterWorker(
        self, request: pb.WorkerInfo, context: grpc.aio.ServicerContext
    ) -> pb.Ack:
        worker = self.workers.get(request.worker_id)
        if worker is None or worker.registered.done():
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"unexpected worker {request.worker_id!r}"
            )
            raise AssertionError("unreachable")  # abort raises
        worker.registered.set_result(request)
        return pb.Ack()

    async def StopWorker(
        self, request: pb.StopWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.Ack:
        worker = self.workers.get(request.worker_id)
        if worker is not None:
            await self._stop(worker, request.grace_s or self.config.worker_stop_grace)
        return pb.Ack()

    async def _forward(self, worker: _Worker) -> None:
        """Relay the worker's stdout/stderr, prefixed, and keep its tail for error messages."""
        assert worker.proc.stdout is not None
        prefix = f"({worker.worker_id} pid={worker.proc.pid}) "
        cutter = LineCutter()
        while True:
            chunk = await worker.proc.stdout.read(1 << 16)
            lines = cutter.feed(chunk) if chunk else cutter.end()
            for line in lines:
                worker.output.append(line)
                with contextlib.suppress(ValueError, OSError):
                    self.output.write(prefix + line + "\n")
            with contextlib.suppress(ValueError, OSError):
                self.output.flush()
            if not chunk:
                return

    async def _watch(self, worker: _Worker) -> None:
        rc = await worker.proc.wait()
        sig = -rc if rc < 0 else 0
        code = rc if rc >= 0 else 0
        self.workers.pop(worker.worker_id, None)
        reason = describe_exit(worker.proc.pid, code, sig)
        # Let the output relay reach the end of the pipe: a fatal-error dump is often last.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                await asyncio.gather(worker.tasks[0], return_exceptions=True)
        abnormal = bool(sig) or code != 0
        if not worker.registered.done():
            tail = "\n".join(worker.output) or "(no output)"
            worker.registered.set_exception(
                SpawnError(f"{reason} before it registered; its last output:\n{tail}")
            )
        log.info("worker exited", worker=worker.worker_id, reason=reason)
        with contextlib.suppress(OrchestrError):
            await self.head.rpc(
                self.head.stub(pb_grpc.HeadStub).ReportWorkerExit,
                pb.WorkerExit(
                    node_id=self.node_id,
                    worker_id=worker.worker_id,
                    pid=worker.proc.pid,
                    exit_code=code,
                    signal=sig,
                    last_output="\n".join(worker.output) if abnormal else "",
                ),
                timeout=5,
            )

    async def _stop(self, worker: _Worker, grace: float) -> None:
        proc = worker.proc
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(grace):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        await asyncio.gather(*worker.tasks, return_exceptions=True)


async def serve_node(
    head_address: str,
    token: str,
    config: Config,
    labels: dict[str, str],
    log_dir: Path | None = None,
    port: int = 0,
) -> None:
    """Join the cluster at ``head_address`` and serve on ``port`` (0: any) until SIGTERM or
    SIGINT; then stop every worker it started. ``log_dir`` holds the logs it serves the head."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        node = NodeService(head_address, token, config, labels=labels, log_dir=log_dir, port=port)
        async with node:
            print(f"node {node.node_id} serving at {node.address}", flush=True)
            await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchestr._cluster._node",
        description="Join an orchestr cluster as a node (the token comes from ORCHESTR_TOKEN, "
        "the address to serve on from ORCHESTR_BIND_HOST).",
    )
    parser.add_argument("--head", required=True, metavar="HOST:PORT", help="the head's address")
    parser.add_argument("--labels", default="", metavar="K=V,...", help="this node's labels")
    parser.add_argument("--port", type=int, default=0, help="its gRPC service's port (0: any)")
    parser.add_argument("--log-level", default="WARNING", help="default: WARNING")
    parser.add_argument(
        "--log-file", help="write JSON lines here, rotated (default: console text on stderr)"
    )
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    if args.log_file:
        configure_logging(json=True, stream=RotatingFile(args.log_file), level=args.log_level)
    else:
        configure_logging(json=False, level=args.log_level)
    token = os.environ.get("ORCHESTR_TOKEN", "")
    if not token:
        parser.error("set ORCHESTR_TOKEN to the cluster token")
    try:
        labels = parse_labels(args.labels)
        config = load_config()
    except ConfigError as exc:
        parser.error(str(exc))
    try:
        log_dir = Path(args.log_file).resolve().parent if args.log_file else None
        run_loop(serve_node(args.head, token, config, labels, log_dir, args.port))
    except OrchestrError as exc:
        print(f"orchestr node: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
