"""The tables and the JSON content of ``bench/cluster.py``: medians with min and max, ratios.

:func:`report` takes the raw samples the orchestr job (``_cluster_job.py``), the Ray driver
(``peers/ray_cluster.py``) and the limits (``_limit_spawn.py``) returned, prints the tables and
returns ``{"orchestr": {...}, "ray": {...}, "limits": {...}, "ratios": {...}}`` (medians).
"""

from __future__ import annotations

import statistics
from typing import Any

Summary = dict[str, float]
Raw = dict[str, Any]

TARGET = 2.0
LABEL, CELL, RATIO = 58, 24, 13


def summarize(samples: list[float]) -> Summary | None:
    if not samples:
        return None
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def scaled(s: Summary | None, factor: float) -> Summary | None:
    return None if s is None else {k: v * factor for k, v in s.items()}


def med(s: Summary | None) -> float | None:
    return None if s is None else s["median"]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(s: Summary | None, digits: int = 1) -> str:
    if s is None:
        return "-"
    return f"{s['median']:,.{digits}f} [{s['min']:,.{digits}f}-{s['max']:,.{digits}f}]"


def starred(s: Summary | None) -> str:
    """An extrapolated figure, marked."""
    return "-" if s is None else f"{fmt(s)}*"


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def line(label: str, *cells: str) -> None:
    widths = [CELL, CELL, RATIO][: len(cells)]
    print(f"{label:{LABEL}s}" + "".join(f"{c:>{w}s}" for c, w in zip(cells, widths, strict=True)))


def runs(raw: Raw, n: int, per_process: int) -> list[dict[str, Any]]:
    """The many-actor runs of ``n`` actors, ``per_process`` to a process, that succeeded."""
    return [
        r
        for r in raw.get("actors", [])
        if r.get("n") == n and r.get("per_process", 1) == per_process and "seconds" in r
    ]


def field(rs: list[dict[str, Any]], key: str, scale: float = 1.0) -> Summary | None:
    return summarize([r[key] * scale for r in rs if r.get(key) is not None])


MIB = 1 / 2**20


def reservation_table(orch: Raw, ray: Raw, o: dict[str, Any], r: dict[str, Any]) -> None:
    batch = (orch.get("plan") or ray.get("plan") or {}).get("batch")
    print()
    line(
        "reservation of 2 (ray: placement group), STRICT_SPREAD, per s",
        "orchestr",
        "ray",
        "orchestr/ray",
    )
    for label, okey, rkey, name in (
        (
            f"{batch} at once (reservation_create_remove_per_s)",
            "reserve_batch_per_s",
            "pg_batch_per_s",
            "reservation_create_remove_per_s",
        ),
        (
            "one at a time",
            "reserve_sequential_per_s",
            "pg_sequential_per_s",
            "reservation_create_remove_sequential_per_s",
        ),
    ):
        os_, rs = summarize(orch.get(okey, [])), summarize(ray.get(rkey, []))
        o[name] = med(os_)
        line(label, fmt(os_), fmt(rs), fmt_ratio(ratio(med(os_), med(rs))))
    print("The same operation on both sides: resources held on both hosts at once, given back.")


def mesh_table(orch: Raw, ray: Raw, o: dict[str, Any], r: dict[str, Any]) -> None:
    batch = (orch.get("plan") or ray.get("plan") or {}).get("batch")
    print()
    line("mesh of 2, STRICT_SPREAD: created + removed per s", "orchestr", "ray", "orchestr/ray")
    # (label, orchestr's samples, Ray's samples, the JSON key, whose the key is)
    rows = [
        (
            f"{batch} at once (mesh_create_remove_per_s)",
            "mesh_batch_per_s",
            "pg_batch_per_s",
            "mesh_create_remove_per_s",
            "both",
        ),
        (
            "one at a time",
            "mesh_sequential_per_s",
            "pg_sequential_per_s",
            "mesh_create_remove_sequential_per_s",
            "both",
        ),
        (
            f"like for like: ray + an actor a bundle, {batch} at once",
            "mesh_batch_per_s",
            "pg_actors_batch_per_s",
            "pg_with_actors_per_s",
            "ray",
        ),
        (
            "like for like: ray + an actor a bundle, one at a time",
            "mesh_sequential_per_s",
            "pg_actors_sequential_per_s",
            "pg_with_actors_sequential_per_s",
            "ray",
        ),
    ]
    for label, okey, rkey, name, whose in rows:
        os_, rs = summarize(orch.get(okey, [])), summarize(ray.get(rkey, []))
        if whose == "both":
            o[name] = med(os_)
        r[name] = med(rs)
        shown = fmt(os_) if whose == "both" else "(as above)"
        line(label, shown, fmt(rs), fmt_ratio(ratio(med(os_), med(rs))))
    rs = summarize(ray.get("pg_wait_batch100_per_s", []))
    r["pg_microbenchmark_per_s"] = med(rs)
    line("ray's own microbenchmark: 100 at once, pg.wait", "-", fmt(rs))
    ps = summarize(orch.get("place_per_s", []))
    o["placement_only_per_s"] = med(ps)
    line("orchestr head placement alone (in process, no I/O)", fmt(ps, 0), "-")
    spawn = summarize([t * 1e3 for t in orch.get("mesh_spawn_s", [])])
    stop = summarize([t * 1e3 for t in orch.get("mesh_stop_s", [])])
    o["mesh_spawn_ms"], o["mesh_stop_ms"] = med(spawn), med(stop)
    line("orchestr, one at a time: spawn, ms", fmt(spawn, 0))
    line("orchestr, one at a time: stop, ms", fmt(stop, 0))
    rtt = summarize([t * 1e6 for t in orch.get("head_rtt_s", [])])
    o["head_rtt_us"] = med(rtt)
    line("orchestr control-plane round trip to the head, µs", fmt(rtt, 0))
    print("Not like for like: an orchestr mesh starts a worker process a member and creates the")
    print("actor in it; a placement group only reserves (see the reservation table).")
    print("The 'like for like' rows add an actor (a process, as on orchestr) to each bundle.")


def actors_table(
    orch: Raw, ray: Raw, ks: list[int], n_each: int, o: dict[str, Any], r: dict[str, Any]
) -> None:
    print()
    line("light actors: created and each called once, s", "orchestr", "ray", "ray/orchestr")
    ray_runs = [a for a in ray.get("actors", []) if "seconds" in a]
    ray_n = field(ray_runs, "seconds")
    each = runs(orch, n_each, 1)
    each_s = field(each, "seconds")
    ray_1000 = scaled(ray_n, 1000 / n_each)
    for i, k in enumerate(ks):
        rs = runs(orch, 1000, k)
        s = field(rs, "seconds")
        procs = rs[0]["processes"] if rs else -(-1000 // k)
        label = f"1,000, {k} a process ({procs} processes)"
        if i == 0:
            line(label, fmt(s, 2), starred(ray_1000), fmt_ratio(ratio(med(ray_1000), med(s))))
            o.update(
                actors_1000_create_s=med(s),
                actors_1000_per_process=k,
                actors_1000_processes=procs,
                actors_1000_spawn_s=med(field(rs, "spawn_seconds")),
                actors_1000_stop_s=med(field(rs, "stop_seconds")),
                actors_1000_memory_mib=med(field(rs, "memory_bytes", MIB)),
            )
        else:
            line(label, fmt(s, 2))
            o[f"actors_1000_per_process_{k}_create_s"] = med(s)
    line(
        f"{n_each}, a process each",
        fmt(each_s, 2),
        fmt(ray_n, 2),
        fmt_ratio(ratio(med(ray_n), med(each_s))),
    )
    line(
        f"  1,000 a process each, extrapolated from {n_each}",
        starred(scaled(each_s, 1000 / n_each)),
        starred(ray_1000),
    )
    line(
        f"  stop {n_each}, s (ray: ray.kill until gone)",
        fmt(field(each, "stop_seconds"), 2),
        fmt(field(ray_runs, "stop_seconds"), 2),
    )
    line(
        f"  memory of {n_each}, MiB (Pss summed)",
        fmt(field(each, "memory_bytes", MIB), 0),
        fmt(field(ray_runs, "memory_bytes", MIB), 0),
    )
    first = runs(orch, 1000, ks[0])
    line(f"  memory of 1,000 ({ks[0]} a process), MiB", fmt(field(first, "memory_bytes", MIB), 0))
    line(f"  1,000 ({ks[0]} a process): spawn returned, s", fmt(field(first, "spawn_seconds"), 2))
    line(f"  1,000 ({ks[0]} a process): stop, s", fmt(field(first, "stop_seconds"), 2))
    o.update(
        actors_process_each_n=n_each,
        actors_process_each_create_s=med(each_s),
        actors_process_each_memory_mib=med(field(each, "memory_bytes", MIB)),
        actors_1000_process_each_extrapolated_s=med(scaled(each_s, 1000 / n_each)),
    )
    r.update(
        actors_n=n_each if ray_runs else None,
        actors_n_create_s=med(ray_n),
        actors_per_s=ratio(n_each, med(ray_n)),
        actors_1000_create_s=med(ray_1000),
        actors_1000_extrapolated_from_n=n_each if ray_runs else None,
        actors_n_stop_s=med(field(ray_runs, "stop_seconds")),
        actors_n_memory_mib=med(field(ray_runs, "memory_bytes", MIB)),
    )
    asked = ray_runs[0].get("asked") if ray_runs else None
    if asked and asked != n_each:
        print(f"ray: {asked} actors asked for, {n_each} fit in the available memory")
    print(
        f"* extrapolated: {n_each} actors' time x {1000 / n_each:g}; 1,000 Ray worker processes"
        " do not fit in this machine's memory."
    )


def limits_table(limits: Raw, procs: int, lim: dict[str, Any]) -> None:
    n = limits.get("procs_n", 0)
    print()
    line(f"limits: processes started per s, {limits.get('concurrency')} at a time", "this machine")
    best = {}
    for key, text in (
        ("python_start", "python -c pass"),
        ("worker_dependencies_import", "... importing grpc, protobuf, structlog, msgpack, uvloop"),
        ("orchestr_worker_import", "... importing orchestr._cluster._worker"),
        ("ray_import", "... importing ray (Ray's venv)"),
    ):
        s = summarize([n / t for t in limits.get(key, [])])
        lim[f"{key}_per_s"] = med(s)
        best[key] = s["max"] if s else None
        line(f"  {text}", fmt(s))
    grtt = summarize([t * 1e6 for t in limits.get("grpc_rtt_s", [])])
    lim["grpc_rtt_us"] = med(grtt)
    line("  bare grpc.aio unary round trip H -> A, µs (each)", fmt(grtt, 0))
    rate = best["orchestr_worker_import"]
    if rate:
        lim["mesh_floor_per_s"] = rate / 2
        lim["actors_1000_floor_s"] = procs / rate
        print(
            f"floors, from the best rate of starting processes that import orchestr._cluster._worker: a "
            f"mesh of 2 {rate / 2:.1f}/s; {procs} worker processes {procs / rate:.2f} s"
        )


def report(orch: Raw, ray: Raw, limits: Raw, ks: list[int], n_each: int) -> dict[str, Any]:
    """Print the tables; return the JSON object's content."""
    o: dict[str, Any] = {}
    r: dict[str, Any] = {"cluster": "ray start: head in H (0 CPUs), a node in A and in B"}
    lim: dict[str, Any] = {}
    reservation_table(orch, ray, o, r)
    mesh_table(orch, ray, o, r)
    actors_table(orch, ray, ks, n_each, o, r)
    limits_table(limits, o.get("actors_1000_processes") or 1, lim)
    ratios = {
        "reservation_vs_placement_group": ratio(
            o["reservation_create_remove_per_s"], r["mesh_create_remove_per_s"]
        ),
        "mesh_create_remove": ratio(o["mesh_create_remove_per_s"], r["mesh_create_remove_per_s"]),
        "mesh_like_for_like": ratio(o["mesh_create_remove_per_s"], r["pg_with_actors_per_s"]),
        "actors_1000": ratio(r["actors_1000_create_s"], o["actors_1000_create_s"]),
        "actors_process_each": ratio(r["actors_n_create_s"], o["actors_process_each_create_s"]),
        "mesh_of_floor": ratio(o["mesh_create_remove_per_s"], lim.get("mesh_floor_per_s")),
        "actors_1000_of_floor": ratio(lim.get("actors_1000_floor_s"), o["actors_1000_create_s"]),
    }
    print()
    print(f"ratios (above 1: orchestr faster; target {TARGET:g}x Ray on the two required figures)")
    for key, value in ratios.items():
        verdict = ""
        if (
            key in ("reservation_vs_placement_group", "mesh_create_remove", "actors_1000")
            and value is not None
        ):
            verdict = "  target met" if value >= TARGET else "  target NOT met"
        print(f"  {key:28s}{fmt_ratio(value):>10s}{verdict}")
    print("of_floor: orchestr's figure against the floor of its worker starts (1: at the floor).")
    return {"orchestr": o, "ray": r, "limits": lim, "ratios": ratios}
