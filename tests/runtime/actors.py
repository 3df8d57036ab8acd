"""Actor classes the cluster tests spawn; workers import them by path."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import Any

import orchestr as oc


@oc.register
@dataclasses.dataclass
class Point:
    x: float
    y: float
    tag: str = ""


class Counter(oc.Actor):
    def __init__(self, start: int = 0) -> None:
        self.value = start
        self.seen: list[int] = []
        self.running = 0
        self.max_running = 0

    @oc.endpoint
    def add(self, n: int) -> int:
        self.value += n
        return self.value

    @oc.endpoint
    def get(self) -> int:
        return self.value

    @oc.endpoint
    def whoami(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "mesh": self.mesh_name,
            "pid": os.getpid(),
            "actor_id": self.actor_id,
        }

    @oc.endpoint
    async def record(self, i: int, delay: float) -> int:
        await asyncio.sleep(delay)
        self.seen.append(i)
        return i

    @oc.endpoint
    def seen_order(self) -> list[int]:
        return self.seen

    @oc.endpoint
    async def sleep(self, seconds: float) -> int:
        await asyncio.sleep(seconds)
        return self.rank

    @oc.endpoint(concurrent=True)
    async def overlap(self, seconds: float) -> int:
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        await asyncio.sleep(seconds)
        self.running -= 1
        return self.max_running

    @oc.endpoint(concurrent=True)
    def blocking(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    @oc.endpoint
    def fail(self, message: str) -> None:
        raise ValueError(message)

    @oc.endpoint
    def loop_kind(self) -> str:
        return type(asyncio.get_running_loop()).__module__

    @oc.endpoint
    def echo(self, value: Any) -> Any:
        return value

    @oc.endpoint
    def unsendable(self) -> Any:
        return {1, 2, 3}

    @oc.endpoint
    def tensor_sum(self, t: Any) -> float:
        return float(t.sum())

    @oc.endpoint
    def scale(self, t: Any, k: float) -> Any:
        return t * k


class Caller(oc.Actor):
    """Uses a mesh handle it received as an argument."""

    @oc.endpoint
    async def sum_of(self, mesh: oc.Mesh, n: int) -> int:
        return sum(await mesh.add.call(n))

    @oc.endpoint
    async def forward(self, mesh: oc.Mesh) -> oc.Mesh:
        return mesh


class BrokenInit(oc.Actor):
    def __init__(self) -> None:
        raise RuntimeError("cannot start: no config")


class ExitsAtOnce(oc.Actor):
    @oc.endpoint
    def die(self, code: int) -> None:
        os._exit(code)


class CancelsItself(oc.Actor):
    @oc.endpoint
    async def inner_cancel(self) -> None:
        task = asyncio.ensure_future(asyncio.sleep(10))
        task.cancel()
        await task  # raises CancelledError out of the endpoint

    @oc.endpoint
    async def ping(self) -> str:
        return "pong"


class Chatty(oc.Actor):
    """Writes lines of any length to its stdout."""

    @oc.endpoint
    def say(self, nbytes: int, lines: int = 1) -> int:
        for _ in range(lines):
            print("x" * nbytes, flush=True)
        return nbytes * lines


class HangsInInit(oc.Actor):
    def __init__(self) -> None:
        import time

        time.sleep(3600)


class Slow(oc.Actor):
    """Records what it ran, to tell calls that ran from calls dropped or cancelled."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    @oc.endpoint
    def mark(self, tag: str) -> None:
        self.ran.append(tag)

    @oc.endpoint
    def pid(self) -> int:
        return os.getpid()

    @oc.endpoint(cancel_safe=True)
    async def wait_then_mark(self, seconds: float, tag: str) -> None:
        await asyncio.sleep(seconds)
        self.ran.append(tag)

    @oc.endpoint
    async def wait_then_mark_to_the_end(self, seconds: float, tag: str) -> None:
        await asyncio.sleep(seconds)
        self.ran.append(tag)

    @oc.endpoint
    def seen(self) -> list[str]:
        return self.ran


class Environ(oc.Actor):
    @oc.endpoint
    def get(self, name: str) -> str | None:
        return os.environ.get(name)


class Metered(oc.Actor):
    """Records into orchestr.metrics: a counter and a histogram shared by every member (they
    sum over workers), and a gauge per member."""

    def __init__(self) -> None:
        from orchestr import metrics

        self.served = metrics.Counter("test_served", "Requests served.", ("route",))
        self.seconds = metrics.Histogram("test_seconds", "Time taken.", (0.1, 1.0), ("route",))
        self.depth = metrics.Gauge("test_depth", "A queue's depth.", ("member",))

    @oc.endpoint
    def serve(self, route: str, seconds: float, depth: float) -> None:
        self.served.inc(1, {"route": route})
        self.seconds.observe(seconds, {"route": route})
        self.depth.set(depth, {"member": str(self.rank)})
