"""``orchestr run`` end to end, in a subprocess, with leak checks."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import uuid

ROOT = pathlib.Path(__file__).resolve().parents[2]
ORCHESTR = [sys.executable, "-m", "orchestr.cli"]


def _listening_ports(marker: str) -> set[int]:
    """Listening TCP ports held by a process whose environment carries ``marker`` (other work
    on the machine may open listeners meanwhile)."""
    ports: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):  # no IPv6 on this host
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    ports[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    held = set()
    for pid in _processes_with(marker):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                inode = target[len("socket:[") : -1] if target.startswith("socket:[") else ""
                if inode in ports:
                    held.add(ports[inode])
        except OSError:
            continue
    return held


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _run(
    args: list[str], cwd: pathlib.Path = ROOT, **env: str
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run the CLI with a marker in its environment, which its workers inherit."""
    marker = uuid.uuid4().hex
    full_env = dict(os.environ, ORCHESTR_TEST_MARKER=marker, **env)
    proc = subprocess.run(
        ORCHESTR + args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=120
    )
    return proc, marker


def _assert_nothing_left(marker: str, shm_before: set[str]) -> None:
    assert _listening_ports(marker) == set(), "a listening socket outlived the job"
    assert _processes_with(marker) == [], "worker processes outlived the job"
    assert set(os.listdir("/dev/shm")) - shm_before == set(), "a shared-memory segment leaked"


def test_hello_example_runs_and_leaves_nothing_behind() -> None:
    shm = set(os.listdir("/dev/shm"))
    proc, marker = _run(["run", "examples/hello.py"])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "call       -> [11, 11, 11, 11]" in out
    assert "call_one   -> 16" in out
    assert "remote error -> ZeroDivisionError: division by zero" in out
    _assert_nothing_left(marker, shm)


def test_a_failing_job_reports_and_cleans_up(tmp_path: pathlib.Path) -> None:
    job = tmp_path / "failing_job.py"
    job.write_text(
        textwrap.dedent(
            """
            import orchestr as oc

            class Boom(oc.Actor):
                @oc.endpoint
                def go(self) -> None:
                    raise KeyError("missing-key")

            async def main(ctx):
                mesh = await ctx.spawn(Boom, n=2)
                await mesh.go.call()
            """
        )
    )
    shm = set(os.listdir("/dev/shm"))
    proc, marker = _run(["run", str(job)])
    assert proc.returncode == 1
    assert re.search(
        r"the job failed: ActorError: Boom\[[01]\]\.go raised KeyError: 'missing-key'", proc.stderr
    )
    _assert_nothing_left(marker, shm)


def test_a_crashing_actor_fails_the_job_loudly_and_cleans_up(tmp_path: pathlib.Path) -> None:
    job = tmp_path / "crashing_job.py"
    job.write_text(
        textwrap.dedent(
            """
            import asyncio, ctypes
            import orchestr as oc

            class Native(oc.Actor):
                @oc.endpoint
                def touch_null(self) -> None:
                    ctypes.string_at(0)

            async def main(ctx):
                mesh = await ctx.spawn(Native, n=2)
                mesh[1].touch_null.broadcast()
                await asyncio.sleep(60)
                print("still running")
            """
        )
    )
    shm = set(os.listdir("/dev/shm"))
    proc, marker = _run(["run", str(job)])
    assert proc.returncode == 1
    assert "still running" not in proc.stdout
    err = proc.stderr
    assert "the job failed: SupervisionError: actor Native[1] died" in err
    assert "killed by SIGSEGV" in err and "in touch_null" in err  # the worker's stack dump
    _assert_nothing_left(marker, shm)


def test_a_job_raising_a_plain_exception_cleans_up(tmp_path: pathlib.Path) -> None:
    job = tmp_path / "plain_error.py"
    job.write_text(
        "import orchestr as oc\n"
        "from hello import Counter\n"
        "async def main(ctx):\n"
        "    await ctx.spawn(Counter, n=2)\n"
        "    raise RuntimeError('driver bug')\n"
    )
    shm = set(os.listdir("/dev/shm"))
    proc, marker = _run(["run", str(job)], PYTHONPATH=str(ROOT / "examples"))
    assert proc.returncode == 1
    assert "RuntimeError: driver bug" in proc.stderr
    _assert_nothing_left(marker, shm)


def test_bad_job_files_get_clear_errors(tmp_path: pathlib.Path) -> None:
    proc, _ = _run(["run", str(tmp_path / "missing.py")])
    assert proc.returncode == 2 and "no job file" in proc.stderr
    no_main = tmp_path / "no_main.py"
    no_main.write_text("x = 1\n")
    proc, _ = _run(["run", str(no_main)])
    assert proc.returncode == 2 and "must define `async def main(ctx)`" in proc.stderr
    not_py = tmp_path / "job.txt"
    not_py.write_text("")
    proc, _ = _run(["run", str(not_py)])
    assert proc.returncode == 2 and "ending in .py" in proc.stderr


def test_script_mode_with_orchestr_run_function(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "script_job.py"
    script.write_text(
        textwrap.dedent(
            """
            import orchestr as oc

            class Doubler(oc.Actor):
                @oc.endpoint
                async def double(self, x: int) -> int:
                    return 2 * x

            async def main(ctx):
                mesh = await ctx.spawn(Doubler, n=2)
                return await mesh.double.call(21)

            if __name__ == "__main__":
                print("result", oc.run(main))
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "result [42, 42]" in proc.stdout


def test_transports_reports_what_works_here_and_why_not() -> None:
    import json

    proc, _ = _run(["transports", "--json"])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    rows = {(r["kind"], r["scheme"]): r for r in report["transports"]}
    assert rows[("buffer", "shm")]["available"] and rows[("stream", "tcp")]["available"]
    rdma = rows[("buffer", "rdma")]
    if not rdma["available"]:
        assert "pyverbs" in rdma["reason"] or "RDMA device" in rdma["reason"]
    text, _ = _run(["transports"])
    assert text.returncode == 0 and f"host {report['host']}" in text.stdout
    assert re.search(r"buffer rdma +(available|unavailable: .+)", text.stdout)


def test_the_rl_example_takes_flags_and_writes_its_run(tmp_path: pathlib.Path) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    proc, marker = _run(
        [
            "run",
            "examples/grpo_reverse.py",
            "--small",
            "--steps",
            "3",
            "--mode",
            "stream",
            "--runs",
            str(tmp_path),
            "--quiet",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    names = {p.name for p in run.iterdir()}
    assert f"wrote {run}/ ({', '.join(sorted(names))})" in proc.stdout  # what is there
    _assert_nothing_left(marker, shm_before)
    assert {"metrics.jsonl", "summary.json", "reward.png", "trace.json", "events.jsonl"} <= names
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "step"] == [0, 1, 2]
    assert [r["version"] for r in rows if r["kind"] == "eval"] == [0, 3]
    assert (run / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the trained policy as a Hugging Face folder (its weights: tests/roles/rl)
    from orchestr.roles import models

    assert models.load_model(run / "model").config.model_type == "llama"
    events = (run / "events.jsonl").read_text().splitlines()
    phases = {json.loads(line).get("name") for line in events}
    assert {"training", "weight_sync"} <= phases
    bad, _ = _run(["run", "examples/grpo_reverse.py", "--mode", "async"])
    assert bad.returncode == 2 and "invalid choice: 'async'" in bad.stderr
    bad, _ = _run(["run", "examples/grpo_reverse.py", "--model", "tinylm", "--engine", "vllm"])
    assert bad.returncode != 0 and "--engine applies to --model llama" in bad.stderr
    bad, _ = _run(["run", "examples/grpo_reverse.py", "--entropy-coef", "-0.1"])
    assert bad.returncode != 0 and "entropy_coef must be >= 0, got -0.1" in bad.stderr
    bad, _ = _run(["run", "examples/grpo_reverse.py", "--lr-schedule", "linear"])
    assert bad.returncode == 2 and "invalid choice: 'linear'" in bad.stderr
