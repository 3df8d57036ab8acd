"""``orchestr slurm``: an orchestr cluster inside a Slurm allocation, for one job.

``orchestr slurm submit [SBATCH OPTIONS] JOB [ARGS]`` writes a batch script and gives it to
``sbatch``. The script runs ``orchestr slurm run JOB [ARGS]`` on the allocation's first node,
which:

1. starts the head there (``orchestr start --head --block``), with a fresh cluster token and a
   private state directory under ``$TMPDIR``;
2. starts a node daemon on every node of the allocation in one step,
   ``srun --ntasks-per-node=1 orchestr start --block --address HEAD``, each bound to its host's
   address;
3. waits until every node has joined, then runs the job (``orchestr run --address HEAD``),
   whose output goes where Slurm puts the batch script's (``--output``);
4. stops everything when the job ends, and when Slurm signals the script (``scancel``, the
   time limit): the job, the node step (its daemons stop their workers), the head, and the
   state directory is removed. It exits with the job's exit code.

The daemons come up in the foreground of their Slurm steps, so Slurm's own process tracking
holds them too: what a teardown leaves, Slurm kills at the end of its ``KillWait``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any, NoReturn

from ._daemons import host_address

__all__ = ["add_parsers"]

#: Seconds the nodes have to join the head before the run fails.
JOIN_TIMEOUT_S = 120.0
#: Seconds each part has to stop after SIGTERM before it is killed.
STOP_GRACE_S = 10.0
ORCHESTR = [sys.executable, "-m", "orchestr.cli"]


class _Signalled(Exception):
    """Slurm (or a user) signalled the batch script: stop everything."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, frame: Any) -> NoReturn:
    raise _Signalled(signum)


def batch_script(args: argparse.Namespace) -> str:
    """The ``sbatch`` script for ``args`` (``slurm submit``'s)."""
    lines = ["#!/bin/bash", "#SBATCH --job-name=" + shlex.quote(args.job_name)]
    lines.append(f"#SBATCH --nodes={args.nodes}")
    lines.append("#SBATCH --ntasks-per-node=1")
    if args.time:
        lines.append("#SBATCH --time=" + shlex.quote(args.time))
    if args.partition:
        lines.append("#SBATCH --partition=" + shlex.quote(args.partition))
    if args.output:
        lines.append("#SBATCH --output=" + shlex.quote(args.output))
    lines += ["#SBATCH " + shlex.quote(extra) for extra in args.sbatch]
    lines += [
        "# orchestr slurm submit wrote this: the head on this, the allocation's first node, a",
        "# node daemon on every node, then the job; all stopped when it ends or on scancel.",
        shlex.join(
            ["exec", *ORCHESTR, "slurm", "run", "--host", args.host, args.job, *args.job_args]
        ),
        "",
    ]
    return "\n".join(lines)


def submit(args: argparse.Namespace) -> int:
    if args.nodes < 1:
        print(f"orchestr slurm submit: --nodes must be >= 1, got {args.nodes}", file=sys.stderr)
        return 2
    if not Path(args.job).is_file():
        print(f"orchestr slurm submit: no job file {args.job}", file=sys.stderr)
        return 2
    script = batch_script(args)
    if args.print:
        print(script, end="")
        return 0
    path = Path(args.script or f"orchestr-slurm-{time.strftime('%Y%m%d-%H%M%S')}.sbatch")
    path.write_text(script)
    if shutil.which("sbatch") is None:
        print(f"orchestr slurm submit: wrote {path}, but sbatch is not here", file=sys.stderr)
        return 1
    done = subprocess.run(["sbatch", str(path)], capture_output=True, text=True)
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        return done.returncode
    print(f"{done.stdout.strip()} ({path})")
    return 0


def _forward(stream: IO[str]) -> None:
    for line in stream:
        sys.stdout.write(line)
        sys.stdout.flush()


def _stop(proc: subprocess.Popen[Any] | None, what: str) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        print(f"orchestr slurm: {what} did not stop in {STOP_GRACE_S:.0f} s; killed", flush=True)
        proc.kill()
        proc.wait()


def _signal_steps(job_id: str) -> None:
    """SIGTERM to the tasks of this job's steps (the node daemons), not to srun: srun itself
    answers SIGTERM by killing the step."""
    listed = subprocess.run(
        ["squeue", "--steps", "--jobs", job_id, "--noheader", "--format=%i"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    steps = [s for s in listed.stdout.split() if s.split(".")[-1].isdigit()]
    if steps:
        subprocess.run(["scancel", "--signal=TERM", *steps], capture_output=True, timeout=30)


def _joined(address: str, env: dict[str, str]) -> int:
    import json

    out = subprocess.run(
        [*ORCHESTR, "status", "--json", "--address", address],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    if out.returncode != 0:
        return 0
    return sum(1 for n in json.loads(out.stdout)["nodes"] if n["alive"])


def run(args: argparse.Namespace) -> int:
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        print(
            "orchestr slurm run: not inside a Slurm allocation (no SLURM_JOB_ID); "
            "orchestr slurm submit makes one",
            file=sys.stderr,
        )
        return 2
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _raise)
    state = Path(tempfile.mkdtemp(prefix=f"orchestr-slurm-{job_id}-"))
    env = dict(os.environ, ORCHESTR_TOKEN=secrets.token_urlsafe(32))
    head = step = job = None
    try:
        command = [*ORCHESTR, "start", "--head", "--block", "--host", host_address(args.host)]
        command += ["--state-dir", str(state)]
        head = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
        assert head.stdout is not None
        line = head.stdout.readline().strip()
        if not line.startswith("head serving at "):
            print(f"orchestr slurm: the head did not start: {line!r}", file=sys.stderr)
            return 1
        threading.Thread(target=_forward, args=(head.stdout,), daemon=True).start()
        address = line.rsplit(" ", 1)[1]
        print(f"orchestr slurm: head at {address}; {nodes} node(s) joining", flush=True)
        command = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1"]
        command += ["--kill-on-bad-exit=1", *ORCHESTR, "start", "--block", "--address", address]
        step = subprocess.Popen([*command, "--host", "auto"], env=env)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while _joined(address, env) < nodes:
            if step.poll() is not None:
                print(f"orchestr slurm: the node step ended (code {step.returncode})")
                return 1
            if time.monotonic() > deadline:
                print(f"orchestr slurm: the nodes did not join in {JOIN_TIMEOUT_S:.0f} s")
                return 1
            time.sleep(0.5)
        print(f"orchestr slurm: {nodes} node(s) joined; running {args.job}", flush=True)
        job = subprocess.Popen(
            [*ORCHESTR, "run", "--address", address, args.job, *args.job_args], env=env
        )
        code = job.wait()
        print(f"orchestr slurm: the job ended with code {code}", flush=True)
        return code
    except _Signalled as why:
        print(f"orchestr slurm: {why}: stopping the job and the cluster", flush=True)
        return 128 + why.signum
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the teardown runs to its end
        _stop(job, "the job")
        if step is not None and step.poll() is None:
            _signal_steps(job_id)  # the daemons stop their workers, then srun ends
            with contextlib.suppress(subprocess.TimeoutExpired):
                step.wait(STOP_GRACE_S)
        _stop(step, "the node step")
        _stop(head, "the head")
        shutil.rmtree(state, ignore_errors=True)


def add_parsers(sub: Any) -> None:
    slurm = sub.add_parser("slurm", help="run a job on an orchestr cluster inside a Slurm job")
    verbs = slurm.add_subparsers(dest="slurm_command", required=True)
    p = verbs.add_parser("submit", help="write a batch script and sbatch it")
    p.add_argument("--nodes", type=int, default=1, help="nodes to allocate (default 1)")
    p.add_argument("--time", help="sbatch --time")
    p.add_argument("--partition", help="sbatch --partition")
    p.add_argument("--output", help="sbatch --output (default Slurm's: slurm-%%j.out)")
    p.add_argument("--job-name", default="orchestr", help="sbatch --job-name")
    p.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="OPTION",
        help="another sbatch option, as --sbatch=--gres=gpu:8 (repeatable)",
    )
    p.add_argument(
        "--host",
        default="auto",
        help="the address the head binds on the first node (default auto: its host name's)",
    )
    p.add_argument("--script", help="where to write the batch script (default: here, dated)")
    p.add_argument("--print", action="store_true", help="print the script; submit nothing")
    p.add_argument("job", help="the job file (run with orchestr run)")
    p.add_argument("job_args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments")
    p.set_defaults(func=submit)
    p = verbs.add_parser("run", help="inside an allocation: the cluster, the job, the teardown")
    p.add_argument("--host", default="auto", help="the head's bind address (default auto)")
    p.add_argument("job", help="the job file")
    p.add_argument("job_args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments")
    p.set_defaults(func=run)
