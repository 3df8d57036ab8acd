"""Large-tensor transfer, actor to actor: orchestr and Ray side by side, with the machine's limits.

    python bench/transfer.py [--quick] [--iters N] [--no-peers] [--no-cross-host]

A sender actor moves a 64 MiB and a 1 GiB float32 tensor to a receiver actor, on one host and
across two hosts. Before every transfer the sender refreshes a preallocated tensor in place
(``+= 1`` through numpy, untimed, as the limit and the Ray sender do), so each transfer moves
new data; then it times one call that hands the tensor to ``receiver.take`` and waits for the
answer (the element count, or ``nbytes`` on Ray). Figures are GB/s (10^9 bytes per second) of the median transfer, with min and max.

- **orchestr**: ``Sender.run`` awaits ``receiver.take.call_one(x)`` with a torch tensor.
  The "registered" rows send a tensor allocated with ``orchestr.fabric.empty``, which lives in
  shared memory from the start.
- **Ray** (``bench/peers/ray_transfer.py``, ``ray==2.60.0`` with numpy in its own venv under
  ``bench/.venvs``): the sender actor calls ``ray.get(receiver.take.remote(arr))`` with a numpy
  array, Ray's zero-copy path: the argument goes through the object store, warm after warm-up
  transfers.
- **Two hosts** are two network namespaces joined by a veth pair (default MTU, no shaping).
  orchestr: the job's driver and its in-process node (labels ``host=a``) run in namespace A,
  a second node (``python -m orchestr._cluster._node``, labels ``host=b``) in namespace B, and the receiver
  is placed there by label. Ray: ``ray start --head`` in A and ``ray start --address`` in B,
  the driver in A, the actors placed with the custom resources ``hostA`` / ``hostB``.
- **Limits** (``bench/_limit_transfer.py``): ``np.copyto`` into a pre-faulted array (memcpy);
  a copy into a reused shared-memory segment that a second process views without copying
  (the best a shared-memory path can do, the limit for one host); raw TCP between two processes
  on loopback and across the namespaces (the limit for two hosts). The copies are
  single-threaded: a runtime that copies with several threads (Ray's object store does for
  large objects) can pass them.
- **Memory**: each actor's resident set before a case and its peak during it (``VmHWM``, reset
  through ``/proc/PID/clear_refs``); growth is shown as a multiple of the tensor size. The
  sender's includes the tensor it computes (1.0 = no copy besides it); the receiver's 0 means
  that it only mapped the data (neither receiver reads the values). Shared pages count: a Ray
  sender's peak includes the object-store pages it wrote.
- The Ray cluster in the namespaces runs ``ray start --block`` under this script, which ends
  those processes (their sessions) itself: ``ray stop`` would end every Ray process on the
  machine. The cluster, its driver and its same-host run use a token of their own
  (``RAY_AUTH_TOKEN``).

``--quick`` runs 5 transfers of 64 MiB and one of 1 GiB. ``--iters N`` sets the 64 MiB count
(default 20); 1 GiB gets N/4 (at least 2; 1 with ``--quick``). Progress goes to stderr; the
last line of stdout is one JSON object ``{"orchestr": {...}, "ray": {...}, "limit": {...}}``
(medians; null for what did not run): ``transfer_{64MiB,1GiB}_{same,cross}_host_gbps`` and
``receiver_peak_rss_over_size`` (1 GiB, one host) for both runtimes, orchestr's
``transfer_registered_*`` too, and ``memcpy_gbps``, ``shm_zero_copy_read_{64MiB,1GiB}_gbps``,
``socket_gbps`` (loopback) and ``socket_cross_host_gbps`` for the limits.
Needs root for the namespaces; ``--no-cross-host`` skips them.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import uvloop  # noqa: E402
from _procs import Processes, exit_on_signal, kill_by_marker  # noqa: E402
from _venvs import RAY_TRANSFER_REQUIREMENTS, ensure_venv  # noqa: E402

import orchestr as oc  # noqa: E402
from orchestr import fabric  # noqa: E402
from orchestr._log import configure_logging  # noqa: E402

SIZES = {"64MiB": 64 << 20, "1GiB": 1 << 30}
MEMCPY_BYTES = 256 << 20
CALL_TIMEOUT_S = 900.0
SUBNET = "10.213.77"  # only ever assigned inside the two namespaces this script creates

CaseSpec = tuple[int, int, int]  # nbytes, timed iterations, warm-up iterations
Case = dict[str, Any]  # {"seconds": [...], "sender": {...}, "receiver": {...}}


def log(message: str) -> None:
    print(f"[transfer] {message}", file=sys.stderr, flush=True)


def memory(reset: bool) -> dict[str, int]:
    """This process's resident set and its peak, in bytes; ``reset`` restarts the peak."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    return {"rss": out["VmRSS"], "hwm": out["VmHWM"], "pid": os.getpid()}


# -- the actors ----------------------------------------------------------------------------


async def timed_sends(receiver: oc.Mesh, x: torch.Tensor, iters: int, warmup: int) -> list[float]:
    """Refresh ``x`` in place (untimed), send it to ``receiver.take`` and wait, ``warmup + iters``
    times; return the seconds of the last ``iters`` transfers."""
    take = receiver.take.options(timeout=CALL_TIMEOUT_S)
    refresh = x.numpy()
    times = []
    for _ in range(warmup + iters):
        refresh += 1.0  # numpy in place, as the limit and the Ray sender refresh theirs
        start = time.perf_counter()
        got = await take.call_one(x)
        times.append(time.perf_counter() - start)
        if got != x.numel():
            raise RuntimeError(f"the receiver saw {got} elements, not {x.numel()}")
    return times[warmup:]


class _Measured(oc.Actor):
    """Both ends report their memory and where they run."""

    @oc.endpoint
    def memory(self, reset: bool) -> dict[str, int]:
        return memory(reset)

    @oc.endpoint
    def where(self) -> str:
        return f"{oc.load_config().bind_host} pid {os.getpid()}"


class Receiver(_Measured):
    @oc.endpoint
    def take(self, t: torch.Tensor) -> int:
        return t.numel()


class Sender(_Measured):
    @oc.endpoint
    async def run(self, receiver: oc.Mesh, nbytes: int, iters: int, warmup: int) -> list[float]:
        x = torch.zeros(nbytes // 4, dtype=torch.float32)
        return await timed_sends(receiver, x, iters, warmup)

    @oc.endpoint
    async def run_registered(
        self, receiver: oc.Mesh, nbytes: int, iters: int, warmup: int
    ) -> list[float]:
        """The tensor lives in registered (shared) memory from the start: on one host sending
        it copies nothing; across hosts it travels like any tensor."""
        x = fabric.empty(nbytes // 4, torch.float32)
        x.zero_()
        return await timed_sends(receiver, x, iters, warmup)


async def run_cases(sender: oc.Mesh, receiver: oc.Mesh, cases: list[CaseSpec]) -> dict[str, Any]:
    """Every case, plain and registered; memory is read around each."""
    out: dict[str, Any] = {
        "placement": {
            "sender": await sender.where.call_one(),
            "receiver": await receiver.where.call_one(),
        },
        "plain": {},
        "registered": {},
    }
    log(
        f"orchestr: sender at {out['placement']['sender']}, receiver at {out['placement']['receiver']}"
    )
    for kind, endpoint in (("plain", sender.run), ("registered", sender.run_registered)):
        for nbytes, iters, warmup in cases:
            before = await asyncio.gather(
                sender.memory.call_one(True), receiver.memory.call_one(True)
            )
            seconds = await endpoint.options(timeout=CALL_TIMEOUT_S).call_one(
                receiver, nbytes, iters, warmup
            )
            after = await asyncio.gather(
                sender.memory.call_one(False), receiver.memory.call_one(False)
            )
            out[kind][str(nbytes)] = {
                "seconds": seconds,
                "sender": {"rss_before": before[0]["rss"], "peak": after[0]["hwm"]},
                "receiver": {"rss_before": before[1]["rss"], "peak": after[1]["hwm"]},
            }
            rate = gbps(out[kind][str(nbytes)], nbytes)
            assert rate is not None
            log(f"orchestr {kind}: {_label(nbytes)}: {rate['median']:.2f} GB/s (median)")
    return out


async def orchestr_same_host(cases: list[CaseSpec]) -> dict[str, Any]:
    async with oc.open_local_cluster() as ctx:
        sender = await ctx.spawn(Sender, name="sender")
        receiver = await ctx.spawn(Receiver, name="receiver")
        return await run_cases(sender, receiver, cases)


def _import_path() -> str:
    return os.pathsep.join(dict.fromkeys(p for p in sys.path if p and os.path.isdir(p)))


def start_node_b(ns_b: str, ip_b: str, head: str, token: str, logs: str) -> subprocess.Popen[bytes]:
    """``python -m orchestr._cluster._node`` in namespace B, joining the head with labels ``host=b``."""
    env = dict(os.environ, ORCHESTR_TOKEN=token, ORCHESTR_BIND_HOST=ip_b, PYTHONPATH=_import_path())
    cmd = ["ip", "netns", "exec", ns_b, sys.executable, "-m", "orchestr._cluster._node"]
    with open(logs, "ab") as out:
        return subprocess.Popen(
            [*cmd, "--head", head, "--labels", "host=b"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _tail(path: str, lines: int = 15) -> str:
    with open(path, errors="replace") as f:
        return "\n".join(f.read().splitlines()[-lines:])


def stop_node_b(node: subprocess.Popen[bytes]) -> None:
    node.terminate()
    try:
        node.wait(timeout=15)
    except subprocess.TimeoutExpired:
        node.kill()
        node.wait()


async def orchestr_cross_driver(
    cases: list[CaseSpec], ns_b: str, ip_b: str, logs: str
) -> dict[str, Any]:
    """The job's driver, in namespace A: a node started in namespace B joins, and the receiver
    is placed there."""
    async with oc.open_local_cluster(labels={"host": "a"}) as ctx:
        node = start_node_b(ns_b, ip_b, ctx.head_address, ctx.token, logs)
        meshes: list[oc.Mesh] = []
        try:
            deadline = time.monotonic() + 60
            while len(await ctx.nodes()) < 2:
                if node.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the node in {ns_b} did not join:\n{_tail(logs)}")
                await asyncio.sleep(0.1)
            sender = await ctx.spawn(Sender, name="sender", labels={"host": "a"})
            meshes.append(sender)
            receiver = await ctx.spawn(Receiver, name="receiver", labels={"host": "b"})
            meshes.append(receiver)
            return await run_cases(sender, receiver, cases)
        finally:
            for mesh in meshes:
                with contextlib.suppress(oc.OrchestrError):
                    await ctx.stop(mesh)
            stop_node_b(node)


# -- processes and namespaces this script starts ----------------------------------------


PROCS = Processes(progress=("[transfer]", "ray: "))
atexit.register(PROCS.stop_all)


def run_json(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 600) -> Any:
    return PROCS.run_json(cmd, env=env, timeout=timeout)


class HostPair:
    """Two network namespaces, A and B, joined by a veth pair: two hosts on one kernel."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.a, self.b = f"oc-tx-a-{tag}", f"oc-tx-b-{tag}"
        self.veth_a, self.veth_b = f"octa{tag}", f"octb{tag}"
        self.ip_a, self.ip_b = f"{SUBNET}.1", f"{SUBNET}.2"
        self.created: list[str] = []

    def __enter__(self) -> HostPair:
        PROCS.cleanups.append(self.close)
        for ns in (self.a, self.b):
            self._ip("netns", "add", ns)
            self.created.append(ns)
        self._ip("link", "add", self.veth_a, "type", "veth", "peer", "name", self.veth_b)
        for ns, dev, ip in ((self.a, self.veth_a, self.ip_a), (self.b, self.veth_b, self.ip_b)):
            self._ip("link", "set", dev, "netns", ns)
            self._ip("-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
            self._ip("-n", ns, "link", "set", dev, "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        while self.created:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", self.created.pop()], check=False)

    def exec(self, ns: str, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *cmd]

    @staticmethod
    def _ip(*args: str) -> None:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


# -- the measurements ------------------------------------------------------------------------


def _label(nbytes: int) -> str:
    return next((k for k, v in SIZES.items() if v == nbytes), f"{nbytes}B")


def _spec(cases: list[CaseSpec]) -> str:
    return ",".join(f"{n}:{i}:{w}" for n, i, w in cases)


def _parse_spec(text: str) -> list[CaseSpec]:
    out = []
    for item in filter(None, text.split(",")):
        n, i, w = (int(v) for v in item.split(":"))
        out.append((n, i, w))
    return out


LIMIT_SCRIPT = [sys.executable, str(HERE / "_limit_transfer.py")]


def measure_limits(cases: list[CaseSpec]) -> dict[str, Any]:
    """memcpy, the shm zero-copy read at each size and raw loopback TCP, one host."""
    out: dict[str, Any] = {"memcpy": run_json([*LIMIT_SCRIPT, "memcpy", str(MEMCPY_BYTES), "10"])}
    for nbytes, iters, _ in cases:
        reps = 20 if nbytes <= SIZES["64MiB"] else max(iters, 3)  # cheap: more, for a stable median
        out[f"shm_{nbytes}"] = run_json([*LIMIT_SCRIPT, "shm", str(nbytes), str(reps)])
    out["socket"] = run_json([*LIMIT_SCRIPT, "socket", str(SIZES["64MiB"]), "20"])
    return out


def measure_socket_cross(net: HostPair) -> dict[str, Any]:
    """Raw TCP from namespace A to a sink in namespace B, over the veth pair."""
    sink = PROCS.start(
        net.exec(net.b, [*LIMIT_SCRIPT, "sink", "--host", net.ip_b]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sink.stdout is not None
        port = int(sink.stdout.readline())
        cmd = [
            *LIMIT_SCRIPT,
            "socket",
            str(SIZES["64MiB"]),
            "20",
            "--connect",
            f"{net.ip_b}:{port}",
        ]
        return run_json(net.exec(net.a, cmd))  # type: ignore[no-any-return]
    finally:
        PROCS.stop(sink)


def orchestr_cross(cases: list[CaseSpec], net: HostPair, workdir: str) -> dict[str, Any]:
    env = dict(os.environ)
    env["ORCHESTR_BIND_HOST"] = net.ip_a
    node_log = os.path.join(workdir, "node-b.log")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--cross-driver", _spec(cases)]
    cmd += ["--ns-b", net.b, "--ip-b", net.ip_b, "--node-log", node_log]
    return run_json(net.exec(net.a, cmd), env=env, timeout=900)  # type: ignore[no-any-return]


def _ray_env(token: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    return env


def ray_same_host(python: Path, cases: list[CaseSpec]) -> dict[str, Any]:
    cmd = [str(python), str(HERE / "peers" / "ray_transfer.py"), _spec(cases)]
    return run_json(cmd, env=_ray_env(secrets.token_hex(32)), timeout=900)  # type: ignore[no-any-return]


def _wait_for_text(path: str, text: str, proc: subprocess.Popen[Any], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        with open(path, errors="replace") as f:
            content = f.read()
        if text in content:
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(content.splitlines()[-15:])
            raise RuntimeError(f"no {text!r} from {proc.args[4:8]}:\n{tail}")
        time.sleep(0.2)


def ray_cross(python: Path, cases: list[CaseSpec], net: HostPair) -> dict[str, Any]:
    """A two-node Ray cluster, head in A and a worker node in B; the driver runs in A."""
    ray = str(python.parent / "ray")
    tmp = tempfile.mkdtemp(prefix="otx-")  # short: Ray puts unix sockets under it
    PROCS.cleanups.append(lambda: shutil.rmtree(tmp, ignore_errors=True))
    PROCS.cleanups.append(lambda: kill_by_marker(tmp))
    env = _ray_env(secrets.token_hex(32))
    store = str(3 << 30)
    common = ["--block", "--num-cpus", "2", "--object-store-memory", store, "--disable-usage-stats"]
    nodes = [
        (net.a, net.ip_a, ["--head", "--port", "6379", "--include-dashboard=false"], "hostA"),
        (net.b, net.ip_b, ["--address", f"{net.ip_a}:6379"], "hostB"),
    ]
    started = []
    try:
        for ns, ip, role, resource in nodes:
            logfile = os.path.join(tmp, f"{resource}.log")
            cmd = [ray, "start", *role, *common, "--node-ip-address", ip]
            cmd += [
                "--resources",
                json.dumps({resource: 1}),
                "--temp-dir",
                os.path.join(tmp, resource),
            ]
            with open(logfile, "wb") as f:
                proc = PROCS.start(net.exec(ns, cmd), env=env, stdout=f, stderr=subprocess.STDOUT)
            started.append(proc)
            _wait_for_text(logfile, "Ray runtime started", proc, 90)
        driver = [str(python), str(HERE / "peers" / "ray_transfer.py"), _spec(cases)]
        driver += ["--address", f"{net.ip_a}:6379"]
        return run_json(net.exec(net.a, driver), env=env, timeout=900)  # type: ignore[no-any-return]
    finally:
        for proc in reversed(started):
            PROCS.stop(proc, grace=3.0)
        kill_by_marker(tmp)


# -- results -------------------------------------------------------------------------------


def gbps(case: Case | None, nbytes: int) -> dict[str, float] | None:
    if not case:
        return None
    rates = [nbytes / s / 1e9 for s in case["seconds"]]
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


def growth(case: Case | None, who: str, nbytes: int) -> float | None:
    if not case:
        return None
    m = case[who]
    return float(max(0, m["peak"] - m["rss_before"]) / nbytes)


def _fmt_rate(s: dict[str, float] | None) -> str:
    if s is None:
        return "n/a"
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def _fmt_ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def _fmt_mem(case: Case | None, nbytes: int) -> str:
    if not case:
        return "n/a"
    s, r = growth(case, "sender", nbytes), growth(case, "receiver", nbytes)
    peak_s, peak_r = case["sender"]["peak"] >> 20, case["receiver"]["peak"] >> 20
    return f"{s:.2f} / {r:.2f} ({peak_s} / {peak_r} MiB)"


def machine() -> str:
    load = os.getloadavg()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return (
        f"{platform.node()} | {os.cpu_count()} cores | {mem:.0f} GiB | load {load[0]:.2f} "
        f"{load[1]:.2f} | Python {platform.python_version()} | orchestr {oc.__version__} | "
        f"torch {torch.__version__}"
    )


def report(
    cases: list[CaseSpec],
    orch: dict[str, Any],
    ray: dict[str, Any],
    limits: dict[str, Any],
    peers: bool,
) -> dict[str, dict[str, float | None]]:
    """Print the tables; return the JSON object's content (medians)."""

    def limit_rate(key: str) -> dict[str, float] | None:
        entry = limits.get(key)
        return gbps({"seconds": entry["seconds"]}, entry["nbytes"]) if entry else None

    lim_stats = {
        "memcpy_gbps": limit_rate("memcpy"),
        "shm_zero_copy_read_64MiB_gbps": limit_rate(f"shm_{SIZES['64MiB']}"),
        "shm_zero_copy_read_1GiB_gbps": limit_rate(f"shm_{SIZES['1GiB']}"),
        "socket_gbps": limit_rate("socket"),
        "socket_cross_host_gbps": limit_rate("socket_cross"),
    }
    lim = {k: (v["median"] if v else None) for k, v in lim_stats.items()}
    rows = []  # (metric, orchestr case, ray case, nbytes, limit, limit name, registered case)
    for where, limit_for in (("same_host", "shm"), ("cross_host", "socket")):
        for label, nbytes in SIZES.items():
            o = orch.get(where) or {}
            r = ray.get(where) or {}
            if limit_for == "shm":
                limit, limit_name = lim[f"shm_zero_copy_read_{label}_gbps"], "shm"
            else:
                limit, limit_name = lim["socket_cross_host_gbps"], "socket veth"
            rows.append(
                (
                    f"transfer_{label}_{where}_gbps",
                    (o.get("plain") or {}).get(str(nbytes)),
                    (r.get("cases") or {}).get(str(nbytes)),
                    nbytes,
                    limit,
                    limit_name,
                    (o.get("registered") or {}).get(str(nbytes)),
                )
            )

    print(
        f"{'GB/s (median [min-max])':36s}{'orchestr':>22s}{'registered':>22s}{'ray':>22s}"
        f"{'limit':>18s}{'vs ray':>9s}{'of limit':>10s}"
    )
    result: dict[str, dict[str, float | None]] = {"orchestr": {}, "ray": {}, "limit": {}}
    for metric, o_case, r_case, nbytes, limit, limit_name, reg_case in rows:
        o_s, r_s, g_s = gbps(o_case, nbytes), gbps(r_case, nbytes), gbps(reg_case, nbytes)
        o_med = o_s["median"] if o_s else None
        r_med = r_s["median"] if r_s else None
        lim_text = f"{limit:.2f} {limit_name}" if limit is not None else "-"
        print(
            f"{metric:36s}{_fmt_rate(o_s):>22s}{_fmt_rate(g_s):>22s}"
            f"{(_fmt_rate(r_s) if peers else '-'):>22s}{lim_text:>18s}"
            f"{_fmt_ratio(o_med, r_med):>9s}{_fmt_ratio(o_med, limit):>10s}"
        )
        result["orchestr"][metric] = o_med
        result["orchestr"][metric.replace("transfer_", "transfer_registered_")] = (
            g_s["median"] if g_s else None
        )
        result["ray"][metric] = r_med
    print("vs ray: orchestr/ray; of limit: orchestr/limit (one host: the shm zero-copy read of the")
    print("same size; two hosts: raw TCP over the veth pair). GB/s = 10^9 bytes/s.")
    print()
    print(
        f"{'peak RSS growth / size: sender / receiver (peak MiB)':54s}{'orchestr':>36s}{'ray':>36s}"
    )
    for metric, o_case, r_case, nbytes, *_ in rows:
        name = metric.removeprefix("transfer_").removesuffix("_gbps")
        print(
            f"{name:54s}{_fmt_mem(o_case, nbytes):>36s}{(_fmt_mem(r_case, nbytes) if peers else '-'):>36s}"
        )
    print(
        "growth = (peak - resident before the case) / tensor size; the sender's includes its tensor."
    )
    print()
    print("limits, GB/s (median [min-max])")
    described = [
        ("memcpy_gbps", f"np.copyto, {MEMCPY_BYTES >> 20} MiB into a pre-faulted array"),
        (
            "shm_zero_copy_read_64MiB_gbps",
            "copy into shm + zero-copy view in a 2nd process, 64 MiB",
        ),
        ("shm_zero_copy_read_1GiB_gbps", "copy into shm + zero-copy view in a 2nd process, 1 GiB"),
        ("socket_gbps", "raw TCP, loopback, 64 MiB messages"),
        ("socket_cross_host_gbps", "raw TCP, veth between the namespaces, 64 MiB messages"),
    ]
    for key, text in described:
        print(f"  {key:34s}{_fmt_rate(lim_stats[key]):>22s}  {text}")

    one_gib = SIZES["1GiB"]
    same = orch.get("same_host") or {}
    result["orchestr"]["receiver_peak_rss_over_size"] = growth(
        (same.get("plain") or {}).get(str(one_gib)), "receiver", one_gib
    )
    ray_same = ray.get("same_host") or {}
    result["ray"]["receiver_peak_rss_over_size"] = growth(
        (ray_same.get("cases") or {}).get(str(one_gib)), "receiver", one_gib
    )
    result["limit"] = lim
    return result


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 x 64 MiB and 1 x 1 GiB")
    parser.add_argument("--iters", type=int, default=None, help="64 MiB transfers (default 20)")
    parser.add_argument("--no-peers", action="store_true", help="skip Ray")
    parser.add_argument("--no-cross-host", action="store_true", help="skip the two-host cases")
    parser.add_argument("--cross-driver", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ns-b", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ip-b", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--node-log", default=None, help=argparse.SUPPRESS)
    add_record_flag(parser)
    args = parser.parse_args()
    configure_logging(json=False, level="WARNING")
    signal.signal(signal.SIGTERM, exit_on_signal)
    signal.signal(signal.SIGHUP, exit_on_signal)

    if args.cross_driver is not None:
        result = uvloop.run(
            orchestr_cross_driver(
                _parse_spec(args.cross_driver), args.ns_b, args.ip_b, args.node_log
            )
        )
        print(json.dumps(result))
        return

    if args.iters is not None and args.iters < 1:
        parser.error("--iters must be at least 1")
    n64 = args.iters or (5 if args.quick else 20)
    n1g = 1 if args.quick else max(2, n64 // 4)
    cases: list[CaseSpec] = [
        (SIZES["64MiB"], n64, 1 if args.quick else 5),
        (SIZES["1GiB"], n1g, 0 if args.quick else 1),
    ]
    cross = not args.no_cross_host
    if cross and os.geteuid() != 0:
        log("the two-host cases need root (network namespaces); skipping them")
        cross = False

    print(machine(), flush=True)
    started = time.monotonic()
    orch: dict[str, Any] = {}
    ray: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    python = None
    if not args.no_peers:
        python = ensure_venv("ray-transfer", RAY_TRANSFER_REQUIREMENTS)
    workdir = tempfile.mkdtemp(prefix="orchestr-transfer-")
    PROCS.cleanups.append(lambda: shutil.rmtree(workdir, ignore_errors=True))
    try:
        log("limits, one host")
        limits.update(measure_limits(cases))
        log("orchestr, one host")
        orch["same_host"] = uvloop.run(orchestr_same_host(cases))
        if python is not None:
            log("ray, one host")
            try:
                ray["same_host"] = ray_same_host(python, cases)
            except RuntimeError as exc:
                log(f"ray, one host, failed: {exc}")
        if cross:
            with HostPair() as net:
                log(f"two hosts: namespaces {net.a} ({net.ip_a}) and {net.b} ({net.ip_b})")
                limits["socket_cross"] = measure_socket_cross(net)
                log("orchestr, two hosts")
                try:
                    orch["cross_host"] = orchestr_cross(cases, net, workdir)
                except RuntimeError as exc:
                    log(f"orchestr, two hosts, failed: {exc}")
                if python is not None:
                    log("ray, two hosts")
                    try:
                        ray["cross_host"] = ray_cross(python, cases, net)
                        log(f"ray placement: {ray['cross_host'].get('placement')}")
                    except RuntimeError as exc:
                        log(f"ray, two hosts, failed (reported as null): {exc}")
    finally:
        PROCS.stop_all()
    log(f"done in {time.monotonic() - started:.0f} s")
    print(machine(), flush=True)
    result = report(cases, orch, ray, limits, peers=python is not None)
    print(json.dumps({name: {k: _round(v) for k, v in r.items()} for name, r in result.items()}))
    if args.record:
        record("transfer", result, peers=["ray", "numpy"] if python is not None else [])


if __name__ == "__main__":
    main()
