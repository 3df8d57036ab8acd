"""``orchestr run job.py`` and friends. Output here is for people: readable, no JSON unless asked."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import pathlib
import sys
from collections.abc import Awaitable, Callable, Sequence
from types import ModuleType

import orchestr
from orchestr._log import configure_logging

from . import _daemons, _fabric, _gpucheck, _jobs, _models, _rl, _serve, _sim, _slurm


def load_job(path: str) -> ModuleType:
    """Import a job file as a module named after it, with its folder on the import path, so
    workers can import the actor classes it defines by the same name."""
    file = pathlib.Path(path).resolve()
    if not file.is_file():
        raise FileNotFoundError(f"no job file at {path}")
    if file.suffix != ".py":
        raise ValueError(f"a job file is a Python file ending in .py, got {path}")
    folder, name = str(file.parent), file.stem
    if not name.isidentifier():
        raise ValueError(f"the job file's name must be a valid module name, got {file.name!r}")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _cluster_of(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The running cluster ``orchestr run`` uses: ``--address``, ``$ORCHESTR_ADDRESS`` or the
    state directory's head, with its token; ``(None, None)`` for the embedded mode."""
    from orchestr._cluster import _daemon as _cluster

    from ._daemons import head_address

    state_dir = _cluster.resolve_state_dir(args.state_dir)
    address = head_address(args, state_dir)
    if address is None:
        return None, None
    return address, _cluster.cluster_token(state_dir)


def _run(args: argparse.Namespace) -> int:
    sys.argv = [args.job, *args.job_args]  # the job reads its own flags, as under python
    try:
        module = load_job(args.job)
    except (OSError, ValueError) as exc:
        print(f"orchestr run: {exc}", file=sys.stderr)
        return 2
    main = getattr(module, "main", None)
    if not inspect.iscoroutinefunction(main):
        print(f"orchestr run: {args.job} must define `async def main(ctx)`", file=sys.stderr)
        return 2
    return run_on_cluster(main, args, "run", what="job")


def run_on_cluster(
    main: Callable[[orchestr.JobContext], Awaitable[None]],
    args: argparse.Namespace,
    command: str,
    run_dir: str | None = None,
    what: str = "run",
) -> int:
    """Run ``main`` on the cluster ``args`` name (or an embedded one): 0, or the exit status of
    a ``what`` that failed (1) or was interrupted (130, naming ``run_dir`` when there is one),
    said on standard error."""
    try:
        address, token = _cluster_of(args)
        orchestr.run(main, address=address, token=token)
    except orchestr.OrchestrError as exc:
        print(
            f"orchestr {command}: the {what} failed: {type(exc).__name__}: {exc}", file=sys.stderr
        )
        return 1
    except KeyboardInterrupt:
        where = f"; what was written is in {run_dir}" if run_dir else ""
        print(f"orchestr {command}: interrupted{where}", file=sys.stderr)
        return 130
    return 0


def _graph(args: argparse.Namespace) -> int:
    import asyncio

    from orchestr._graph._dry import DryRunError, NoGraphError, capture_graph

    try:
        module = load_job(args.job)
    except Exception as exc:  # the job's own import-time errors are the user's to see
        print(f"orchestr graph: cannot load {args.job}: {exc}", file=sys.stderr)
        return 2
    main = getattr(module, "main", None)
    if not inspect.iscoroutinefunction(main):
        print(f"orchestr graph: {args.job} must define `async def main(ctx)`", file=sys.stderr)
        return 2
    try:
        graph = asyncio.run(capture_graph(main))
    except (DryRunError, NoGraphError) as exc:
        print(f"orchestr graph: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        print(
            f"orchestr graph: the job failed before its first graph: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 1
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prefix = out / graph.name
    files = {"dot": str(prefix) + ".dot", "svg": str(prefix) + ".svg"}
    failure = None
    try:
        graph.render(prefix)
    except orchestr.ConfigError as exc:
        failure, files["svg"] = exc, ""
    if args.json:
        print(json.dumps({"graph": graph.to_dict(), "description": graph.describe(), **files}))
    else:
        print(graph.describe())
        print(*(f"wrote {path}" for path in files.values() if path), sep="\n")
    if failure is not None:
        print(f"orchestr graph: {failure}", file=sys.stderr)
        return 1
    return 0


def _transports(args: argparse.Namespace) -> int:
    from orchestr import fabric

    rows = fabric.transport_report()
    if args.json:
        print(json.dumps({"host": fabric.host_id(), "transports": rows}))
        return 0
    print(f"host {fabric.host_id()}")
    for row in rows:
        state = "available" if row["available"] else f"unavailable: {row.get('reason', '?')}"
        extra = ""
        if row.get("devices"):
            extra = f" (devices: {', '.join(map(str, row['devices']))})"
        print(f"  {row['kind']:<6} {row['scheme']:<7} {state}{extra}")
    return 0


STATE_DIR_HELP = (
    "where the daemons keep their token, addresses and logs (default: $ORCHESTR_STATE_DIR, "
    "else ~/.orchestr)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchestr", description="Run orchestr jobs and clusters.")
    parser.add_argument("--version", action="version", version=f"orchestr {orchestr.__version__}")
    parser.add_argument(
        "--log-level", default="WARNING", help="log level of the CLI's own output (default WARNING)"
    )
    parser.add_argument(
        "--json-logs", action="store_true", help="log JSON lines instead of console text"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job file on an embedded local cluster")
    run.add_argument(
        "--address",
        metavar="HOST:PORT",
        help="run on the cluster whose head serves there (default: $ORCHESTR_ADDRESS, else the "
        "state directory's running head, else an embedded cluster)",
    )
    run.add_argument("--state-dir", help=STATE_DIR_HELP)
    run.add_argument("job", help="path to a Python file defining `async def main(ctx)`")
    run.add_argument(
        "job_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="arguments for the job: its sys.argv[1:] (after the job file)",
    )
    run.set_defaults(func=_run)
    graph = sub.add_parser(
        "graph",
        help="show a job's first dataflow graph without running it (text, .dot and .svg)",
    )
    graph.add_argument("job", help="path to a Python file defining `async def main(ctx)`")
    graph.add_argument(
        "--out", default=".", help="folder for <graph name>.dot and .svg (default: here)"
    )
    graph.add_argument("--json", action="store_true", help="print one JSON object")
    graph.set_defaults(func=_graph)
    start = sub.add_parser("start", help="start the head daemon, or a node daemon that joins one")
    start.add_argument("--head", action="store_true", help="start the head daemon")
    start.add_argument("--address", metavar="HOST:PORT", help="join the head serving there")
    start.add_argument(
        "--host",
        help="the address to bind: the head's (default 127.0.0.1), or with --address the "
        "node's and its workers' (default: $ORCHESTR_BIND_HOST); auto: this host name's",
    )
    start.add_argument(
        "--port",
        type=int,
        default=0,
        help="the head's port, or with --address the node's gRPC port (0: any free one)",
    )
    start.add_argument(
        "--block",
        action="store_true",
        help="run the daemon in this process, in the foreground, until SIGTERM (containers, "
        "Slurm steps); its output goes to this terminal",
    )
    start.add_argument("--labels", default="", metavar="K=V,...", help="the node's labels")
    start.add_argument(
        "--fabric",
        metavar="PLAN",
        help="the head runs the fabric manager for this cabling plan (TOML or YAML); nodes "
        "say which of its hosts they are with --labels fabric_host=NAME",
    )
    start.add_argument(
        "--ocs-driver",
        metavar="sim|netns:TAG",
        help="what drives the plan's OCS: sim (simulated, the default) or netns:TAG (the "
        "emulated fabric of network namespaces ocf-TAG-*, its hosts named after the ToRs)",
    )
    start.add_argument("--state-dir", help=STATE_DIR_HELP)
    start.add_argument(
        "--tls-cert",
        metavar="PEM",
        help="mutual TLS: this host's certificate, naming its IP addresses in subjectAltName "
        "(default: $ORCHESTR_TLS_CERT; give all three --tls-* or none)",
    )
    start.add_argument(
        "--tls-key", metavar="PEM", help="mutual TLS: the certificate's key ($ORCHESTR_TLS_KEY)"
    )
    start.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="mutual TLS: the CA that signed every host's certificate ($ORCHESTR_TLS_CA)",
    )
    start.set_defaults(func=_daemons.start)
    stop = sub.add_parser("stop", help="stop this host's daemons (nodes first, then the head)")
    stop.add_argument("--state-dir", help=STATE_DIR_HELP)
    stop.set_defaults(func=_daemons.stop)
    status = sub.add_parser("status", help="the cluster's nodes and actors")
    status.add_argument("--address", metavar="HOST:PORT", help="the head (default: as for run)")
    status.add_argument("--state-dir", help=STATE_DIR_HELP)
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=_daemons.status)
    _jobs.add_parsers(sub, STATE_DIR_HELP)
    _fabric.add_parsers(sub, STATE_DIR_HELP)
    _models.add_parsers(sub)
    _serve.add_parsers(sub, STATE_DIR_HELP)
    _rl.add_parsers(sub, STATE_DIR_HELP)
    _sim.add_parsers(sub)
    _slurm.add_parsers(sub)
    _gpucheck.add_parsers(sub)
    transports = sub.add_parser(
        "transports", help="list the data-plane transports this host can use, and why not"
    )
    transports.add_argument("--json", action="store_true", help="print one JSON object")
    transports.set_defaults(func=_transports)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(json=args.json_logs, level=args.log_level)
    code: int = args.func(args)
    return code
