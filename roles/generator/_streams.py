"""The generator actor's streamed requests: the :class:`~._core._outbox.Outbox` (sans-IO) and the
events its readers wait on (:class:`Streams`), so that the actor's endpoints stay thin."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from ._core._contract import Engine, PagedKV
from ._core._outbox import Outbox
from ._core._types import Completion, Updates

__all__ = ["Streams"]


class Streams:
    """What each reader of a generator's streams is owed, and when to wake it. Call
    :meth:`after_step` after every engine step (under the engine lock)."""

    def __init__(self) -> None:
        self.outbox = Outbox()
        self._news: dict[str, asyncio.Event] = {}  # reader -> set when it has news

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.outbox

    def reader(self, reader: str) -> None:
        """Know ``reader``; raises ``ValueError`` for a name that is not a non-empty string."""
        self.outbox.add_reader(reader)

    def add(self, reader: str, request_ids: Sequence[str]) -> None:
        self.outbox.add(reader, request_ids)

    async def wait(self, reader: str, timeout_s: float | None, check: Callable[[], None]) -> None:
        """Until ``reader`` has news, or ``timeout_s`` passes, or it is removed; ``check``
        (raising when the generator cannot go on) runs after every wake-up."""
        self.outbox.add_reader(reader)
        news = self._news.setdefault(reader, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not self.outbox.has_news(reader) and self._news.get(reader) is news:
                    news.clear()
                    await news.wait()
                    check()
        news.clear()

    def take(self, reader: str, engine: Engine) -> Updates:
        """What ``reader`` is owed, with ``engine``'s load and hashing keys now."""
        deltas, events = self.outbox.take(reader)
        stats = engine.stats()
        extra: list[Any] = []
        prefill, decode, block_size = stats.waiting, stats.running, 0
        if isinstance(engine, PagedKV):  # blocks queued, and how a router hashes prompts
            (prefill, decode), (block_size, extra) = engine.load(), engine.cache_keys()
        return Updates(
            deltas=deltas,
            events=events,
            waiting=stats.waiting,
            running=stats.running,
            prefill_blocks=prefill,
            decode_blocks=decode,
            block_size=block_size,
            extra_keys=extra,
            metrics={k: float(v) for k, v in engine.metrics().items()},
        )

    def remove(self, reader: str, engine: Engine) -> int:
        """Forget ``reader``, cancelling its requests on ``engine``; returns how many were."""
        cancelled = 0
        for rid in self.outbox.remove_reader(reader):
            with contextlib.suppress(KeyError):  # finished meanwhile
                engine.cancel(rid)
                cancelled += 1
        event = self._news.pop(reader, None)
        if event is not None:
            event.set()  # a reader waiting in wait() returns with nothing
        return cancelled

    def drop(self, request_id: str, reason: str | None = None) -> None:
        """Stop streaming ``request_id`` (with ``reason``, its reader is told so)."""
        reader = self.outbox.drop(request_id, reason)
        if reason is not None:
            self._tell(reader)

    def dropping(self, request_ids: Sequence[str]) -> None:
        """The engine drops ``request_ids`` (a reset): their readers are told
        ``"dropped"``."""
        for rid in request_ids:
            if rid in self.outbox:
                self.drop(rid, "dropped")

    def after_step(self, engine: Engine, finished: list[Completion]) -> list[Completion]:
        """Hand the step's tokens, completions and block events to their readers (the events
        are taken every step, so they never pile up in the engine); returns the completions
        that were not streamed."""
        others, readers = self.outbox.collect(engine, finished)
        if isinstance(engine, PagedKV):  # an engine with a prefix cache of its own
            readers |= self.outbox.events(engine.take_kv_events(), engine.cached_hashes)
        for reader in readers:
            self._tell(reader)
        return others

    def wake_all(self) -> None:
        """Wake every waiting reader (to see that the generator closed or failed)."""
        for event in self._news.values():
            event.set()

    def _tell(self, reader: str | None) -> None:
        event = self._news.get(reader) if reader is not None else None
        if event is not None:
            event.set()
