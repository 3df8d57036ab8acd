"""``oc.connect``: a job on a running cluster from an asyncio program of one's own (here a
plain script in a process of its own, the cluster an embedded one reached through its head's
address and token). Its meshes live while it is open and stop when it closes; the cluster
stays up."""

from __future__ import annotations

import asyncio
import os
import pathlib
import sys
import textwrap

import pytest

import orchestr as oc
from tests.runtime.actors import Counter

ROOT = pathlib.Path(__file__).resolve().parents[3]

PROGRAM = """
import asyncio
import orchestr as oc
from tests.runtime.actors import Counter

async def main():
    async with oc.connect() as job:  # $ORCHESTR_ADDRESS and $ORCHESTR_TOKEN
        counters = await job.spawn(Counter, n=2, name="theirs")
        print("added", await counters.add.call(2), flush=True)
        input()  # the test looks at the cluster meanwhile
    print("closed", flush=True)

asyncio.run(main())
"""


async def test_a_program_of_its_own_runs_a_job_on_the_cluster(
    ctx: oc.JobContext, tmp_path: pathlib.Path
) -> None:
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(PROGRAM))
    env = dict(
        os.environ,
        ORCHESTR_ADDRESS=ctx.head_address,
        ORCHESTR_TOKEN=ctx.token,
        PYTHONPATH=str(ROOT),
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        env=env,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        lines: list[
            bytes
        ] = []  # its own log lines come first (structlog prints to stdout by default)
        while not lines or not lines[-1].startswith(b"added"):
            lines.append(await asyncio.wait_for(proc.stdout.readline(), 60))
            assert lines[-1], b"".join(lines)
        assert lines[-1] == b"added [2, 2]\n"
        alive = [a.name for a in await ctx.actors() if a.state == "alive"]
        assert alive.count("theirs") == 2
        proc.stdin.write(b"\n")
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0 and out.endswith(b"closed\n"), err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert {a.state for a in await ctx.actors() if a.name == "theirs"} == {"stopped"}
    # the cluster still serves the job that owns it
    mine = await ctx.spawn(Counter)
    assert await mine.add.call_one(1) == 1


async def test_connect_needs_an_address_and_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCHESTR_ADDRESS", raising=False)
    monkeypatch.delenv("ORCHESTR_TOKEN", raising=False)
    with pytest.raises(oc.ConfigError, match="address"):
        async with oc.connect():
            pass
    with pytest.raises(oc.ConfigError, match="token"):
        async with oc.connect("127.0.0.1:1"):
            pass
