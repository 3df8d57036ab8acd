"""Rule: another user cannot disturb a process group. The ranks of a tensor-parallel generator
and the members of a data-parallel group talk over gloo, which has no authentication of its
own: its pairs meet through a store only the cluster's user can open (tested with the
generator's ranks), then listen on loopback. Here ``nobody`` connects to every port those
processes listen on and sends garbage; the group goes on computing what it computed."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import orchestr as oc
from orchestr.roles import Generator, models
from orchestr.roles.generator import Request

from .actors import Member
from .conftest import Attacker

PAYLOADS = [bytes(64).hex(), os.urandom(4096).hex(), (b"\xff" * 16).hex()]


def _descendants() -> set[int]:
    """Every process started under this one (its workers, and the ranks they started)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            children.setdefault(int(stat[1]), []).append(int(entry))
    mine, todo = set(), [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            mine.add(child)
            todo.append(child)
    return mine


async def _ports_of_descendants() -> dict[int, int]:
    """Every TCP port a process started under this one listens on, with its pid."""
    mine = _descendants()
    proc = await asyncio.create_subprocess_exec("ss", "-ltnpH", stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    ports = {}
    for line in out.decode().splitlines():
        for pid in map(int, re.findall(r"pid=(\d+),", line)):
            if pid in mine:
                ports[int(line.split()[3].rpartition(":")[2])] = pid
    return ports


async def test_garbage_on_a_rank_groups_ports_changes_nothing(
    ctx: oc.JobContext, attacker: Attacker, tmp_path: Path
) -> None:
    folder = models.make_tiny("llama", tmp_path / "m", vocab=301, heads=4, kv_heads=2)
    generator = await ctx.spawn(
        Generator, checkpoint=folder, tp=2, torch_threads=1, resources={"cpu": 0.5}
    )
    group = await ctx.spawn(Member, n=2, resources={"cpu": 0.5})
    await ctx.init_distributed(group)
    prompt = list(range(5, 30))
    (before,) = await generator.generate.call_one([Request("a", prompt, 8, temperature=0.0)])
    ports = await _ports_of_descendants()
    # three workers' call servers, gRPC services and gloo pairs, and the generator's rank's
    assert len(set(ports.values())) == 4 and len(ports) >= 10, ports
    answers = await attacker.run("spray", ports=sorted(ports), payloads=PAYLOADS, wait=1.0)
    assert len(answers) == len(ports)
    (after,) = await generator.generate.call_one([Request("b", prompt, 8, temperature=0.0)])
    assert after.tokens == before.tokens
    assert await group.all_reduce.call(1.5) == [3.0, 3.0]
    await ctx.stop(generator)
    await ctx.stop(group)
