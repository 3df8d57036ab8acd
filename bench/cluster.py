"""Cluster operations: mesh create/remove and 1,000 light actors over two namespace hosts, orchestr
and Ray side by side, with the machine's limits.

    python bench/cluster.py [--quick] [--reps R] [--batch B] [--per-process K,...]
                            [--process-each N] [--peers none]

**Hosts.** Three network namespaces on one kernel, joined by veth pairs to a bridge: ``H``
holds the heads and the drivers, ``A`` and ``B`` are the two hosts where actors live. orchestr:
the head daemon (``python -m orchestr._cluster._daemon head``, what ``orchestr start --head`` runs) in
H, a node daemon (``python -m orchestr._cluster._node``, labels ``host=a`` / ``host=b``) in A and in B,
and the job's controller (``bench/_cluster_job.py``: ``orchestr.run(main, address=, token=)``)
in H. Ray (``ray==2.60.0`` in its own venv under ``bench/.venvs``): ``ray start --head
--num-cpus 0`` in H, ``ray start --address`` in A and in B (2 CPUs each, custom resources
``slot`` and ``hostA`` / ``hostB``), the driver (``bench/peers/ray_cluster.py``) in H. Both
clusters have a head that hosts nothing and two hosts of 2 CPUs; Ray runs first, then orchestr,
each torn down before the next.

**What is compared.**

- ``reservation_create_remove_per_s``: orchestr reserves a bundle on each host
  (``ctx.reserve(2, strategy="STRICT_SPREAD")``) and releases it; Ray creates a placement group
  of 2 bundles with ``STRICT_SPREAD``, waits for ``pg.ready()`` and removes it. The same
  operation on both sides: resources held on two hosts at once, then given back. ``B`` at once
  and one at a time.
- ``mesh_create_remove_per_s``: orchestr spawns a mesh of 2 light actors with
  ``strategy="STRICT_SPREAD"`` (one per host) and stops it; Ray creates a placement group of 2
  bundles with ``STRICT_SPREAD``, waits for ``pg.ready()`` and removes it. ``B`` at once
  (default 20: create all, then remove all; the shape of Ray's own ``placement group
  create/removal`` microbenchmark, which does 100 with ``pg.wait``: printed too), and one at a
  time (``..._sequential_...``). **Not like for like**: a placement group only reserves
  resources (``ready()`` runs a task in a pooled worker; orchestr's reserve-only form is the
  reservation above), while a mesh's creation starts a worker process per member and creates
  the actor in it.
  The like-for-like figure is Ray's group with an actor (a process of its own, as on orchestr)
  in each bundle, called once, killed, the group removed (``pg_with_actors_per_s``). Printed
  beside them: orchestr's spawn and stop times, the head's placement alone
  (``HeadState.place`` and the release, in process, no I/O) and a control-plane round trip to
  the head.
- ``actors_1000_create_s``: orchestr spawns 1,000 light actors ``SPREAD`` over both hosts,
  ``K`` to a worker process (``per_process``; ``--per-process``, default ``50,500,10``, the
  first is the headline: 20 processes, 10 a host), and calls each once; seconds from the spawn
  to the last answer. Ray runs one process per actor, and 1,000 Ray worker processes do not fit
  in this machine's memory: Ray creates ``N`` actors (``--process-each``, default 100, lowered
  to what free memory allows) with ``num_cpus=0``, half on each host, and calls each once; its
  1,000 figure is ``N``'s time x 1000/N, **extrapolated** (creation is bound by starting
  processes, which goes at a steady rate on a saturated CPU). orchestr runs the same ``N`` a
  process each too: the like-for-like figure, extrapolated the same way.
- **Limits** (``bench/_limit_spawn.py``): processes started as many at a time as there are
  cores: bare ``python -c pass``; importing what an orchestr worker imports from other
  packages; importing ``orchestr._cluster._worker``; importing ``ray``. The best rate of the third gives
  the floor of orchestr's figures (a mesh of 2 needs two such processes; 1,000 actors need
  ``1000/K``). And a bare grpc.aio unary round trip from H to A.

Each figure is the median over ``R`` repetitions (default 5; 2 with ``--quick``) with min and
max; the 1,000-actor headline and the ``N`` cases run 3 times (once with ``--quick``), other
``K`` once. Memory is the actor processes' ``Pss`` summed. The machine is shared: the load
printed before and after says how much else ran. Progress goes to stderr; the last line of
stdout is one JSON object ``{"orchestr": {...}, "ray": {...}, "limits": {...},
"ratios": {...}}`` (medians; Ray's ``actors_1000_create_s`` is the extrapolated one). Needs
root (network namespaces). Target: orchestr at least 2x Ray on both required figures.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _cluster_report import report  # noqa: E402
from _procs import Processes, exit_on_signal, kill_by_marker  # noqa: E402
from _venvs import RAY_REQUIREMENTS, ensure_venv  # noqa: E402

import orchestr as oc  # noqa: E402

SUBNET = "10.213.79"  # only ever assigned inside the three namespaces this script creates
JOB = HERE / "_cluster_job.py"
LIMIT = HERE / "_limit_spawn.py"
RAY_DRIVER = HERE / "peers" / "ray_cluster.py"
RAY_PORT = 6379
#: What an orchestr worker imports from outside orchestr: the floor of a leaner worker.
DEPENDENCIES = "import grpc, grpc.aio, google.protobuf, structlog, msgpack, uvloop"


def log(message: str) -> None:
    print(f"[cluster] {message}", file=sys.stderr, flush=True)


def available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


# -- processes and namespaces this script starts ----------------------------------------------


PROCS = Processes(progress=("[cluster]",))
atexit.register(PROCS.stop_all)
run_json = PROCS.run_json


class Hosts:
    """Namespaces H (heads, drivers), A and B (the two hosts), their veth pairs on a bridge in
    H: three hosts on one kernel, one subnet."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns = {k: f"oc-cl-{k}-{tag}" for k in "hab"}
        self.ip = {k: f"{SUBNET}.{i}" for i, k in enumerate("hab", start=1)}
        self.bridge = f"occlbr{tag}"
        self.created: list[str] = []

    def __enter__(self) -> Hosts:
        PROCS.cleanups.append(self.close)
        for ns in self.ns.values():
            _ip("netns", "add", ns)
            self.created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        h = self.ns["h"]
        _ip("-n", h, "link", "add", self.bridge, "type", "bridge")
        _ip("-n", h, "addr", "add", f"{self.ip['h']}/24", "dev", self.bridge)
        _ip("-n", h, "link", "set", self.bridge, "up")
        for k in "ab":
            dev, peer = f"occl{k}{self.bridge[6:]}", f"occl{k}h{self.bridge[6:]}"
            _ip("link", "add", dev, "type", "veth", "peer", "name", peer)
            _ip("link", "set", dev, "netns", self.ns[k])
            _ip("link", "set", peer, "netns", h)
            _ip("-n", h, "link", "set", peer, "master", self.bridge)
            _ip("-n", h, "link", "set", peer, "up")
            _ip("-n", self.ns[k], "addr", "add", f"{self.ip[k]}/24", "dev", dev)
            _ip("-n", self.ns[k], "link", "set", dev, "up")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        while self.created:  # the veth pairs and the bridge go with their namespaces
            subprocess.run(["ip", "netns", "del", self.created.pop()], check=False)

    def exec(self, host: str, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[host], *cmd]


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _says(path: Path, text: str) -> Callable[[], bool]:
    """Whether the end of the log at ``path`` says ``text`` yet."""

    def ready() -> bool:
        return text in _tail(path, 50)

    return ready


def _wait_for(
    what: str, ready: Callable[[], bool], proc: subprocess.Popen[Any], logfile: Path
) -> None:
    deadline = time.monotonic() + 90
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start:\n{_tail(logfile)}")
        time.sleep(0.1)


# -- orchestr ----------------------------------------------------------------------------------


def _import_path() -> str:
    return os.pathsep.join(dict.fromkeys(p for p in sys.path if p and os.path.isdir(p)))


def orchestr_cluster(hosts: Hosts, plan: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """The head daemon in H, a node daemon in A and in B, the job's controller in H."""
    state = workdir / "orchestr"
    logs = state / "logs"
    logs.mkdir(parents=True, mode=0o700)
    state.chmod(0o700)
    env = dict(os.environ, PYTHONPATH=_import_path())
    env.pop("ORCHESTR_TOKEN", None)
    head_log = logs / "head.out"
    cmd = [sys.executable, "-m", "orchestr._cluster._daemon", "head", "--state-dir", str(state)]
    cmd += ["--host", hosts.ip["h"]]
    with open(head_log, "wb") as f:
        head = PROCS.start(hosts.exec("h", cmd), env=env, stdout=f, stderr=subprocess.STDOUT)
    started = [head]
    try:
        _wait_for("the head daemon", (state / "head.json").exists, head, head_log)
        address = json.loads((state / "head.json").read_text())["address"]
        env["ORCHESTR_TOKEN"] = (state / "token").read_text().strip()
        for k in "ab":
            node_log = logs / f"node-{k}.out"
            cmd = [sys.executable, "-m", "orchestr._cluster._node", "--head", address]
            cmd += ["--labels", f"host={k}", "--log-level", "INFO"]
            cmd += ["--log-file", str(logs / f"node-{k}.jsonl")]
            with open(node_log, "wb") as f:
                node = PROCS.start(
                    hosts.exec(k, cmd),
                    env=dict(env, ORCHESTR_BIND_HOST=hosts.ip[k]),
                    stdout=f,
                    stderr=subprocess.STDOUT,
                )
            started.append(node)
            _wait_for(f"the node in {k}", _says(node_log, "serving at"), node, node_log)
        log(f"orchestr: head at {address}, nodes in {hosts.ns['a']} and {hosts.ns['b']}")
        job = [sys.executable, str(JOB), "--address", address, "--plan", json.dumps(plan)]
        return run_json(  # type: ignore[no-any-return]
            hosts.exec("h", job), env=dict(env, ORCHESTR_BIND_HOST=hosts.ip["h"]), timeout=1800
        )
    finally:
        for proc in reversed(started):  # the nodes first: each stops its workers
            PROCS.stop(proc, grace=10.0)


# -- Ray ---------------------------------------------------------------------------------------


def ray_cluster(python: Path, hosts: Hosts, plan: dict[str, Any]) -> dict[str, Any]:
    """``ray start`` in H (head, no CPUs), A and B; the driver in H."""
    ray = str(python.parent / "ray")
    tmp = tempfile.mkdtemp(prefix="ocl-")  # short: Ray puts unix sockets under it
    PROCS.cleanups.append(lambda: shutil.rmtree(tmp, ignore_errors=True))
    PROCS.cleanups.append(lambda: kill_by_marker(tmp))
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token")
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    common = ["--block", "--disable-usage-stats", "--object-store-memory", str(512 << 20)]
    head_address = f"{hosts.ip['h']}:{RAY_PORT}"
    nodes = [
        ("h", ["--head", "--port", str(RAY_PORT), "--include-dashboard=false", "--num-cpus", "0"]),
        ("a", ["--address", head_address, "--num-cpus", "2"]),
        ("b", ["--address", head_address, "--num-cpus", "2"]),
    ]
    started = []
    try:
        for k, role in nodes:
            logfile = Path(tmp) / f"{k}.log"
            cmd = [ray, "start", *role, *common, "--node-ip-address", hosts.ip[k]]
            cmd += ["--temp-dir", os.path.join(tmp, k)]
            if k != "h":
                cmd += ["--resources", json.dumps({"slot": 10_000, f"host{k.upper()}": 10_000})]
            with open(logfile, "wb") as f:
                proc = PROCS.start(hosts.exec(k, cmd), env=env, stdout=f, stderr=subprocess.STDOUT)
            started.append(proc)
            _wait_for(f"ray in {k}", _says(logfile, "Ray runtime started"), proc, logfile)
        log(f"ray: head at {head_address}, nodes in {hosts.ns['a']} and {hosts.ns['b']}")
        driver = [str(python), str(RAY_DRIVER), "--address", head_address]
        driver += ["--plan", json.dumps(plan)]
        return run_json(hosts.exec("h", driver), env=env, timeout=1800)  # type: ignore[no-any-return]
    finally:
        for proc in reversed(started):
            PROCS.stop(proc, grace=3.0)
        kill_by_marker(tmp)


# -- limits ------------------------------------------------------------------------------------


def measure_limits(
    hosts: Hosts, n: int, reps: int, rtt_seconds: float, ray_python: Path | None
) -> dict[str, Any]:
    """Process starts (bare; with the imports of an orchestr worker, of its third-party
    dependencies alone, of Ray), as many at a time as there are cores; and a gRPC round trip
    H -> A."""
    out: dict[str, Any] = {}
    limit = [sys.executable, str(LIMIT)]
    kinds = {
        "python_start": [sys.executable, "-c", "pass"],
        "worker_dependencies_import": [sys.executable, "-c", DEPENDENCIES],
        "orchestr_worker_import": [sys.executable, "-c", "import orchestr._cluster._worker"],
    }
    if ray_python is not None:
        kinds["ray_import"] = [str(ray_python), "-c", "import ray"]
    cores = str(os.cpu_count() or 1)
    for name, cmd in kinds.items():
        out[name] = [
            run_json([*limit, "procs", str(n), cores, "--", *cmd])["seconds"] for _ in range(reps)
        ]
    server = PROCS.start(
        hosts.exec("a", [*limit, "grpc-serve", hosts.ip["a"]]), stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        call = [*limit, "grpc-call", f"{hosts.ip['a']}:{port}", str(rtt_seconds)]
        out["grpc_rtt_s"] = run_json(hosts.exec("h", call))["seconds"]
    finally:
        PROCS.stop(server)
    out["procs_n"], out["concurrency"] = n, int(cores)
    return out


# -- main ---------------------------------------------------------------------------------------


def machine(ray_version: str | None = None) -> str:
    load = os.getloadavg()
    return (
        f"{platform.node()} | {os.cpu_count()} cores | load {load[0]:.2f} {load[1]:.2f} | "
        f"{available() / 2**30:.1f} GiB available | Python {platform.python_version()} | "
        f"orchestr {oc.__version__}" + (f" | ray {ray_version}" if ray_version else "")
    )


def _round(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 5; quick 2)")
    parser.add_argument("--batch", type=int, default=None, help="meshes at once (default 20)")
    parser.add_argument(
        "--per-process",
        default="50,500,10",
        help="actors per orchestr process for 1,000 (first: headline)",
    )
    parser.add_argument(
        "--process-each",
        type=int,
        default=None,
        help="actors a process each (default 100; quick 20)",
    )
    parser.add_argument("--peers", default="ray", help="ray, or none")
    add_record_flag(parser)
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("this benchmark makes network namespaces: run it as root")
    if args.peers not in ("ray", "none"):
        parser.error("--peers is ray or none")
    ks = [int(k) for k in args.per_process.split(",") if k]
    if not ks or any(k < 1 for k in ks):
        parser.error("--per-process takes positive integers")
    signal.signal(signal.SIGTERM, exit_on_signal)
    signal.signal(signal.SIGHUP, exit_on_signal)

    quick = args.quick
    reps = args.reps or (2 if quick else 5)
    big = 1 if quick else 3
    n_each = args.process_each or (20 if quick else 100)
    plan: dict[str, Any] = {
        "reps": reps,
        "batch": args.batch or (8 if quick else 20),
        "mesh_iters": 4 if quick else 10,
        "reserve_iters": 50 if quick else 200,
        "pg_actors_iters": 2 if quick else 5,
        "place_iters": 5_000 if quick else 20_000,
        "rtt_seconds": 0.3 if quick else 1.0,
        "ray_actors": [[n_each, big]],
    }
    print(machine(), flush=True)
    started = time.monotonic()
    python = ensure_venv("ray", RAY_REQUIREMENTS) if args.peers == "ray" else None
    workdir = Path(tempfile.mkdtemp(prefix="orchestr-cluster-"))
    PROCS.cleanups.append(lambda: shutil.rmtree(workdir, ignore_errors=True))
    orch: dict[str, Any] = {}
    ray: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    try:
        with Hosts() as hosts:
            log(f"hosts: {', '.join(f'{hosts.ns[k]} ({hosts.ip[k]})' for k in 'hab')}")
            log("limits")
            limits = measure_limits(hosts, 1000 // ks[0], reps, plan["rtt_seconds"], python)
            if python is not None:
                log("ray")
                try:
                    ray = ray_cluster(python, hosts, plan)
                except RuntimeError as exc:
                    log(f"ray failed (reported as null): {exc}")
            fitted = [a["n"] for a in ray.get("actors", []) if "seconds" in a]
            n_each = fitted[0] if fitted else n_each
            plan["actors"] = [[1000, ks[0], big], *([1000, k, 1] for k in ks[1:])]
            plan["actors"].append([n_each, 1, big])
            log("orchestr")
            orch = orchestr_cluster(hosts, plan, workdir)
    finally:
        PROCS.stop_all()
    log(f"done in {time.monotonic() - started:.0f} s")
    print(machine(ray.get("_versions", {}).get("ray")), flush=True)
    print(
        "hosts: three network namespaces on one kernel (H: heads and drivers; A, B: actors), "
        "veth pairs on a bridge" + ("; Ray ran first, then orchestr" if python is not None else "")
    )
    result = report(orch, ray, limits, ks, n_each)
    print(
        json.dumps({name: {k: _round(v) for k, v in part.items()} for name, part in result.items()})
    )
    if args.record:
        record("cluster", result, peers=["ray"] if python is not None else [])


if __name__ == "__main__":
    main()
