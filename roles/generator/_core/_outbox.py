"""Streamed requests, sans-IO: what each reader of a generator's streams has not been told
yet (:class:`Outbox`).

A request submitted with ``stream=READER`` belongs to that reader: after every engine step
the generator calls :meth:`Outbox.collect`, which turns the tokens each streamed request got
since the reader's last :meth:`Outbox.take` into one :class:`~._types.TokenDelta` (merged
while nobody reads, so a slow reader costs at most the tokens of its own requests), and its
completion into the last one. The prefix cache's block events go to every reader known at
the time; a reader that lets more than :data:`MAX_EVENTS` pile up is given a snapshot
instead (``cleared``, then ``stored`` with every cached hash), so memory stays bounded and
the reader's view stays right.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ._blocks import AllBlocksCleared, BlockRemoved, BlockStored
from ._contract import Engine
from ._types import Completion, TokenDelta

__all__ = ["MAX_EVENTS", "Outbox"]

#: Block events a reader may leave unread before they are replaced by a snapshot.
MAX_EVENTS = 4096

Event = tuple[str, list[bytes]]


@dataclasses.dataclass
class _Reader:
    deltas: dict[str, TokenDelta] = dataclasses.field(default_factory=dict)
    events: list[Event] = dataclasses.field(default_factory=list)
    requests: set[str] = dataclasses.field(default_factory=set)


class Outbox:
    """The readers of streamed requests and what each is owed (module docstring)."""

    def __init__(self) -> None:
        self._readers: dict[str, _Reader] = {}
        self._owner: dict[str, str] = {}  # request id -> its reader
        self._sent: dict[str, int] = {}  # request id -> tokens put in deltas so far

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._owner

    @property
    def readers(self) -> list[str]:
        return list(self._readers)

    def add_reader(self, reader: str) -> None:
        """Know ``reader`` (idempotent): from now on it is told the block events."""
        if not isinstance(reader, str) or not reader:
            raise ValueError(f"a stream reader is named by a non-empty string, got {reader!r}")
        self._readers.setdefault(reader, _Reader())

    def add(self, reader: str, request_ids: Iterable[str]) -> None:
        """Stream ``request_ids`` (just submitted) to ``reader``."""
        self.add_reader(reader)
        for rid in request_ids:
            self._owner[rid] = reader
            self._sent[rid] = 0
            self._readers[reader].requests.add(rid)

    def collect(
        self, engine: Engine, finished: Sequence[Completion]
    ) -> tuple[list[Completion], set[str]]:
        """After a step: the new tokens of every streamed request still running, and the
        last delta of each one that ``finished``. Returns the completions that were not
        streamed (for the generator's other paths) and the readers that have news."""
        others: list[Completion] = []
        woken: set[str] = set()
        for c in finished:
            reader = self._owner.get(c.id)
            if reader is None:
                others.append(c)
                continue
            sent = self._forget(c.id)
            top = c.top_logprobs[sent:] if c.top_logprobs is not None else None
            self._merge(reader, c.id, c.tokens[sent:], c.logprobs[sent:], top)
            delta = self._readers[reader].deltas[c.id]
            delta.finish_reason, delta.text, delta.stop_reason = (
                c.finish_reason,
                c.text,
                c.stop_reason,
            )
            woken.add(reader)
        for rid, reader in self._owner.items():
            live = engine.live(rid)
            sent = self._sent[rid]
            if live is None or len(live.tokens) <= sent:
                continue
            top = live.top_logprobs[sent:] if live.request.top_logprobs else None
            self._merge(reader, rid, live.tokens[sent:], live.logprobs[sent:], top)
            self._sent[rid] = len(live.tokens)
            woken.add(reader)
        return others, woken

    def events(self, events: Iterable[Any], snapshot: Callable[[], list[bytes]]) -> set[str]:
        """Give every reader the block pool's ``events``; returns the readers told any."""
        plain = [_plain(e) for e in events]
        if not plain or not self._readers:
            return set()
        for reader in self._readers.values():
            reader.events.extend(plain)
            if len(reader.events) > MAX_EVENTS:
                reader.events = [("cleared", []), ("stored", snapshot())]
        return set(self._readers)

    def drop(self, request_id: str, reason: str | None = None) -> str | None:
        """Stop streaming ``request_id``; with ``reason``, its reader gets a last delta
        saying so (else what it was owed is dropped). Returns its reader, if it had one."""
        reader = self._owner.get(request_id)
        if reader is None:
            return None
        self._forget(request_id)
        deltas = self._readers[reader].deltas
        if reason is None:
            deltas.pop(request_id, None)
        else:
            self._merge(reader, request_id, [], [], None)
            deltas[request_id].finish_reason = reason
        return reader

    def take(self, reader: str) -> tuple[list[TokenDelta], list[Event]]:
        """What ``reader`` is owed, emptied."""
        r = self._readers.get(reader)
        if r is None:
            return [], []
        deltas, events = list(r.deltas.values()), r.events
        r.deltas, r.events = {}, []
        return deltas, events

    def has_news(self, reader: str) -> bool:
        r = self._readers.get(reader)
        return r is not None and bool(r.deltas or r.events)

    def remove_reader(self, reader: str) -> list[str]:
        """Forget ``reader``; returns the ids of its requests still running (to cancel)."""
        r = self._readers.pop(reader, None)
        if r is None:
            return []
        for rid in r.requests:
            self._owner.pop(rid, None)
            self._sent.pop(rid, None)
        return sorted(r.requests)

    def _forget(self, request_id: str) -> int:
        reader = self._owner.pop(request_id)
        self._readers[reader].requests.discard(request_id)
        return self._sent.pop(request_id)

    def _merge(
        self,
        reader: str,
        rid: str,
        tokens: list[int],
        logprobs: list[float],
        top: list[dict[int, float]] | None,
    ) -> None:
        deltas = self._readers[reader].deltas
        delta = deltas.get(rid)
        if delta is None:
            deltas[rid] = TokenDelta(
                rid, list(tokens), list(logprobs), None if top is None else list(top)
            )
            return
        delta.tokens += tokens
        delta.logprobs += logprobs
        if top is not None:
            delta.top_logprobs = (delta.top_logprobs or []) + list(top)


def _plain(event: Any) -> Event:
    if isinstance(event, BlockStored):
        return ("stored", list(event.block_hashes))
    if isinstance(event, BlockRemoved):
        return ("removed", list(event.block_hashes))
    if isinstance(event, AllBlocksCleared):
        return ("cleared", [])
    raise TypeError(f"not a block event: {event!r:.80}")
