"""RL post-training throughput: the GRPO job in its three schedules, and its weight sync against
the data plane's limit and Ray's way of syncing weights.

    python bench/rl_throughput.py [--steps N] [--small] [--modes sync,stream,stream+skew]
                                  [--rounds R] [--peers ray|none]

**The job.** On one embedded cluster (``orchestr.run``) ``run_grpo(ctx, GRPOConfig(train=config,
mode=m))`` (:mod:`orchestr.roles.rl`: two generators, one trainer, one reward actor, each
reserving a quarter of a CPU and running torch on one thread) trains the digit-reversal policy
for each mode in ``--modes``, one after another on the same cores, each spawning and stopping
its roles, in ``--rounds`` rounds (default 3): sync, stream, stream+skew, then again, so a
drift of the machine's speed touches every mode alike. Each mode's figures are those of its run
of median throughput (the lower middle one for an even count); ``rounds`` beside them holds
every round's ``samples_per_s``, ``time_to_reward_0_8_s``, ``trainer_idle_frac`` and
``final_accuracy`` with their median, min and max (one run on this machine gave
stream+skew/sync 1.01x, the next 1.73x). ``config`` is ``DEMO_CONFIG`` (200 batches of 64 prompts x 8 samples, 16-digit
prompts); ``--small`` uses ``SMALL_CONFIG`` (100 of 32 x 8, up to 8 digits); ``--steps``
overrides the batch count. Per mode, from ``GRPOResult.summary()``:

- ``samples_per_s``: trained samples over the run's wall time (the initial weight sync and the
  spawn excluded, the evaluations included);
- ``time_to_reward_0_8_s``: seconds until the mean reward of the last 10 batches first reached
  0.8 (null if it never did);
- ``generator_idle_frac``: 1 - the generators' engine busy time over their count x wall time;
  ``trainer_idle_frac``: 1 - the trainer's ``train_step`` time over wall time;
- ``final_accuracy`` (greedy held-out exact match after the last batch), ``last50_reward``
  (mean batch reward of the last 50 batches), ``wall_s``, ``dropped_groups`` (stream modes:
  groups past the staleness bound);

plus ``mean_version_lag``, ``routed_long`` (stream+skew) and the ratios against sync:
``samples_per_s_vs_sync`` (mode / sync) and ``time_to_reward_vs_sync`` (sync time / mode time),
both > 1 when the mode is better.

**Weight sync.** ``weight_sync.seconds`` is the median of the per-generator
``Generator.sync_weights`` times of the sync-mode run (``GRPOResult.weight_sync``; the
first mode run when sync is not among ``--modes``), ``bytes`` what one sync moves. The
data plane's bandwidth is measured in the same run: an ``Owner`` actor registers a 64 MiB
float32 tensor in shared memory (``orchestr.fabric.empty``, where a publisher keeps its
buckets) as an ``orchestr.Buffer`` and a ``Reader`` actor in another worker process times
``Buffer.read_into`` of it into a preallocated, pre-faulted tensor (the call the weight loader
makes per bucket), 10 times after 2 warm-ups, the owner refreshing the tensor (``+= 1``) before
each read, untimed. ``limit_seconds`` = bytes / the median read's bandwidth: a sync that only
moved the bytes once. Then one ``Trainer`` and one ``Generator`` are spawned per model size
(the demo model and a TinyLM of about 100 MB of float32, ``LARGE_MODEL``) and, per iteration,
the trainer takes one small training step (untimed; the version must advance for a new publish)
and the controller times ``trainer.publish`` and ``generator.sync_weights`` (the generator's
reported ``seconds`` is the figure; median of 20 for the demo model, 5 for the large one, after
2 and 1 warm-ups); the trainer's and generator's weight digests must agree at the end. On
one host the sync borrows the publisher's buckets (``Buffer.borrow``: the model's tensors
become views of them, no copy), checksums each piece (XXH3) where it lies, and points the model
at them; across hosts it reads each bucket into the half of a double-buffered model not in use.
``of_limit`` = limit_seconds / seconds: 1 is moving the bytes once and nothing else, above 1
a sync that moved fewer (borrowed).
``weight_sync.standalone_seconds`` is the demo model's standalone figure, and ``transports``
what the job's reads used.

**Ray** (``--peers ray``, the default; ``bench/peers/ray_weightsync.py``, ``ray==2.60.0`` and
numpy in the venv ``bench/.venvs/ray-transfer``): Ray's way to sync weights, with numpy arrays
of the same names, dtypes and shapes as each model's state dict: a trainer actor calls
``ray.put`` on the state dict, a generator actor ``ray.get`` and copies it into its own arrays;
the generator's time for that (``seconds``), and the controller's for ``put`` + ``get`` + copy
(``round_trip_seconds``), medians over the same iteration counts. It runs after the orchestr
cluster has stopped. ``ray_weight_sync`` holds ``seconds``, ``large_seconds``, the round trips
and the ratios orchestr vs Ray, Ray's time / orchestr's standalone time (> 1 when orchestr is
faster): ``orchestr_speedup`` / ``orchestr_speedup_large`` on the generator's time and
``orchestr_speedup_round_trip`` / ``orchestr_speedup_large_round_trip`` on publish + sync as the
controller sees it. The round trip is the like-for-like figure: ``ray.put`` copies the state
into the object store on the trainer's side, after which the generator's ``get`` is zero-copy
and its time is one memcpy, while orchestr's publish copies into registered buckets and the
generator's sync reads them across processes, checksums and copies them. Null, with the reason in
``_meta.ray_skipped``, when the venv cannot be made or ``--peers none``.

Progress goes to stderr; tables and then, as the last line of stdout, one JSON object
``{"sync": {...}, "stream": {...}, "stream+skew": {...}, "weight_sync": {...},
"weight_sync_large": {...}, "ray_weight_sync": {...} | null, "_meta": {...}}`` (a mode not run
is null; a part that failed is ``{"error": reason}``). Floats carry 4 significant digits.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from _procs import session_members  # noqa: E402
from _venvs import RAY_TRANSFER_REQUIREMENTS, ensure_venv  # noqa: E402

import orchestr as oc  # noqa: E402
from orchestr import Buffer  # noqa: E402
from orchestr._log import configure_logging  # noqa: E402
from orchestr.roles import (  # noqa: E402
    DEMO_CONFIG,
    MODES,
    SMALL_CONFIG,
    Generator,
    GRPOConfig,
    GRPOResult,
    StepRecord,
    TinyLM,
    TinyLMConfig,
    TrainConfig,
    Trainer,
    reverse_task,
    run_grpo,
)

#: About 100 MB of float32 (101.0 MB, 30 tensors): where a sync is bound by bandwidth.
LARGE_MODEL: dict[str, Any] = {"d_model": 1024, "n_layers": 2, "d_ff": 4096, "n_heads": 8}
BANDWIDTH_BYTES = 64 << 20
BANDWIDTH_ITERS, BANDWIDTH_WARMUP = 10, 2
#: (timed iterations, warm-ups) of the standalone weight syncs, per model.
SYNC_ITERS = {"demo": (20, 2), "large": (5, 1)}
#: What each measurement actor reserves, as the job's roles do.
RESOURCES = {"cpu": 0.25}
PEER_TIMEOUT_S = 600.0

Result = dict[str, Any]


def log(message: str) -> None:
    print(f"[rl] {message}", file=sys.stderr, flush=True)


def error(exc: BaseException) -> Result:
    """The reason for a part that failed: its type and the first and last line of its text."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = " ... ".join(dict.fromkeys(lines[:1] + lines[-1:]))
    return {"error": f"{type(exc).__name__}: {text}"[:400]}


def median(values: list[float]) -> float:
    return float(statistics.median(values))


# -- the data plane's bandwidth ------------------------------------------------------------


class Owner(oc.Actor):
    """Registers one float32 tensor, in shared memory as a publisher's buckets are, as a
    Buffer; refreshes it on request."""

    def __init__(self, nbytes: int) -> None:
        self.data = oc.fabric.empty(nbytes // 4)
        self.data.fill_(1.0)
        self.buffer = Buffer(self.data)

    @oc.endpoint
    def handle(self) -> Buffer:
        return self.buffer

    @oc.endpoint
    def refresh(self) -> float:
        """Change every element in place (so each read moves new data); the new value."""
        self.data.add_(1.0)
        return float(self.data[0])


class Reader(oc.Actor):
    """Reads a Buffer into a preallocated, pre-faulted tensor, timing the read."""

    def __init__(self, nbytes: int) -> None:
        self.dst = torch.empty(nbytes // 4)
        self.dst.fill_(0.0)

    @oc.endpoint
    async def read(self, buffer: Buffer) -> dict[str, Any]:
        start = time.perf_counter()
        transport = await buffer.read_into(self.dst)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "transport": transport, "first": float(self.dst[0])}


async def measure_bandwidth(ctx: oc.JobContext) -> Result:
    """Median ``Buffer.read_into`` of a 64 MiB tensor between two worker processes."""
    owner = await ctx.spawn(Owner, nbytes=BANDWIDTH_BYTES, resources=RESOURCES)
    reader = await ctx.spawn(Reader, nbytes=BANDWIDTH_BYTES, resources=RESOURCES)
    try:
        buffer = await owner.handle.call_one()
        seconds, transports = [], set()
        for _ in range(BANDWIDTH_WARMUP + BANDWIDTH_ITERS):
            value = await owner.refresh.call_one()
            got = await reader.read.call_one(buffer)
            if got["first"] != value:
                raise RuntimeError(f"the reader saw {got['first']}, the owner holds {value}")
            seconds.append(got["seconds"])
            transports.add(got["transport"])
        timed = seconds[BANDWIDTH_WARMUP:]
        bandwidth = BANDWIDTH_BYTES / median(timed)
        return {
            "bytes": BANDWIDTH_BYTES,
            "iters": BANDWIDTH_ITERS,
            "seconds": median(timed),
            "min_seconds": min(timed),
            "max_seconds": max(timed),
            "bandwidth_bytes_per_s": bandwidth,
            "bandwidth_gbps": bandwidth / 1e9,
            "transports": sorted(transports),
        }
    finally:
        await ctx.stop(owner)
        await ctx.stop(reader)


# -- weight sync between a trainer and a generator -----------------------------------------


def _batch(version: int) -> list[dict[str, Any]]:
    """One group of two scored samples: enough for a training step that changes every weight
    the sync then moves."""
    prompt = reverse_task.encode_prompt((1, 2, 3))
    return [
        {
            "prompt": prompt,
            "tokens": tokens,
            "sample_logprobs": [-2.0] * len(tokens),
            "version": version,
            "reward": reward,
        }
        for tokens, reward in (([3, 2, 1], 1.0), ([1, 2, 3], 0.0))
    ]


async def measure_weight_sync(
    ctx: oc.JobContext, model: dict[str, Any], iters: int, warmup: int
) -> Result:
    """Per iteration: a training step (untimed), then ``trainer.publish`` and
    ``generator.sync_weights``, each timed by the controller; the generator reports its own."""
    trainer = await ctx.spawn(
        Trainer,
        model_kwargs=model,
        seed=0,
        update={"updates": 1},
        torch_threads=1,
        resources=RESOURCES,
    )
    generator = await ctx.spawn(
        Generator, model_kwargs=model, seed=0, max_batch=8, torch_threads=1, resources=RESOURCES
    )
    try:
        seconds, publish, round_trip = [], [], []
        transports: set[str] = set()
        nbytes = 0
        for i in range(warmup + iters):
            await trainer.train_step.call_one(_batch(i), 2)
            start = time.perf_counter()
            ref = await trainer.publish.call_one()
            published = time.perf_counter()
            report = await generator.sync_weights.call_one(ref)
            round_trip.append(time.perf_counter() - start)
            publish.append(published - start)
            if not report["loaded"]:
                raise RuntimeError(f"the generator did not load version {ref.version}")
            seconds.append(float(report["seconds"]))
            transports.update(report["transports"])
            nbytes = int(report["bytes"])
        t_digest = await trainer.digest.call_one()
        g_digest = await generator.digest.call_one()
        if t_digest["digest"] != g_digest["digest"]:
            raise RuntimeError(
                f"after the last sync the generator's weights (version {g_digest['version']}) "
                f"differ from the trainer's (version {t_digest['version']})"
            )
        return {
            "seconds": median(seconds[warmup:]),
            "min_seconds": min(seconds[warmup:]),
            "max_seconds": max(seconds[warmup:]),
            "publish_seconds": median(publish[warmup:]),
            "round_trip_seconds": median(round_trip[warmup:]),
            "bytes": nbytes,
            "transports": sorted(transports),
            "iters": iters,
            "digests_equal": True,
        }
    finally:
        await ctx.stop(trainer)
        await ctx.stop(generator)


# -- the job ---------------------------------------------------------------------------------


def progress(mode: str, steps: int) -> Callable[[StepRecord], None]:
    def on_step(r: StepRecord) -> None:
        if r.accuracy is None and r.step not in (0, steps - 1):
            return
        acc = "  -  " if r.accuracy is None else f"{r.accuracy:5.3f}"
        log(
            f"{mode}: step {r.step + 1:4d}/{steps} | reward {r.reward:5.3f} | held-out {acc} | "
            f"{r.samples_per_s:6.0f} samples/s | lag {r.version_lag:4.2f} | {r.wall_s:6.1f} s"
        )

    return on_step


async def measure_all(
    ctx: oc.JobContext,
    train: TrainConfig,
    modes: list[str],
    demo_model: dict[str, Any],
    rounds: int,
) -> dict[str, Any]:
    """Every mode once per round, the modes alternating within each round (so a drift of the
    machine's speed touches each mode alike); per mode the run of median throughput."""
    out: dict[str, Any] = {"modes": {}, "rounds": {m: [] for m in modes}}
    for round_ in range(1, rounds + 1):
        for mode in modes:
            log(
                f"{mode} (round {round_}/{rounds}): {train.steps} batches of "
                f"{train.prompts_per_step} x {train.group_size}"
            )
            try:
                config = GRPOConfig(train=train, mode=mode)  # type: ignore[arg-type]
                result = await run_grpo(ctx, config, progress(mode, train.steps))
            except Exception as exc:  # reported with its reason; the other runs still run
                out["rounds"][mode].append(error(exc))
                log(f"{mode} failed: {error(exc)['error']}")
                continue
            out["rounds"][mode].append(result)
            log(f"{mode}: done in {result.wall_s:.1f} s")
    for mode in modes:
        done = [r for r in out["rounds"][mode] if isinstance(r, GRPOResult)]
        done.sort(key=lambda r: r.summary()["samples_per_s"])
        out["modes"][mode] = done[(len(done) - 1) // 2] if done else out["rounds"][mode][-1]
    log("data plane: Buffer.read_into bandwidth between two worker processes")
    try:
        out["bandwidth"] = await measure_bandwidth(ctx)
        bw = out["bandwidth"]
        log(f"data plane: {bw['bandwidth_gbps']:.2f} GB/s over {'/'.join(bw['transports'])}")
    except Exception as exc:
        out["bandwidth"] = error(exc)
        log(f"bandwidth failed: {out['bandwidth']['error']}")
    for name, model in (("demo", demo_model), ("large", LARGE_MODEL)):
        iters, warmup = SYNC_ITERS[name]
        log(f"weight sync, {name} model: {iters} timed syncs after {warmup} warm-up")
        try:
            out[f"sync_{name}"] = r = await measure_weight_sync(ctx, model, iters, warmup)
            log(f"weight sync, {name}: {r['bytes'] / 1e6:.2f} MB in {r['seconds'] * 1e3:.2f} ms")
        except Exception as exc:
            out[f"sync_{name}"] = error(exc)
            log(f"weight sync, {name}, failed: {out[f'sync_{name}']['error']}")
    return out


# -- Ray, in its own venv and process session ------------------------------------------------


def model_tensors(model: dict[str, Any]) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of each tensor in the model's state dict."""
    state = TinyLM(TinyLMConfig(**model)).state_dict()
    return [(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in state.items()]


def run_peer(cmd: list[str], env: dict[str, str]) -> Any:
    """Run ``cmd`` in a session of its own; return the JSON object on the last line of its
    stdout. Whatever it leaves running in its session (Ray's daemons, if its shutdown failed)
    is killed afterwards."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=PEER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{Path(cmd[1]).name} ran past {PEER_TIMEOUT_S:.0f} s") from None
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in session_members(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    for line in err.splitlines():
        if line.startswith("ray: "):
            print(line, file=sys.stderr, flush=True)
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{Path(cmd[1]).name} exited {proc.returncode}:\n{err[-3000:]}")
    return json.loads(lines[-1])


def measure_ray(python: Path, models: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec = {
        name: {
            "tensors": model_tensors(model),
            "iters": SYNC_ITERS[name][0],
            "warmup": SYNC_ITERS[name][1],
        }
        for name, model in models.items()
    }
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token")
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # Ray 2.60 wants one; this run has its own
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="rl-models-") as f:
        json.dump({"models": spec}, f)
        f.flush()
        cmd = [str(python), str(HERE / "peers" / "ray_weightsync.py"), f.name]
        data: dict[str, Any] = run_peer(cmd, env)
    return data


# -- report ----------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def mode_entry(result: GRPOResult) -> Result:
    entry: Result = dict(result.summary())
    lags = [r.version_lag for r in result.steps]
    entry.update(
        steps=len(result.steps),
        mean_version_lag=sum(lags) / len(lags) if lags else None,
        routed_long=result.routed_long,
        trainer_digests_equal=result.trainer_digests_equal,
    )
    return entry


SPREAD = ("samples_per_s", "time_to_reward_0_8_s", "trainer_idle_frac", "final_accuracy")


def spread(runs: list[Any]) -> Result:
    """Per figure of ``SPREAD``: every round's value (a failed round's is null), and the
    median, min and max of those that ran."""
    out: Result = {"runs": len(runs), "failed": sum(not isinstance(r, GRPOResult) for r in runs)}
    for key in SPREAD:
        values = [r.summary()[key] if isinstance(r, GRPOResult) else None for r in runs]
        have = sorted(v for v in values if v is not None)
        out[key] = {
            "all": values,
            "median": statistics.median(have) if have else None,
            "min": have[0] if have else None,
            "max": have[-1] if have else None,
        }
    return out


def build_report(
    raw: dict[str, Any], ray: Result | None, ray_skipped: str | None, modes: list[str]
) -> dict[str, Any]:
    """The JSON object's content (unrounded)."""
    out: dict[str, Any] = {m: None for m in MODES}
    results: dict[str, GRPOResult] = {}
    for mode in modes:
        r = raw["modes"][mode]
        if isinstance(r, GRPOResult):
            results[mode] = r
            out[mode] = mode_entry(r)
            out[mode]["rounds"] = spread(raw["rounds"][mode])
        else:
            out[mode] = r
    base = out.get("sync") if "sync" in results else None
    for mode in results:
        row = out[mode]
        row["samples_per_s_vs_sync"] = (
            _ratio(row["samples_per_s"], base["samples_per_s"]) if base else None
        )
        row["time_to_reward_vs_sync"] = (
            _ratio(base["time_to_reward_0_8_s"], row["time_to_reward_0_8_s"]) if base else None
        )

    bw = raw.get("bandwidth") or {"error": "not measured"}
    rate = bw.get("bandwidth_bytes_per_s")

    def limits(entry: Result) -> Result:
        limit = entry["bytes"] / rate if rate else None
        entry["limit_seconds"] = limit
        entry["bandwidth_gbps"] = bw.get("bandwidth_gbps")
        entry["of_limit"] = _ratio(limit, entry["seconds"])
        return entry

    missing = {"error": "not measured"}
    demo, large = raw.get("sync_demo") or missing, raw.get("sync_large") or missing
    in_job = next((m for m in ("sync", *modes) if m in results), None)
    if in_job is None:
        out["weight_sync"] = {"error": "no mode ran to the end"}
    else:
        ws = results[in_job].weight_sync
        seconds = None if math.isnan(ws["seconds"]) else ws["seconds"]
        in_job_entry = limits({"seconds": seconds, "bytes": int(ws["bytes"]), "from_mode": in_job})
        in_job_entry.update(
            transports=ws.get("transports") or demo.get("transports"),
            standalone_seconds=demo.get("seconds"),
            standalone_publish_seconds=demo.get("publish_seconds"),
            standalone_round_trip_seconds=demo.get("round_trip_seconds"),
        )
        if "error" in demo:
            in_job_entry["standalone_error"] = demo["error"]
        out["weight_sync"] = in_job_entry
    if "error" in large:
        out["weight_sync_large"] = large
    else:
        out["weight_sync_large"] = limits({**large, "model": LARGE_MODEL})

    if ray is None:
        out["ray_weight_sync"] = None
    elif "error" in ray:
        out["ray_weight_sync"] = ray
    else:
        rm = ray["models"]
        r_demo, r_large = rm["demo"], rm["large"]
        ray_entry: Result = {
            "seconds": median(r_demo["seconds"]),
            "large_seconds": median(r_large["seconds"]),
            "round_trip_seconds": median(r_demo["round_trip_seconds"]),
            "large_round_trip_seconds": median(r_large["round_trip_seconds"]),
            "publish_seconds": median(r_demo["publish_seconds"]),
            "large_publish_seconds": median(r_large["publish_seconds"]),
            "bytes": r_demo["bytes"],
            "large_bytes": r_large["bytes"],
            "version": ray["_versions"]["ray"],
        }
        ray_entry["orchestr_speedup"] = _ratio(ray_entry["seconds"], demo.get("seconds"))
        ray_entry["orchestr_speedup_large"] = _ratio(
            ray_entry["large_seconds"], large.get("seconds")
        )
        ray_entry["orchestr_speedup_round_trip"] = _ratio(
            ray_entry["round_trip_seconds"], demo.get("round_trip_seconds")
        )
        ray_entry["orchestr_speedup_large_round_trip"] = _ratio(
            ray_entry["large_round_trip_seconds"], large.get("round_trip_seconds")
        )
        out["ray_weight_sync"] = ray_entry
    out["_meta"] = {"ray_skipped": ray_skipped, "data_plane": bw}
    return out


def _f(value: Any, spec: str, scale: float = 1.0) -> str:
    """``value * scale`` formatted by ``spec`` (``"10.2f"``); ``-`` in the same width for None."""
    if value is None:
        return format("-", f">{spec.partition('.')[0]}")
    return format(value * scale, spec)


def print_tables(report: dict[str, Any], modes: list[str]) -> None:
    print(
        f"{'mode':12s}{'samples/s':>10s}{'vs sync':>8s}{'t(R>=.8) s':>11s}{'vs sync':>8s}"
        f"{'gen idle':>9s}{'trn idle':>9s}{'acc':>7s}{'last50 R':>9s}{'lag':>6s}{'drop':>6s}"
        f"{'wall s':>8s}"
    )
    for mode in modes:
        e = report[mode]
        if e is None or "error" in e:
            print(f"{mode:12s}  failed: {(e or {}).get('error')}")
            continue
        print(
            f"{mode:12s}{_f(e['samples_per_s'], '10.0f')}{_f(e['samples_per_s_vs_sync'], '8.2f')}"
            f"{_f(e['time_to_reward_0_8_s'], '11.1f')}{_f(e['time_to_reward_vs_sync'], '8.2f')}"
            f"{_f(e['generator_idle_frac'], '9.2f')}{_f(e['trainer_idle_frac'], '9.2f')}"
            f"{_f(e['final_accuracy'], '7.3f')}{_f(e['last50_reward'], '9.3f')}"
            f"{_f(e['mean_version_lag'], '6.2f')}{e['dropped_groups']:6d}{e['wall_s']:8.1f}"
        )
    print("vs sync: samples/s over sync's; sync's time to reward 0.8 over the mode's (> 1 better).")
    for mode in modes:
        rounds = (report[mode] or {}).get("rounds")
        if rounds:
            sps = rounds["samples_per_s"]
            print(
                f"{mode:12s}samples/s over {rounds['runs']} round(s): median "
                f"{_f(sps['median'], '.0f')}, {_f(sps['min'], '.0f')}-{_f(sps['max'], '.0f')}"
                + (f", {rounds['failed']} failed" if rounds["failed"] else "")
            )
    print()
    ws, large, ray = report["weight_sync"], report["weight_sync_large"], report["ray_weight_sync"]
    ray = ray if ray and "error" not in ray else {}
    print(
        f"{'weight sync, ms':20s}{'MB':>8s}{'orchestr':>10s}{'limit':>8s}{'of limit':>10s}"
        f"{'ray':>8s}{'vs ray':>8s}{'| round trip: orchestr':>23s}{'ray':>8s}{'vs ray':>8s}"
    )
    rows: list[tuple[Any, ...]] = []  # label, bytes, s, limit, Ray's s, round trip, Ray's
    if "error" not in ws:
        rows.append(
            ("demo, in the job", ws["bytes"], ws["seconds"], ws["limit_seconds"], None, None, None)
        )
        if ws.get("standalone_seconds") is not None:
            rows.append(
                (
                    "demo, standalone",
                    ws["bytes"],
                    ws["standalone_seconds"],
                    ws["limit_seconds"],
                    ray.get("seconds"),
                    ws["standalone_round_trip_seconds"],
                    ray.get("round_trip_seconds"),
                )
            )
    if "error" not in large:
        rows.append(
            (
                "large, standalone",
                large["bytes"],
                large["seconds"],
                large["limit_seconds"],
                ray.get("large_seconds"),
                large["round_trip_seconds"],
                ray.get("large_round_trip_seconds"),
            )
        )
    for label, nbytes, seconds, limit, ray_s, trip, ray_trip in rows:
        print(
            f"{label:20s}{nbytes / 1e6:8.2f}{_f(seconds, '10.2f', 1e3)}{_f(limit, '8.2f', 1e3)}"
            f"{_f(_ratio(limit, seconds), '10.2f')}{_f(ray_s, '8.2f', 1e3)}"
            f"{_f(_ratio(ray_s, seconds), '8.2f')}{_f(trip, '23.2f', 1e3)}"
            f"{_f(ray_trip, '8.2f', 1e3)}{_f(_ratio(ray_trip, trip), '8.2f')}"
        )
    for name, entry in (("weight_sync", ws), ("weight_sync_large", large)):
        if "error" in entry:
            print(f"  {name} failed: {entry['error']}")
    if "standalone_error" in ws:
        print(f"  the demo model's standalone sync failed: {ws['standalone_error']}")
    bw = report["_meta"]["data_plane"]
    if "error" in bw:
        print(f"  data plane bandwidth failed: {bw['error']}")
    else:
        print(
            f"limit: bytes / {bw['bandwidth_gbps']:.2f} GB/s, the median Buffer.read_into of "
            f"{bw['bytes'] >> 20} MiB between two worker processes ({'/'.join(bw['transports'])})."
        )
    print("orchestr / ray: the generator's time to load a version (sync_weights; Ray: get + copy).")
    print(
        "of limit: limit / orchestr (1 = the sync moved the bytes once and did nothing else; "
        "above 1: it borrowed them, moving none)."
    )
    print("round trip: publish + sync_weights (Ray: put + get + copy), timed by the controller.")
    print("vs ray: Ray's time over orchestr's (> 1: orchestr is faster).")
    skipped = report["_meta"].get("ray_skipped")
    if skipped:
        print(f"ray: not run ({skipped})")
    elif report["ray_weight_sync"] and "error" in report["ray_weight_sync"]:
        print(f"ray: failed ({report['ray_weight_sync']['error']})")


def _round(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, int | str):
        return value
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_round(v) for v in value]
    return value


def machine() -> str:
    load = os.getloadavg()
    return (
        f"{platform.node()} | {os.cpu_count()} cores | load {load[0]:.2f} {load[1]:.2f} | "
        f"Python {platform.python_version()} | orchestr {oc.__version__} | "
        f"torch {torch.__version__}"
    )


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="batches per mode")
    parser.add_argument("--small", action="store_true", help="SMALL_CONFIG instead of the demo's")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of modes")
    parser.add_argument("--peers", default="ray", help="ray, or none to skip Ray")
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of every mode, alternating (default 3)"
    )
    add_record_flag(parser)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    modes = list(dict.fromkeys(m for m in args.modes.split(",") if m))
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes is a comma list of {', '.join(MODES)}")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.peers not in ("ray", "none"):
        parser.error("--peers is ray or none")
    base, config_name = (
        (SMALL_CONFIG, "SMALL_CONFIG") if args.small else (DEMO_CONFIG, "DEMO_CONFIG")
    )
    train = dataclasses.replace(base, steps=args.steps or base.steps)
    demo_model = dataclasses.asdict(train.model)

    configure_logging(json=False, level="WARNING")
    started = time.perf_counter()
    print(machine(), flush=True)
    python: Path | None = None
    ray_skipped: str | None = "--peers none" if args.peers == "none" else None
    if args.peers == "ray":
        try:
            python = ensure_venv("ray-transfer", RAY_TRANSFER_REQUIREMENTS)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            ray_skipped = f"the ray-transfer venv could not be made: {error(exc)['error']}"
            log(f"ray: skipped ({ray_skipped})")

    async def job(ctx: oc.JobContext) -> dict[str, Any]:
        return await measure_all(ctx, train, modes, demo_model, args.rounds)

    raw = oc.run(job)
    ray: Result | None = None
    if python is not None:
        log("ray: weight sync (bench/peers/ray_weightsync.py)")
        try:
            ray = measure_ray(python, {"demo": demo_model, "large": LARGE_MODEL})
        except (RuntimeError, OSError, ValueError, KeyError) as exc:
            ray = error(exc)
            log(f"ray failed: {ray['error']}")
    report = build_report(raw, ray, ray_skipped, modes)
    grpo = GRPOConfig(train=train)
    report["_meta"].update(
        cores=os.cpu_count(),
        torch=torch.__version__,
        orchestr=oc.__version__,
        python=platform.python_version(),
        config=config_name,
        steps=train.steps,
        prompts_per_step=train.prompts_per_step,
        group_size=train.group_size,
        modes=modes,
        rounds=args.rounds,
        generators=grpo.generators,
        trainers=grpo.trainers,
        rewards=grpo.rewards,
        eta=grpo.eta,
        lookahead=grpo.lookahead,
        demo_model=demo_model,
        large_model=LARGE_MODEL,
        sync_iters={k: v[0] for k, v in SYNC_ITERS.items()},
        ray=(report["ray_weight_sync"] or {}).get("version"),
        whole_run_s=time.perf_counter() - started,
    )
    print(machine(), flush=True)
    print_tables(report, modes)
    print(f"whole run: {time.perf_counter() - started:.0f} s")
    print(json.dumps(_round(report)))
    if args.record:
        record("rl_throughput", _round(report), peers=["ray"] if python is not None else [])


if __name__ == "__main__":
    main()
