"""Who waits on the head's actors: calls waiting for one actor's state to change (a lookup that
waits for an exit or a restart) and the watchers of every change (``WatchActors``). The head
service owns one and hands it to its mesh RPCs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from orchestr._control._convert import actor_to_pb
from orchestr.protos import orchestr_pb2 as pb

from ._records import ActorRecord

__all__ = ["ActorChanges"]


class ActorChanges:
    """The events that wake a wait on one actor, and the queues of the watchers of all."""

    def __init__(self) -> None:
        self._changed: dict[str, asyncio.Event] = {}
        #: Each watcher's queue of events; ``None`` in it ends the watch (it fell behind).
        self.watchers: set[asyncio.Queue[pb.ActorEvent | None]] = set()

    def notify(self, actor_id: str) -> None:
        """Wake whoever waits for a change of ``actor_id``'s state."""
        event = self._changed.pop(actor_id, None)
        if event is not None:
            event.set()

    async def wait_while(
        self, record: ActorRecord, still: Callable[[ActorRecord], bool], limit_s: float
    ) -> None:
        """Wait until ``still(record)`` is false after a change, or ``limit_s`` s passed
        (no error then). Cancel-safe."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit_s):
                while still(record):
                    await self._changed.setdefault(record.actor_id, asyncio.Event()).wait()

    def publish(self, kind: str, record: ActorRecord) -> None:
        """Give every watcher the event; one whose queue is full is cut off, not waited on."""
        event = pb.ActorEvent(kind=kind, actor=actor_to_pb(record))
        for queue in list(self.watchers):
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                self.watchers.discard(queue)
                queue.get_nowait()
                queue.put_nowait(None)
