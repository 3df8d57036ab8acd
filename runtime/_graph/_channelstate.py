"""The sans-IO core of a dataflow channel: sequence numbers, a bounded window, redelivery,
de-duplication and staleness.

Delivery is at least once; the consumer's effect happens once. The producer numbers items and
keeps each one until the consumer acknowledges it; after a consumer restart it sends every
unacknowledged item again. The consumer remembers what it has committed (for an ordered edge a
single high-water mark, which is what it saves with its effect), drops duplicates, and on an
ordered edge hands items on in sequence order only. Items can carry a version; a staleness bound
``eta`` drops or requeues an item older than the consumer's version minus ``eta``, and counts it.

No I/O here: the async channel shell feeds these classes events and acts on what they return.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Literal

from orchestr.errors import ConfigError

__all__ = ["Item", "Receiver", "Sender", "Staleness"]


@dataclasses.dataclass(frozen=True, slots=True)
class Item:
    seq: int
    value: Any
    version: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Staleness:
    """Items older than the consumer's version minus ``eta`` are dropped or requeued."""

    eta: int
    policy: Literal["drop", "requeue"] = "drop"

    def __post_init__(self) -> None:
        if isinstance(self.eta, bool) or not isinstance(self.eta, int) or self.eta < 0:
            raise ConfigError(f"staleness eta must be a non-negative integer, got {self.eta!r}")
        if self.policy not in ("drop", "requeue"):
            raise ConfigError(f"staleness policy must be 'drop' or 'requeue', got {self.policy!r}")


class Sender:
    """The producer end: numbers items, bounds what is in flight, resends what is unacked."""

    def __init__(self, window: int) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"a channel window must be a positive integer, got {window!r}")
        self.window = window
        self.next_seq = 0
        self.unacked: OrderedDict[int, Item] = OrderedDict()

    @property
    def free(self) -> int:
        """How many more items may be offered before the window is full (backpressure)."""
        return self.window - len(self.unacked)

    def offer(self, value: Any, version: int | None = None) -> Item | None:
        """The next item to send, or ``None`` when the window is full (wait for acks)."""
        if not self.free:
            return None
        item = Item(self.next_seq, value, version)
        self.next_seq += 1
        self.unacked[item.seq] = item
        return item

    def ack(self, upto: int) -> int:
        """The consumer committed every item up to and including ``upto``; returns how many
        were newly acknowledged. Acks for items never sent are refused."""
        if upto >= self.next_seq:
            raise ValueError(f"ack for item {upto}, but only {self.next_seq} were sent")
        done = 0
        while self.unacked and next(iter(self.unacked)) <= upto:
            self.unacked.popitem(last=False)
            done += 1
        return done

    def ack_one(self, seq: int) -> bool:
        """Selective acknowledgement (an unordered edge); ``False`` if it was not outstanding."""
        return self.unacked.pop(seq, None) is not None

    def redeliver(self) -> list[Item]:
        """Everything not yet acknowledged, in sequence order (after a consumer restart)."""
        return list(self.unacked.values())


class Receiver:
    """The consumer end: de-duplicates, orders (on an ordered edge), applies staleness."""

    def __init__(
        self, *, ordered: bool = True, staleness: Staleness | None = None, committed: int = -1
    ) -> None:
        self.ordered = ordered
        self.staleness = staleness
        #: Every item up to here is committed (its effect happened, or it was dropped as stale).
        self.committed = committed
        self._done_above: set[int] = set()  # committed items past ``committed`` (unordered)
        self._waiting: dict[int, Item] = {}  # items that arrived early (ordered)
        self._next = committed + 1  # the next item an ordered edge hands on
        self.version = 0
        self.duplicates = 0
        self.dropped = 0
        self.requeued: list[Item] = []

    def set_version(self, version: int) -> None:
        """The consumer's current version (for example, of the policy it trains)."""
        self.version = version

    def receive(self, item: Item) -> list[Item]:
        """Items to process now, in order; duplicates and stale items are filtered out."""
        if self._seen(item.seq):
            self.duplicates += 1
            return []
        if not self.ordered:
            return self._fresh([item])
        if item.seq in self._waiting:
            self.duplicates += 1
            return []
        self._waiting[item.seq] = item
        ready: list[Item] = []
        while self._next in self._waiting:
            ready.append(self._waiting.pop(self._next))
            self._next += 1
        return self._fresh(ready)

    def commit(self, seq: int) -> int:
        """The effect of item ``seq`` happened; returns the new high-water mark to acknowledge
        (and to save with the effect, so a restarted consumer resumes from it)."""
        if seq <= self.committed or seq in self._done_above:
            raise ValueError(f"item {seq} was committed already")
        self._done_above.add(seq)
        while self.committed + 1 in self._done_above:
            self.committed += 1
            self._done_above.discard(self.committed)
        return self.committed

    def _seen(self, seq: int) -> bool:
        if seq <= self.committed or seq in self._done_above:
            return True
        return self.ordered and seq < self._next

    def _fresh(self, items: list[Item]) -> list[Item]:
        if self.staleness is None:
            return items
        keep: list[Item] = []
        floor = self.version - self.staleness.eta
        for item in items:
            if item.version is not None and item.version < floor:
                self.commit(item.seq)  # handled: it must not come back
                if self.staleness.policy == "drop":
                    self.dropped += 1
                else:
                    self.requeued.append(item)
                continue
            keep.append(item)
        return keep

    def take_requeued(self) -> list[Item]:
        """Stale items to send back to their producer (policy ``requeue``)."""
        items, self.requeued = self.requeued, []
        return items
