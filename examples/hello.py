"""A first orchestr job: a mesh of counters, the five call modes, and a remote error.

Run it with ``orchestr run examples/hello.py`` (or ``make demo``).
"""

from __future__ import annotations

import asyncio

import orchestr as oc


class Counter(oc.Actor):
    def __init__(self, start: int = 0) -> None:
        self.value = start

    @oc.endpoint
    def add(self, n: int) -> int:
        self.value += n
        return self.value

    @oc.endpoint
    async def slow_get(self, delay: float) -> tuple[int, int]:
        await asyncio.sleep(delay)
        return self.rank, self.value

    @oc.endpoint
    def divide(self, by: int) -> float:
        return self.value / by


class Summer(oc.Actor):
    """Gets a handle to the counters as an argument and calls them itself."""

    @oc.endpoint
    async def total(self, counters: oc.Mesh) -> int:
        return sum(await counters.add.call(0))


async def main(ctx: oc.JobContext) -> dict[str, object]:
    counters = await ctx.spawn(Counter, 10, n=4, resources={"cpu": 0.25})
    print(f"spawned {counters}")

    everyone = await counters.add.call(1)  # every member, in rank order
    print(f"call       -> {everyone}")
    one = await counters[0].add.call_one(5)  # exactly one member
    print(f"call_one   -> {one}")
    chosen = await counters.add.choose(100)  # the least-loaded member
    print(f"choose     -> {chosen}")
    finished = [r async for r in counters.slow_get.stream(0.05)]  # as they finish
    print(f"stream     -> {sorted(finished)}")
    counters.add.broadcast(1)  # fire and forget
    summer = await ctx.spawn(Summer)
    total = await summer.total.call_one(counters)  # a handle passed to another actor
    print(f"broadcast  -> total seen by another actor: {total}")

    try:
        await counters[1].divide.call_one(0)
    except oc.ActorError as err:
        print(f"remote error -> {err.remote_type}: {err.remote_message}")
        remote_error = err.remote_type
    return {
        "call": everyone,
        "call_one": one,
        "choose": chosen,
        "total": total,
        "error": remote_error,
    }


if __name__ == "__main__":
    print(oc.run(main))
