"""The job the Slurm tests submit (``orchestr slurm submit ... slurm_job.py [--hang]``): a mesh of
two on the cluster Slurm's allocation runs, a call to each, ``RESULT ...`` on stdout; with
``--hang`` it says ``HANGING`` and then waits for a call that never ends (until scancel)."""

from __future__ import annotations

import asyncio
import sys

import orchestr as oc


class Echo(oc.Actor):
    @oc.endpoint
    def where(self) -> str:
        import socket

        return f"{self.rank}@{socket.gethostname()}"

    @oc.endpoint
    async def hang(self) -> None:
        await asyncio.sleep(3600)


async def main(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Echo, n=2)
    print("RESULT", sorted(await mesh.where.call()), flush=True)
    if "--hang" in sys.argv:
        print("HANGING", flush=True)
        await mesh.hang.options(timeout=7200).call()
