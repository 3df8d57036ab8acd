"""Soak: ``orchestr serve`` under a mixed load for a long time, its generators killed now and
then. It measures whether the server keeps serving and stays the same size:

- **requests**: served, refused as they should be (bad bodies), and failed by cause (the
  HTTP status and OpenAI error type, an error event in a stream, or the client's exception:
  a timeout is a hang), failures within ``--kill-grace`` seconds of a kill counted apart;
- **latency**: p50 and p99 of the requests served, per window of ``--kill-every`` minutes
  (each window holds one kill), and per kind over the run;
- **kills**: every ``--kill-every`` minutes one generator's worker process (``python -m
  orchestr._cluster._worker``, a child of the serve process: with no KV store every worker
  hosts a generator) gets SIGKILL; how long until both generators are in rotation again
  (``orchestr:frontdoor_generators`` on ``/metrics``);
- **resources**: RSS (``VmRSS``), open file descriptors and threads of every process of the
  server (the serve process and its workers) after a warm-up and at the end, sampled through
  the run; growth past ``--rss-growth-mib`` or ``--fd-growth`` is flagged (a restarted worker
  is compared with the largest worker at the start);
- **after**: once the load stops, ``/health`` and a completion should answer 200 and no
  request be left in flight (``vllm:num_requests_running``);
- **the server's log**: its warnings, errors and tracebacks, errors grouped by the exception
  that ended them (a client that hangs up sees none of these);
- **shutdown**: SIGINT at the end; the server should exit 0 and leave no process behind.

The load is ``--clients`` closed-loop clients, each drawing from a seeded mix: completions,
streamed completions, chats (whole and streamed), ``n`` > 1, stop strings, streams closed
midway, hang-ups (a raw connection closed before the answer), and bad bodies (invalid JSON,
wrong types, numbers out of range such as ``top_k`` 2**63, JSON nested 100,000 deep, prompts
too long for the context, a body over 16 MiB), which must be refused with 400 or 413
(``bench/_soak_load.py``). Every answer is at most 64 tokens. The model is ``orchestr model make-tiny --arch llama``, made in a
temporary folder; the server runs on an embedded cluster of its own (a fresh state directory),
on loopback, with ``--generators 2 --torch-threads 1`` and restarts enough for every kill.

    python bench/soak.py [--minutes 30] [--kill-every 5] [--clients 4] [--seed 0]
                         [--out build/soak.json]

It stops by itself after ``--minutes`` (Ctrl-C stops it early, with a report of what ran),
prints the machine, versions and a summary, and writes everything to ``--out``. The server's
log is kept beside the JSON (``soak-server.log``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx2

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _procs import Processes, exit_on_signal, session_members  # noqa: E402
from _soak_load import Tally, client  # noqa: E402

WORKER = b"orchestr._cluster._worker"
GENERATORS = 2


def log(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


# -- the server's processes --------------------------------------------------------------------
def descendants(root: int) -> list[int]:
    """``root`` and every process under it."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children[ppid].append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return WORKER in f.read().split(b"\0")
    except OSError:
        return False


def workers(root: int) -> list[int]:
    return sorted(p for p in descendants(root) if p != root and is_worker(p))


def usage(pid: int) -> dict[str, float] | None:
    """RSS (MiB), open file descriptors and threads of ``pid``; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kib = int(fields.get("VmRSS", "0 kB").split()[0])
    return {"rss_mib": round(rss_kib / 1024, 1), "fds": fds, "threads": int(fields["Threads"])}


def snapshot(root: int) -> dict[str, dict[str, Any]]:
    out = {}
    for pid in descendants(root):
        u = usage(pid)
        if u is not None:
            role = "serve" if pid == root else "worker" if is_worker(pid) else "other"
            out[str(pid)] = {"role": role, **u}
    return out


def growth(start: dict[str, Any], end: dict[str, Any], rss_mib: float, fds: int) -> list[str]:
    """What grew past the thresholds from ``start`` to ``end``: a process alive at both
    against itself, a worker started since against the largest worker at the start."""
    flags = []
    first = [v for v in start.values() if v["role"] == "worker"]
    for pid, now in end.items():
        was = start.get(pid)
        label = f"{now['role']} {pid}"
        if was is None:
            if now["role"] != "worker" or not first:
                flags.append(f"{label}: a process started since the warm-up")
                continue
            was = {k: max(w[k] for w in first) for k in ("rss_mib", "fds", "threads")}
            label += " (restarted; against the largest worker at the start)"
        if now["rss_mib"] - was["rss_mib"] > rss_mib:
            flags.append(f"{label}: RSS {was['rss_mib']} -> {now['rss_mib']} MiB")
        if now["fds"] - was["fds"] > fds:
            flags.append(f"{label}: open files {was['fds']} -> {now['fds']}")
        if now["threads"] - was["threads"] > fds:
            flags.append(f"{label}: threads {was['threads']} -> {now['threads']}")
    return flags


async def gauge(h: httpx2.AsyncClient, name: str) -> int | None:
    """A gauge of the server's ``/metrics``; None when it cannot be read."""
    try:
        text = (await h.get("/metrics")).text
    except httpx2.HTTPError:
        return None
    found = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.]+)$", text, re.M)
    return int(float(found[1])) if found else None


async def generators_up(h: httpx2.AsyncClient) -> int | None:
    return await gauge(h, "orchestr:frontdoor_generators")


async def killer(
    serve: int, url: str, seed: int, tally: Tally, every_s: float, until: float, stop: asyncio.Event
) -> None:
    """SIGKILL one generator's worker every ``every_s``; then time its replacement's process
    and the front door's rotation: down to one generator, back to both."""
    rng = random.Random(seed)
    async with httpx2.AsyncClient(base_url=url, timeout=10) as h:
        k = 1
        while tally.t0 + k * every_s < until and not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), tally.t0 + k * every_s - time.monotonic())
            k += 1
            if stop.is_set():
                return
            before = workers(serve)
            if not before:
                log("no worker process to kill")
                continue
            pid = rng.choice(before)
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            kill: dict[str, Any] = {"t": round(killed - tally.t0, 1), "pid": pid}
            kill.update(rotation_dropped=False, new_worker_after_s=None, back_after_s=None)
            tally.kills.append(kill)
            log(f"SIGKILL worker {pid} at {kill['t']:.0f} s")
            while time.monotonic() < killed + every_s and not stop.is_set():
                now = round(time.monotonic() - killed, 1)
                up = await generators_up(h)
                if up is not None and up < GENERATORS:
                    kill["rotation_dropped"] = True
                if kill["new_worker_after_s"] is None and set(workers(serve)) - set(before):
                    kill["new_worker_after_s"] = now
                if kill["rotation_dropped"] and kill["new_worker_after_s"] and up == GENERATORS:
                    kill["back_after_s"] = now
                    log(f"both generators in rotation again after {now} s")
                    break
                await asyncio.sleep(0.2)


async def sampler(serve: int, series: list[dict[str, Any]], t0: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        snap = snapshot(serve)
        mine = snap.get(str(serve), {})
        ws = [v for v in snap.values() if v["role"] == "worker"]
        series.append({
            "t": round(time.monotonic() - t0, 1),
            "serve_rss_mib": mine.get("rss_mib"),
            "serve_fds": mine.get("fds"),
            "workers": len(ws),
            "workers_rss_mib": round(sum(w["rss_mib"] for w in ws), 1),
            "workers_fds": sum(w["fds"] for w in ws),
        })  # fmt: skip
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 30)


async def load(args: argparse.Namespace, serve: int, url: str, port: int) -> dict[str, Any]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def interrupt() -> None:  # Ctrl-C ends the soak early, with a report; a second one aborts
        log("stopping early (Ctrl-C again to abort)")
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)

    loop.add_signal_handler(signal.SIGINT, interrupt)
    # a warm-up of the same mix, then the resources at the start
    warm = Tally(time.monotonic(), 1e9, 0)
    until = time.monotonic() + args.warmup
    await asyncio.gather(
        *(client(i, url, port, args.seed + 1000, warm, until, stop) for i in range(args.clients))
    )
    start = snapshot(serve)
    log(f"warm-up done ({sum(warm.served.values())} served); the soak begins")
    t0 = time.monotonic()
    tally = Tally(t0, args.kill_every * 60, args.kill_grace)
    until = t0 + args.minutes * 60
    series: list[dict[str, Any]] = []
    tasks = [
        *(client(i, url, port, args.seed, tally, until, stop) for i in range(args.clients)),
        killer(serve, url, args.seed, tally, args.kill_every * 60, until, stop),
    ]
    sampling = asyncio.ensure_future(sampler(serve, series, t0, stop))
    try:
        await asyncio.gather(*tasks)
    finally:
        interrupted = stop.is_set()
        stop.set()
        await sampling
    # the generators back and the clients gone, before the resources at the end
    async with httpx2.AsyncClient(base_url=url, timeout=10) as h:
        for _ in range(120):
            if await generators_up(h) == GENERATORS:
                break
            await asyncio.sleep(0.5)
        healthy = (await h.get("/health")).status_code == 200
        r = await h.post("/v1/completions", json={"prompt": "the end", "max_tokens": 4})
        last_ok = r.status_code == 200
        await asyncio.sleep(5)
        # every request ended: none left in flight at the front door
        pending = await gauge(h, "vllm:num_requests_running")
    end = snapshot(serve)
    return {
        "elapsed_s": round(time.monotonic() - t0, 1),
        "interrupted": interrupted,
        "warmup_served": sum(warm.served.values()),
        "served": sum(tally.served.values()),
        "served_by_kind": dict(tally.served),
        "refused_as_expected": dict(tally.refused),
        "cancelled_by_client": dict(tally.cancelled),
        "failed": dict(tally.failed),
        "failed_near_kill": dict(tally.failed_near_kill),
        "first_failure_s": {k: round(v, 1) for k, v in tally.first.items()},
        "windows": tally.windows(),
        "latency_by_kind": tally.kinds(),
        "kills": tally.kills,
        "after": {"health_200": healthy, "completion_200": last_ok, "in_flight": pending},
        "resources": {"start": start, "end": end, "series": series},
    }


# -- the run -----------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    mem = Path("/proc/meminfo").read_text().split("\n", 1)[0].split()[1]
    return {
        "cores": os.cpu_count(),
        "load": [round(x, 2) for x in os.getloadavg()],
        "memory_gib": round(int(mem) / (1 << 20), 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def versions() -> dict[str, str]:
    out = {}
    for name in ("orchestr", "torch", "uvicorn", "starlette", "httpx2"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def start_server(
    procs: Processes, folder: Path, state: Path, logfile: Path, restarts: int
) -> tuple[Any, str]:
    """``orchestr serve`` on an embedded cluster of its own (``state`` is a fresh state
    directory), its output to ``logfile``; returns it and its URL once it serves."""
    env = {k: v for k, v in os.environ.items() if k not in ("ORCHESTR_ADDRESS", "ORCHESTR_API_KEY")}
    cmd = [sys.executable, "-m", "orchestr.cli", "serve", str(folder), "--generators",
           str(GENERATORS), "--torch-threads", "1", "--port", "0", "--served-model-name", "tiny",
           "--state-dir", str(state), "--restarts", str(restarts)]  # fmt: skip
    with open(logfile, "w") as out:  # the server's own copy stays open
        proc = procs.start(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = re.search(r"serving tiny on (http://127\.0\.0\.1:(\d+))/v1", logfile.read_text())
        if found:
            return proc, found[1]
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise RuntimeError(f"the server did not start:\n{logfile.read_text()[-3000:]}")


def stop_server(procs: Processes, proc: Any, logfile: Path) -> dict[str, Any]:
    """SIGINT (as Ctrl-C), up to 60 s to stop; then whatever is left of it is killed."""
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        code = None
    time.sleep(1)
    left = session_members(proc.pid)
    procs.stop(proc)
    lines = logfile.read_text(errors="replace").splitlines()

    def level(name: str) -> list[str]:
        pattern = re.compile(rf'\[{name}\s*\]|"level": ?"{name}"')
        return [x for x in lines if pattern.search(x)]

    errors = level("error") + level("critical")
    kinds = collections.Counter(error_kind(x) for x in errors)
    return {
        "exit_code": code,
        "stopped_line": "orchestr serve: stopped" in lines,
        "left_behind": left,
        "log_lines": len(lines),
        "log_warnings": len(level("warning")),
        "log_errors": len(errors),
        "log_tracebacks": sum("Traceback" in x for x in lines),
        "log_error_kinds": dict(kinds.most_common()),
        "log_error_examples": errors[:5],
    }


def error_kind(line: str) -> str:
    """An error line of the log as its event and the exception that ended its traceback."""
    event = re.sub(r"^\S+ \[\w+\s*\] ", "", line).split("  ")[0].strip()
    raised = re.findall(r"\\n([\w.]+(?:Error|Exception)\b[^\\']*)", line)
    raised = raised or re.findall(r"error='([\w.]+(?:Error|Exception)\b.*?)' \w+=", line)
    return f"{event}: {raised[-1][:160]}" if raised else event


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    r = result["load"]
    print(f"machine: {result['machine']}")
    print(f"versions: {result['versions']}")
    print(f"ran {r['elapsed_s']:.0f} s{' (interrupted)' if r['interrupted'] else ''} with "
          f"{args.clients} clients; served {r['served']}, bad bodies refused "
          f"{sum(r['refused_as_expected'].values())}, closed early by the client "
          f"{sum(r['cancelled_by_client'].values())}, failed {sum(r['failed'].values())} "
          f"(+{sum(r['failed_near_kill'].values())} within {args.kill_grace:.0f} s of a kill)")  # fmt: skip
    print(f"served by kind: {r['served_by_kind']}")
    for near, failed in (("", r["failed"]), ("near a kill: ", r["failed_near_kill"])):
        for cause, count in sorted(failed.items(), key=lambda kv: -kv[1]):
            first = r["first_failure_s"][near + cause]
            print(f"  failed {near}{count} x {cause} (first at {first} s)")
    for w in r["windows"]:
        print(f"  window {w['window']} (from {w['from_s']:.0f} s): {w['served']} served, "
              f"p50 {w.get('p50_ms')} ms, p99 {w.get('p99_ms')} ms")  # fmt: skip
    p50s = [w["p50_ms"] for w in r["windows"] if "p50_ms" in w]
    if p50s:
        print(f"  p50 over windows: median {statistics.median(p50s):.1f}, min {min(p50s)}, "
              f"max {max(p50s)} ms")  # fmt: skip
    print(f"latency by kind: {r['latency_by_kind']}")
    for k in r["kills"]:
        print(f"  kill at {k['t']:.0f} s of worker {k['pid']}: rotation dropped "
              f"{k['rotation_dropped']}, a new worker after {k['new_worker_after_s']} s, both "
              f"generators in rotation after {k['back_after_s']} s")  # fmt: skip
    print(f"after the soak: {r['after']}")
    res = r["resources"]
    for when in ("start", "end"):
        rows = ", ".join(f"{v['role']} {pid}: {v['rss_mib']} MiB, {v['fds']} fds, "
                         f"{v['threads']} threads" for pid, v in res[when].items())  # fmt: skip
        print(f"  {when}: {rows}")
    for flag in result["flags"] or ["nothing grew past the thresholds"]:
        print(f"  flag: {flag}")
    s = result["server"]
    print(f"server stop: exit {s['exit_code']}, said stopped {s['stopped_line']}, left behind "
          f"{s['left_behind']}; its log: {s['log_lines']} lines, {s['log_warnings']} warnings, "
          f"{s['log_errors']} errors, {s['log_tracebacks']} tracebacks")  # fmt: skip
    for kind, count in s["log_error_kinds"].items():
        print(f"    {count} x {kind}")


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--kill-every", type=float, default=5.0, metavar="MINUTES")
    parser.add_argument("--kill-grace", type=float, default=30.0, metavar="SECONDS",
                        help="failures this soon after a kill are counted apart")  # fmt: skip
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=float, default=20.0, metavar="SECONDS")
    parser.add_argument("--rss-growth-mib", type=float, default=64.0)
    parser.add_argument("--fd-growth", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "soak.json")
    add_record_flag(parser)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, exit_on_signal)
    procs = Processes()
    result: dict[str, Any] = {
        "machine": machine(),
        "versions": versions(),
        "args": dict(vars(args)),
    }
    result["args"]["out"] = str(args.out)
    log(f"machine {result['machine']}, versions {result['versions']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logfile = args.out.with_name(args.out.stem + "-server.log")
    with tempfile.TemporaryDirectory(prefix="orchestr-soak-") as tmp:
        folder = Path(tmp) / "tiny"
        subprocess.run(
            [sys.executable, "-m", "orchestr.cli", "model", "make-tiny", "--arch", "llama",
             str(folder)], check=True, capture_output=True, timeout=600,
        )  # fmt: skip
        try:
            kills = int(args.minutes // args.kill_every) + 1
            proc, url = start_server(procs, folder, Path(tmp) / "state", logfile, kills)
            port = int(url.rsplit(":", 1)[1])
            log(f"serving on {url}; workers {workers(proc.pid)}")
            if len(workers(proc.pid)) != GENERATORS:
                log(f"expected {GENERATORS} worker processes, found {workers(proc.pid)}")
            try:
                result["load"] = asyncio.run(load(args, proc.pid, url, port))
            finally:
                result["server"] = stop_server(procs, proc, logfile)
        finally:
            procs.stop_all()
    res = result["load"]["resources"]
    result["flags"] = growth(res["start"], res["end"], args.rss_growth_mib, args.fd_growth)
    result["machine"]["load_at_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.write_text(json.dumps(result, indent=1))
    report(result, args)
    print(f"wrote {args.out} (the server's log: {logfile})")
    if args.record:
        record("soak", figures(result), versions_seen=result["versions"])


SERVER_COUNTS = ("exit_code", "log_warnings", "log_errors", "log_tracebacks")


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """What the history keeps of a soak: counts summed over their causes, each window and
    kill, and each role's resources at the start and the end (processes by role, not pid)."""
    load = result["load"]
    counts = ("refused_as_expected", "cancelled_by_client", "failed", "failed_near_kill")
    resources = {
        when: {
            role: {
                key: [p[key] for p in load["resources"][when].values() if p["role"] == role]
                for key in ("rss_mib", "fds", "threads")
            }
            for role in sorted({p["role"] for p in load["resources"][when].values()})
        }
        for when in ("start", "end")
    }
    return {
        "load": {
            **{k: load[k] for k in ("elapsed_s", "served", "served_by_kind", "windows", "kills")},
            **{k: sum(load[k].values()) for k in counts},
            "after": load["after"],
        },
        "server": {k: result["server"][k] for k in SERVER_COUNTS},
        "resources": resources,
        "flags": len(result["flags"]),
    }


if __name__ == "__main__":
    main()
