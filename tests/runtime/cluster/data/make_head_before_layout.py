"""Writes head-before-layout.sqlite: the head's store of a daemon cluster running a Reward and
a Generator with restart policies (the Generator given a BackendSpec), as it stood before the
layout moved any module. Kept to show how the file was made; rerunning it now would write
today's names.

    orchestr start --head --state-dir st && orchestr start --address ADDR --state-dir st
    orchestr run --address ADDR --state-dir st tests/runtime/cluster/data/make_head_before_layout.py &
    # once it prints "spawned": copy st/head.sqlite with sqlite3's backup API
"""

import asyncio

import orchestr as oc
from orchestr.roles import BackendSpec, Generator, Reward


async def main(ctx: oc.JobContext) -> None:
    policy = oc.RestartPolicy(max_restarts=2)
    await ctx.spawn(Reward, "orchestr.roles._task:reward", restart=policy)
    await ctx.spawn(
        Generator,
        seed=3,
        max_batch=8,
        model_kwargs={"d_model": 32},
        backend=BackendSpec(name="cpu"),
        restart=policy,
    )
    print("spawned", flush=True)
    await asyncio.sleep(60)
