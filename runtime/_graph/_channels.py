"""The channels of a running graph: one bounded :class:`Edge` per (producer, consumer) pair,
numbered by a :class:`~._channelstate.Sender` whose window is the producer's capacity.

An item holds its window slot until the consumer commits it (its stage call finished and
the result went on, or it was dropped or sent back as stale), so a window bounds what waits,
what is in flight and what a stage holds for ordering. A producer with several consumers
(a tee) puts every item on each edge and waits for room on all of them.

Waiting is by one :class:`asyncio.Event` per node, shared by whoever waits in that node;
every waiter re-checks its own condition after a wake-up (:func:`nap`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from typing import Any

from ._channelstate import Item, Sender

__all__ = ["Edge", "EdgeStats", "NodeOut", "Token", "Work", "first_error", "nap"]


@dataclasses.dataclass(eq=False)
class Work:
    """One unit of a stage's work: one item, or a batch (``value`` is then a list)."""

    value: Any
    version: int | None
    #: The input edge's items it commits when its result has gone on.
    seqs: list[int]
    #: How often it was sent back as stale already.
    requeues: int = 0
    #: For work sent back by one consumer: its result goes on that consumer's edge only.
    target: Edge | None = None
    #: A function policy's member for it (set when dispatched).
    preferred: int | None = None
    #: Its place in the stage's output order (set when dispatched).
    t: int = -1


@dataclasses.dataclass(eq=False, slots=True)
class Token:
    """What an edge carries: the value and the work that made it (a stage's output), so
    that a stale output can be made again."""

    value: Any
    origin: Work | None = None


@dataclasses.dataclass
class EdgeStats:
    """Counts for one edge: ``sent`` = ``delivered`` + ``dropped_stale`` + ``requeued`` +
    what is still in the window; ``redelivered`` counts items sent again after a member
    died, ``duplicates`` items or results seen twice."""

    sent: int = 0
    delivered: int = 0
    duplicates: int = 0
    dropped_stale: int = 0
    requeued: int = 0
    redelivered: int = 0


def first_error(exc: BaseException) -> BaseException:
    """The first error inside (nested) exception groups from task groups, else ``exc``."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


async def nap(event: asyncio.Event, deadline: float | None = None) -> None:
    """Wait for ``event`` (cleared first) or until loop time ``deadline``. Call it right
    after checking, with no await in between, that there is nothing to do."""
    event.clear()
    if deadline is None:
        await event.wait()
        return
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining <= 0:
        return
    try:
        async with asyncio.timeout(remaining):
            await event.wait()
    except TimeoutError:
        pass


class Edge:
    """A bounded channel from ``producer`` to ``consumer``."""

    def __init__(
        self,
        producer: str,
        consumer: str,
        window: int,
        producer_wake: asyncio.Event,
        consumer_wake: asyncio.Event,
    ) -> None:
        self.name = f"{producer}->{consumer}"
        self.sender = Sender(window)
        self.queue: deque[Item] = deque()
        self.closed = False
        self.stats = EdgeStats()
        self.producer_wake = producer_wake
        self.consumer_wake = consumer_wake

    @property
    def room(self) -> bool:
        return self.sender.free > 0

    def put_nowait(self, token: Token, version: int | None) -> None:
        item = self.sender.offer(token, version)
        if item is None:
            raise RuntimeError(f"edge {self.name} is full; wait for room first")
        self.queue.append(item)
        self.stats.sent += 1
        self.consumer_wake.set()

    def take_nowait(self) -> Item | None:
        return self.queue.popleft() if self.queue else None

    async def take(self) -> Item | None:
        """The next item, or ``None`` once the edge is closed and empty."""
        while not self.queue and not self.closed:
            await nap(self.consumer_wake)
        return self.take_nowait()

    def ack(self, seq: int, *, delivered: bool = True) -> None:
        """The consumer is done with item ``seq``: its slot frees. ``delivered`` when it took
        effect (not dropped or sent back as stale)."""
        if self.sender.ack_one(seq) and delivered:
            self.stats.delivered += 1
        self.producer_wake.set()

    def close(self) -> None:
        """The producer is done; the consumer drains what is queued."""
        self.closed = True
        self.consumer_wake.set()

    def snapshot(self) -> dict[str, int]:
        counts = dataclasses.asdict(self.stats)
        counts["queue_depth"] = len(self.queue)
        counts["in_window"] = len(self.sender.unacked)
        return counts


class NodeOut:
    """A node's output: its edges (one per consumer, none for a drained end)."""

    def __init__(self, edges: list[Edge], wake: asyncio.Event) -> None:
        self.edges = edges
        self.wake = wake
        self._lock = asyncio.Lock()

    def room(self, only: Edge | None = None) -> bool:
        return only.room if only is not None else all(e.room for e in self.edges)

    async def wait_room(self, only: Edge | None = None) -> None:
        """Block until every edge (or ``only``) has room: the backpressure point."""
        while not self.room(only):
            await nap(self.wake)

    def put_nowait(self, token: Token, version: int | None, only: Edge | None = None) -> None:
        for edge in [only] if only is not None else self.edges:
            edge.put_nowait(token, version)

    async def emit(self, token: Token, version: int | None, only: Edge | None = None) -> None:
        """Put ``token`` on every edge (or ``only``) once all have room."""
        async with self._lock:
            await self.wait_room(only)
            self.put_nowait(token, version, only)

    def close(self) -> None:
        for edge in self.edges:
            edge.close()
