"""Per-step controller overhead of a fan-out/fan-in step: orchestr and Ray side by side, with the
machine's limit.

    python bench/dataflow.py [--sizes 64,256] [--steps S] [--reps R] [--quick] [--peers none]
                             [--depth D] [--per-process K]

One controller sends one small item (an int) to every actor of a group of N light actors; each
actor's no-op endpoint returns it at once; the controller gathers all N results. A step is one
such fan-out/fan-in. ``step_overhead_us_N`` is the median over repetitions of wall time per
step in µs, each repetition timing S back-to-back steps (default 100) after a warm-up
repetition; larger groups run S*64/N steps, at least 20, so each repetition moves about as many
messages. ``--quick``: S=40, 2 repetitions (default 5).

- ``orchestr``: ``await mesh.step.call(i)`` over a mesh spawned with ``resources={"cpu": 0}``;
  every actor is a worker process of its own.
  ``--per-process K`` puts K members in each worker process (light actors; default 1).
- ``orchestr_compiled``: the compiled-graph path, ``orchestr.Graph`` (``g.fanout`` over the
  mesh's endpoint, ``await g.compile(ctx)``, ``await compiled.execute(i)``), sequential steps
  and, as ``step_overhead_us_N_pipelined``, with ``--depth`` steps in flight. Null, with the
  reason, while orchestr has no ``Graph`` with ``compile``.
- ``ray`` / ``ray_compiled`` (``bench/peers/ray_dataflow.py``, ``ray==2.60.0`` in its own venv
  under ``bench/.venvs``): ``ray.get([a.step.remote(i) for a in actors])`` over ``num_cpus=0``
  actors, and a Ray Compiled Graph (``InputNode``, ``MultiOutputNode``,
  ``experimental_compile()``, ``execute()``) on CPU, sequential and pipelined likewise.
- ``limit`` (``bench/_limit_fanout.py``): no runtime: N echo server processes and a uvloop
  controller that writes one msgpack frame to each and counts the replies.

Systems run one after another, each torn down before the next. Each worker's resident set
(``VmRSS``) and proportional set (``Pss``, shared pages divided among their users) are read
from ``/proc`` once a group is up; a group is skipped, with the reason, when the machine has
not the memory for it. Targets: orchestr ≥ 5x lower than Ray's dynamic path, orchestr compiled
≥ 2x lower than Ray Compiled Graphs. The last line of stdout is one JSON object
``{"orchestr": {...}, "orchestr_compiled": {...}, "ray": {...}, "ray_compiled": {...},
"limit": {...}}`` with ``step_overhead_us_N`` (null where a system could not run).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import uvloop  # noqa: E402
from _venvs import RAY_REQUIREMENTS, ensure_venv  # noqa: E402

import orchestr as oc  # noqa: E402
from orchestr._log import configure_logging  # noqa: E402

SYSTEMS = ("orchestr", "orchestr_compiled", "ray", "ray_compiled", "limit")
TARGETS = (("orchestr", "ray", 5.0), ("orchestr_compiled", "ray_compiled", 2.0))
#: What one more worker is assumed to need (bytes; an orchestr worker's proportional set is
#: about 27 MiB, a Ray worker's about 45); the margin stays free besides.
WORKER_ESTIMATE = 64 << 20
MARGIN = 2 << 30
#: A compiled run that does not finish in this long is given up, and reported as such.
COMPILED_DEADLINE_S = 300.0

Result = dict[str, Any]  # a summary {"median", "min", "max", ...}, or {"error": reason}


class Leaf(oc.Actor):
    @oc.endpoint
    def step(self, x: int) -> int:
        return x

    @oc.endpoint
    def pid(self) -> int:
        return os.getpid()


def summarize(samples: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "values": samples,
    }


async def per_step_us(
    steps: int, reps: int, run: Callable[[int], Awaitable[None]]
) -> dict[str, Any]:
    """Time ``run(steps)`` ``reps`` times after one warm-up; µs per step."""
    await run(steps)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        await run(steps)
        samples.append((time.perf_counter() - start) / steps * 1e6)
    return summarize(samples)


def memory(pid: int) -> tuple[int, int]:
    """VmRSS and Pss of a process, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/smaps_rollup") as f:
        pss = next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    return rss * 1024, pss * 1024


def available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def error(exc: BaseException) -> Result:
    """The reason for a null: the first line of the error and, when it quotes output (a remote
    traceback), its last line too."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = " ... ".join(dict.fromkeys(lines[:1] + lines[-1:]))
    return {"error": f"{type(exc).__name__}: {text}"[:400]}


# -- orchestr --------------------------------------------------------------------------------


def _results(value: Any) -> list[Any]:
    """A compiled graph's output: ``{"step": [...]}`` or the list itself."""
    return list(value["step"] if isinstance(value, dict) else value)


async def measure_compiled(
    ctx: oc.JobContext, mesh: oc.Mesh, steps: int, reps: int, depth: int
) -> Result:
    graph_cls = getattr(oc, "Graph", None)
    if graph_cls is None:
        return {"error": "orchestr has no Graph yet: the compiled-graph path is not built"}
    g = graph_cls("step")
    if not hasattr(g, "compile"):
        return {"error": "orchestr.Graph has no compile() yet"}
    x = g.input("x")
    g.output(g.fanout("step", mesh.step, x))
    start = time.perf_counter()
    compiled = await g.compile(ctx)
    compile_s = time.perf_counter() - start
    try:
        if _results(await compiled.execute(7)) != [7] * len(mesh):
            raise RuntimeError("the compiled graph returned wrong results")

        async def sequential(count: int) -> None:
            for i in range(count):
                await compiled.execute(i)

        async def pipelined(count: int) -> None:
            inflight: collections.deque[asyncio.Future[Any]] = collections.deque()
            try:
                for i in range(count):
                    if len(inflight) == depth:
                        await inflight.popleft()
                    inflight.append(asyncio.ensure_future(compiled.execute(i)))
                while inflight:
                    await inflight.popleft()
            finally:
                for fut in inflight:
                    fut.cancel()

        out: Result = await per_step_us(steps, reps, sequential)
        out["pipelined"] = await per_step_us(steps, reps, pipelined)
        out.update(pipeline_depth=depth, compile_s=compile_s)
        return out
    finally:
        await compiled.aclose()


async def _steps(endpoint: oc.Endpoint, count: int) -> None:
    for i in range(count):
        await endpoint.call(i)


async def spawn_group(
    ctx: oc.JobContext, n: int, per_process: int
) -> tuple[oc.Mesh, list[oc.Mesh], str | None]:
    """A mesh of ``n`` leaves in one spawn (the node starts a few worker processes at a time,
    so hundreds of them do not starve the machine), the meshes spawned, and no note."""
    mesh = await ctx.spawn(Leaf, n=n, resources={"cpu": 0}, per_process=per_process)
    return mesh, [mesh], None


async def measure_size(
    ctx: oc.JobContext, n: int, steps: int, reps: int, depth: int, per_process: int
) -> tuple[Result, Result]:
    start = time.perf_counter()
    mesh, parts, note = await spawn_group(ctx, n, per_process)
    try:
        mem = [memory(pid) for pid in await mesh.pid.call()]
        log(f"orchestr: {n} actors up in {time.perf_counter() - start:.1f} s")
        if await mesh.step.call(7) != [7] * n:
            raise RuntimeError("the mesh returned wrong results")
        dynamic = await per_step_us(steps, reps, functools.partial(_steps, mesh.step))
        dynamic.update(
            worker_rss=statistics.median(r for r, _ in mem),
            worker_pss=statistics.median(p for _, p in mem),
            steps=steps,
            reps=reps,
        )
        if note:
            dynamic["note"] = note
        log(f"orchestr N={n}: {dynamic['median']:,.0f} us/step")
        try:
            async with asyncio.timeout(COMPILED_DEADLINE_S):
                compiled = await measure_compiled(ctx, mesh, steps, reps, depth)
        except Exception as exc:  # reported with its reason; the rest still runs
            compiled = error(exc)
        log(f"orchestr_compiled N={n}: {_fmt(compiled)}")
        return dynamic, compiled
    finally:
        await asyncio.gather(*(ctx.stop(m) for m in parts))


async def measure_orchestr(
    cases: list[tuple[int, int]], reps: int, depth: int, per_process: int
) -> tuple[dict[int, Result], dict[int, Result]]:
    dynamic: dict[int, Result] = {}
    compiled: dict[int, Result] = {}
    # All members of a mesh start at once: 256 interpreters importing side by side on a small
    # machine take longer than the default worker_start_timeout (60 s).
    config = oc.load_config(worker_start_timeout=600.0)
    async with oc.open_local_cluster(config) as ctx:
        for n, steps in cases:
            need = -(-n // per_process) * WORKER_ESTIMATE + MARGIN
            if need > available():
                dynamic[n] = compiled[n] = {
                    "error": f"not enough memory for {n} workers: {need >> 20} MiB wanted, "
                    f"{available() >> 20} MiB available"
                }
                continue
            try:
                dynamic[n], compiled[n] = await measure_size(
                    ctx, n, steps, reps, depth, per_process
                )
            except Exception as exc:  # reported with its reason; the other sizes still run
                dynamic[n] = compiled[n] = error(exc)
                log(f"orchestr N={n} failed: {dynamic[n]['error']}")
    return dynamic, compiled


# -- limit and Ray, in processes of their own ------------------------------------------------


def _spec(cases: list[tuple[int, int]]) -> str:
    return ",".join(f"{n}:{s}" for n, s in cases)


def _last_json(cmd: list[str], env: dict[str, str] | None = None) -> Any:
    """Run ``cmd`` (its progress on our stderr) and parse the last line of its stdout."""
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=1800, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[1]).name} exited with {proc.returncode} (see stderr)")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _by_size(data: dict[str, Any]) -> dict[int, Result]:
    return {int(k): v for k, v in data.items() if not k.startswith("_")}


def measure_limit(cases: list[tuple[int, int]], reps: int) -> dict[int, Result]:
    data = _last_json([sys.executable, str(HERE / "_limit_fanout.py"), _spec(cases), str(reps)])
    return _by_size(data)


def measure_ray(
    cases: list[tuple[int, int]], reps: int, depth: int
) -> tuple[dict[int, Result], dict[int, Result], str]:
    python = ensure_venv("ray", RAY_REQUIREMENTS)
    # Ray 2.60 wants an auth token; this run gets one of its own.
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token")
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    cmd = [str(python), str(HERE / "peers" / "ray_dataflow.py"), _spec(cases)]
    data = _last_json([*cmd, "--reps", str(reps), "--depth", str(depth)], env=env)
    return _by_size(data["ray"]), _by_size(data["ray_compiled"]), data["_versions"]["ray"]


# -- report ----------------------------------------------------------------------------------


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _fmt(r: Result | None) -> str:
    if r is None:
        return "not run"
    if "error" in r:
        return f"null ({r['error']})"
    return f"{r['median']:>9,.0f} [{r['min']:,.0f}-{r['max']:,.0f}]"


def _median(r: Result | None) -> float | None:
    return None if r is None or "error" in r else float(r["median"])


def machine(ray_version: str | None = None) -> str:
    load = os.getloadavg()
    return (
        f"{platform.node()} | {os.cpu_count()} cores | load {load[0]:.2f} {load[1]:.2f} | "
        f"{available() / 2**30:.1f} GiB available | Python {platform.python_version()} | "
        f"orchestr {oc.__version__} | uvloop {uvloop.__version__}"
        + (f" | ray {ray_version}" if ray_version else "")
    )


def print_table(results: dict[str, dict[int, Result]], sizes: list[int], depth: int) -> None:
    rows = [(s, s, False) for s in SYSTEMS]
    rows.insert(2, ("orchestr_compiled", f"  pipelined ({depth} in flight)", True))
    rows.insert(5, ("ray_compiled", f"  pipelined ({depth} in flight)", True))
    print(
        f"{'system':32s}{'N':>5s}  {'µs/step median [min-max]':>30s}{'x orchestr':>12s}  worker MiB"
    )
    for n in sizes:
        base = _median(results["orchestr"].get(n))
        for system, label, pipelined in rows:
            r = results[system].get(n)
            if pipelined:
                if r is None or "pipelined" not in r:
                    continue
                r = r["pipelined"]
            m = _median(r)
            ratio = f"{m / base:.2f}" if m is not None and base else "-"
            mem = ""
            if r is not None and "worker_rss" in r:
                mem = f"rss {r['worker_rss'] / 2**20:.0f} / pss {r['worker_pss'] / 2**20:.0f}"
            text = "null" if r is not None and "error" in r else _fmt(r)
            print(f"{label:32s}{n:>5d}  {text:>30s}{ratio:>12s}  {mem}")
    print("x orchestr: the system's µs per step over orchestr's dynamic path (lower is better).")
    for system in SYSTEMS:
        for n in sizes:
            r = results[system].get(n)
            if r is not None and "error" in r:
                print(f"  {system} N={n} is null: {r['error']}")
            elif r is not None and "note" in r:
                print(f"  {system} N={n}: {r['note']}")
    print("Targets:")
    for ours, peer, want in TARGETS:
        for n in sizes:
            a, b = _median(results[ours].get(n)), _median(results[peer].get(n))
            if a is None or b is None:
                verdict = f"n/a ({ours if a is None else peer} did not run)"
            else:
                verdict = f"{b / a:.2f}x lower: {'PASS' if b / a >= want else 'MISS'}"
            print(f"  {ours} >= {want:g}x lower than {peer}, N={n}: {verdict}")


def record_figures(results: dict[str, dict[int, Result]], sizes: list[int]) -> dict[str, Any]:
    """The JSON line's figures, with each repeat's value where the run kept them."""
    out = summary_json(results, sizes)
    for system, by_size in results.items():
        for n, r in by_size.items():
            for key, summary in (
                (f"step_overhead_us_{n}", r),
                (f"step_overhead_us_{n}_pipelined", (r or {}).get("pipelined")),
            ):
                if isinstance(summary, dict) and summary.get("values"):
                    out[system][key] = {"values": summary["values"]}
    return out


def summary_json(results: dict[str, dict[int, Result]], sizes: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system in SYSTEMS:
        entry: dict[str, Any] = {}
        notes: dict[str, str] = {}
        for n in sorted({*sizes, 64, 256}):
            r = results[system].get(n)
            entry[f"step_overhead_us_{n}"] = None if _median(r) is None else round(r["median"], 1)
            if system.endswith("_compiled"):
                p = None if r is None else r.get("pipelined")
                entry[f"step_overhead_us_{n}_pipelined"] = (
                    None if p is None else round(p["median"], 1)
                )
            if r is not None and ("error" in r or "note" in r):
                notes[str(n)] = r.get("error") or r["note"]
            if r is not None and "worker_rss" in r:
                entry[f"worker_rss_mib_{n}"] = round(r["worker_rss"] / 2**20, 1)
                entry[f"worker_pss_mib_{n}"] = round(r["worker_pss"] / 2**20, 1)
        if notes:
            entry["notes"] = notes
        out[system] = entry
    return out


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256", help="group sizes, comma list")
    parser.add_argument("--steps", type=int, help="steps per repetition at 64 actors (100)")
    parser.add_argument("--reps", type=int, help="timed repetitions per figure (5)")
    parser.add_argument("--depth", type=int, default=3, help="steps in flight when pipelined")
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--peers", default="ray", help="ray, or none to skip Ray")
    parser.add_argument(
        "--per-process",
        type=int,
        default=1,
        help="orchestr members per worker process (default 1, like Ray and the limit)",
    )
    add_record_flag(parser)
    args = parser.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",") if s})
    steps = args.steps or (40 if args.quick else 100)
    reps = args.reps or (2 if args.quick else 5)
    if (
        min(sizes, default=0) < 1
        or min(steps, reps, args.per_process) < 1
        or not 1 <= args.depth <= 8
    ):
        parser.error("sizes, steps, reps, per-process must be positive, depth between 1 and 8")
    if args.peers not in ("ray", "none"):
        parser.error("--peers is ray or none")
    cases = [(n, steps if n <= 64 else max(20, round(steps * 64 / n))) for n in sizes]

    configure_logging(json=False, level="WARNING")
    started = time.perf_counter()
    print(machine(), flush=True)
    results: dict[str, dict[int, Result]] = {s: {} for s in SYSTEMS}
    results["orchestr"], results["orchestr_compiled"] = uvloop.run(
        measure_orchestr(cases, reps, args.depth, args.per_process)
    )
    try:
        results["limit"] = measure_limit(cases, reps)
    except (RuntimeError, subprocess.SubprocessError, ValueError) as exc:
        results["limit"] = {n: error(exc) for n in sizes}
    ray_version = None
    if args.peers == "ray":
        try:
            results["ray"], results["ray_compiled"], ray_version = measure_ray(
                cases, reps, args.depth
            )
        except (RuntimeError, subprocess.SubprocessError, ValueError, KeyError) as exc:
            results["ray"] = results["ray_compiled"] = {n: error(exc) for n in sizes}
    else:
        results["ray"] = results["ray_compiled"] = {n: {"error": "--peers none"} for n in sizes}
    print(machine(ray_version), flush=True)
    print(
        f"{', '.join(f'N={n}: {s} steps' for n, s in cases)} per repetition, {reps} repetitions; "
        f"orchestr members per worker process: {args.per_process}"
    )
    print_table(results, sizes, args.depth)
    print(f"whole run: {time.perf_counter() - started:.0f} s")
    print(json.dumps(summary_json(results, sizes)))
    if args.record:
        record("dataflow", record_figures(results, sizes), peers=["ray"] if ray_version else [])


if __name__ == "__main__":
    main()
