"""The KV store's block index, sans-IO: which content-addressed blocks are stored, in which
tiers and slots, who may read them, and what must move between tiers.

Blocks are keyed by ``(namespace, block hash)``: the generator's chained hashes, under the
model, block size, weight version and salt they were computed with. Semantics:

- **Writers.** A namespace belongs to its first writer (an opaque identity); puts and leases
  naming another are refused (:class:`KVStoreError`). Nothing checks a block's bytes against
  its hash (a hash of tokens): a writer is trusted for its own namespaces only.
- **Two-phase puts.** :meth:`begin_put` reserves first-tier slots for the blocks not stored
  yet; nothing is visible until :meth:`end_put`. A put not ended within ``put_timeout_s`` (its
  writer died) is dropped by :meth:`maintain` and its slots reused; :meth:`abort_put` drops
  one at once. Stored blocks are immutable.
- **Leases.** :meth:`lease` grants the longest stored prefix of a request until an expiry on
  the index's clock; a leased block is never evicted, demoted away or removed. A reader checks
  :meth:`check_lease` after its read: a slot is reused only after its lease has expired on
  the same clock, so a read that finished before the expiry read the leased bytes.
- **Pins.** A hard pin keeps a block in the store until unpinned; a soft pin (``soft_pin_s``)
  makes it the last to be evicted. Explicit :meth:`remove` overrides pins, never leases.
- **Tiers** (first: host memory, then local disk): a block has one copy per tier at most, each
  under the same key. A first tier over ``high_watermark`` is brought to ``low_watermark`` by
  demotions (:meth:`maintain` returns the copies to make; the source copy is dropped once the
  shell reports the copy made); the last tier is trimmed the same way by evicting, least
  recently used first: copies with another copy elsewhere, then unpinned blocks, then soft
  pinned ones. A lease of a block held only in a later tier promotes it: the lease carries the
  copy to make first, and the lower copy stays (a later demotion is then free). A put that
  finds no free slot evicts at once, by the same order.
- **Events** (:class:`Stored`, :class:`Removed`, :class:`Cleared`, with the tier) are numbered
  and kept (``max_events``) for consumers to replay; one that fell behind resynchronises from
  :meth:`snapshot`.

Time is an argument (``now``, seconds on any monotonic clock), so the simulator can drive this
on virtual time. No I/O here.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from typing import Any

from ._tiers import Block, Key, TieredBlocks
from ._types import (
    BlockLocation,
    Cleared,
    KVNamespace,
    KVStoreError,
    Lease,
    LeaseExpiredError,
    Match,
    Move,
    Put,
    Stored,
    Tier,
)

__all__ = ["BlockIndex"]


class BlockIndex(TieredBlocks):
    """Content-addressed KV blocks over ``tiers`` (fastest first). See the module docstring for
    the semantics; every method runs in constant or linear time in what it touches, and
    raises :class:`KVStoreError` (or ``ValueError`` / ``TypeError`` for malformed arguments)
    without changing anything."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        high_watermark: float = 0.9,
        low_watermark: float = 0.8,
        lease_s: float = 10.0,
        put_timeout_s: float = 30.0,
        soft_pin_s: float = 1800.0,
        max_events: int = 65536,
    ) -> None:
        if min(lease_s, put_timeout_s, soft_pin_s) <= 0:
            raise ValueError("lease_s, put_timeout_s and soft_pin_s must be positive")
        super().__init__(tiers, high_watermark, low_watermark, max_events)
        self.lease_s, self.put_timeout_s, self.soft_pin_s = lease_s, put_timeout_s, soft_pin_s
        self._writing: dict[Key, int] = {}  # blocks a put reserved, by put id
        self._puts: dict[int, tuple[Put, float]] = {}  # with the time each began
        self._writers: dict[KVNamespace, str] = {}  # who owns each namespace written to

    # -- puts ----------------------------------------------------------------------------------

    def begin_put(
        self, namespace: KVNamespace, hashes: Sequence[bytes], now: float, writer: str = ""
    ) -> Put:
        """Reserve first-tier slots for the blocks of ``hashes`` (a chain, in order) not stored
        or being put already, evicting if there is no free slot; stops at the first block it
        finds no room for (``Put.dropped`` counts it and the rest). The first put into a
        namespace makes ``writer`` its owner; raises :class:`KVStoreError` when another
        writer owns it."""
        keys = _keys(namespace, hashes)
        self._check_writer(namespace, writer)
        self._writers.setdefault(namespace, writer)
        put_id, first = next(self._ids), self._tiers[0]
        writes: list[BlockLocation] = []
        skipped = dropped = 0
        for n, key in enumerate(keys):
            if key in self._writing or key in self._blocks:
                skipped += 1
                self._touch(key)
                continue
            slot = self._take_slot(0, now)
            if slot is None:
                dropped = len(keys) - n
                break
            self._writing[key] = put_id
            writes.append(BlockLocation(key[1], first.spec.name, slot))
        put = Put(put_id, namespace, tuple(writes), skipped, dropped)
        self._puts[put_id] = (put, now)
        return put

    def put_open(self, put_id: int) -> bool:
        """Whether put ``put_id`` is still open (not ended, aborted or expired)."""
        return put_id in self._puts

    def end_put(self, put_id: int, now: float) -> int:
        """Make a put's blocks visible (one :class:`Stored` event); returns how many. Raises
        :class:`KVStoreError` for a put that was aborted, timed out or ended already."""
        entry = self._puts.pop(put_id, None)
        if entry is None:
            raise KVStoreError(
                f"put {put_id} is not open: it ended, was aborted, or was not ended within "
                f"{self.put_timeout_s} s and its space was reclaimed; put the blocks again"
            )
        put, _ = entry
        first = self._tiers[0]
        for loc in put.writes:
            key = (put.namespace, loc.block_hash)
            del self._writing[key]
            self._blocks[key] = Block(copies={first.spec.name: loc.slot})
            first.lru[key] = None
        if put.writes:
            self._emit(
                Stored(put.namespace, tuple(w.block_hash for w in put.writes), first.spec.name)
            )
        self._count["stored_blocks"] += len(put.writes)
        return len(put.writes)

    def abort_put(self, put_id: int) -> bool:
        """Drop a put's reservations (nothing of it becomes visible). Idempotent: ``False``
        when no such put is open."""
        entry = self._puts.pop(put_id, None)
        if entry is None:
            return False
        put, _ = entry
        for loc in put.writes:
            del self._writing[(put.namespace, loc.block_hash)]
            self._tiers[0].free.append(loc.slot)
        return True

    # -- lookups and leases --------------------------------------------------------------------

    def match(self, namespace: KVNamespace, hashes: Sequence[bytes], now: float) -> Match:
        """The longest stored prefix of ``hashes``, in tokens, and per tier how many of those
        tokens have a copy there. Counts the query and its hit tokens; marks the blocks used."""
        keys = _keys(namespace, hashes, chain=False)  # a repeated hash does no harm here
        by_tier = dict.fromkeys(self._by_name, 0)
        blocks, lru = self._blocks, {t.spec.name: t.lru for t in self._tiers}
        found = 0
        for key in keys:
            block = blocks.get(key)
            if block is None:
                break
            found += 1
            for tier in block.copies:
                by_tier[tier] += namespace.block_size
                lru[tier].move_to_end(key)
        tokens = found * namespace.block_size
        self._count["query_tokens"] += len(keys) * namespace.block_size
        self._count["hit_tokens"] += tokens
        return Match(tokens, by_tier)

    def lease(
        self,
        namespace: KVNamespace,
        hashes: Sequence[bytes],
        now: float,
        ttl: float | None = None,
        writer: str = "",
    ) -> Lease:
        """Lease the longest stored prefix of ``hashes`` for ``ttl`` seconds (default
        ``lease_s``), each block in the first tier: a block held only lower down gets a slot
        there and a :class:`Move` in ``Lease.moves`` (the prefix stops at a block for which no
        first-tier slot can be had, or that is being promoted for another lease). A block being
        demoted keeps its first-tier copy while leased. Release the lease when done. Raises
        :class:`KVStoreError` when the namespace belongs to a writer other than ``writer``
        (blocks are read only as their own writer's)."""
        keys = _keys(namespace, hashes)
        self._check_writer(namespace, writer)
        ttl = self.lease_s if ttl is None else ttl
        if not ttl > 0:
            raise ValueError(f"a lease lasts a positive time, got {ttl}")
        lease_id, top = next(self._ids), self._tiers[0].spec.name
        held: list[Key] = []
        for key in keys:  # protect the whole prefix before any eviction
            block = self._blocks.get(key)
            if block is None or (block.move is not None and top not in block.copies):
                break  # not stored, or being promoted for another lease
            block.leases.add(lease_id)
            held.append(key)
        self._leases[lease_id] = (Lease(lease_id, namespace, (), (), now + ttl), held)
        locations: list[BlockLocation] = []
        moves: list[Move] = []
        for n, key in enumerate(held):
            block = self._blocks[key]
            slot = block.copies.get(top)
            if slot is None:
                slot = self._take_slot(0, now)
                if slot is None:
                    for rest in held[n:]:
                        self._blocks[rest].leases.discard(lease_id)
                    del held[n:]
                    break
                moves.append(self._start_move(key, block, self._nearest_copy(block), top, slot))
            self._touch(key)
            locations.append(BlockLocation(key[1], top, slot))
        lease = Lease(lease_id, namespace, tuple(locations), tuple(moves), now + ttl)
        self._leases[lease_id] = (lease, held)
        self._count["leases_granted"] += 1
        return lease

    def check_lease(self, lease_id: int, now: float) -> None:
        """Raise :class:`LeaseExpiredError` unless the lease is still held at ``now``: call it
        after reading, and discard what was read if it raises."""
        entry = self._leases.get(lease_id)
        if entry is None or entry[0].expires <= now:
            raise LeaseExpiredError(
                f"lease {lease_id} expired or was released before the read finished; what was "
                f"read may have been overwritten: discard it and lease the blocks again"
            )

    def lease_open(self, lease_id: int, now: float) -> bool:
        """Whether lease ``lease_id`` is held at ``now`` (not released, not expired)."""
        entry = self._leases.get(lease_id)
        return entry is not None and entry[0].expires > now

    def release(self, lease_id: int) -> bool:
        """End a lease early. Idempotent: ``False`` when it is not held."""
        entry = self._leases.pop(lease_id, None)
        if entry is None:
            return False
        for key in entry[1]:
            block = self._blocks.get(key)
            if block is not None:
                block.leases.discard(lease_id)
        return True

    # -- pins and removal ----------------------------------------------------------------------

    def pin(
        self,
        namespace: KVNamespace,
        hashes: Sequence[bytes],
        now: float,
        *,
        hard: bool = False,
        ttl: float | None = None,
    ) -> int:
        """Pin the stored ones of ``hashes``: hard (never evicted until unpinned) or soft
        (evicted last, for ``ttl`` seconds, default ``soft_pin_s``). Returns how many."""
        if hard and ttl is not None:
            raise ValueError("a hard pin lasts until unpinned; ttl is for soft pins")
        ttl = self.soft_pin_s if ttl is None else ttl
        if not ttl > 0:
            raise ValueError(f"a soft pin lasts a positive time, got {ttl}")
        pinned = 0
        for key in _keys(namespace, hashes):
            block = self._blocks.get(key)
            if block is None:
                continue
            if hard:
                block.pin, block.pin_expires = "hard", math.inf
            elif block.pin != "hard":
                block.pin, block.pin_expires = "soft", now + ttl
            pinned += 1
        return pinned

    def unpin(self, namespace: KVNamespace, hashes: Sequence[bytes]) -> int:
        """Drop the pins of ``hashes``; returns how many were pinned."""
        unpinned = 0
        for key in _keys(namespace, hashes):
            block = self._blocks.get(key)
            if block is not None and block.pin is not None:
                block.pin, block.pin_expires = None, math.inf
                unpinned += 1
        return unpinned

    def remove(
        self, namespace: KVNamespace, hashes: Sequence[bytes], now: float
    ) -> tuple[int, int]:
        """Remove the stored ones of ``hashes``, pinned or not; a leased block (or one being
        moved) stays. Returns ``(removed, refused)``."""
        return self._remove_keys(_keys(namespace, hashes), now, clear=False)

    def clear(self, now: float, namespace: KVNamespace | None = None) -> int:
        """Remove every block (of ``namespace``) but the leased ones and those being moved;
        returns how many stayed. A tier left empty by clearing everything reports
        :class:`Cleared`."""
        keys = [k for k in self._blocks if namespace is None or k[0] == namespace]
        return self._remove_keys(keys, now, clear=namespace is None)[1]

    # -- tiers ---------------------------------------------------------------------------------

    def maintain(self, now: float) -> list[Move]:
        """Housekeeping, for the shell to call often: drop expired puts, leases and soft pins;
        trim the last tier over its high watermark; and return the demotions that bring each
        other tier over it down to its low watermark (make each copy, then :meth:`moved`)."""
        self._expire(now)
        return self._plan_moves(now)

    # -- reading the state ---------------------------------------------------------------------

    def stats(self, now: float) -> dict[str, Any]:
        """Counts for metrics: blocks and slots per tier, open puts, leases, moves and pins,
        and the running totals (``hit_tokens`` / ``query_tokens``, evictions per tier, ...)."""
        pins = collections.Counter(
            b.pin for b in self._blocks.values() if b.pin and b.pin_expires > now
        )
        return {
            "blocks": len(self._blocks),
            "tiers": {
                t.spec.name: {"used": t.used, "blocks": len(t.lru), "capacity": t.spec.blocks}
                for t in self._tiers
            },
            "open_puts": len(self._puts),
            "leases": sum(lease.expires > now for lease, _ in self._leases.values()),
            "moves": len(self._moves),
            "pinned": {"soft": pins["soft"], "hard": pins["hard"]},
            **dict(self._count),
        }

    # -- inside --------------------------------------------------------------------------------

    def _check_writer(self, namespace: KVNamespace, writer: str) -> None:
        if not isinstance(writer, str):
            raise TypeError(f"a writer is a string, got {type(writer).__name__}")
        owner = self._writers.get(namespace)
        if owner is not None and owner != writer:
            raise KVStoreError(
                f"namespace {namespace.model!r} (block size {namespace.block_size}, weights "
                f"{namespace.weight_version}) belongs to another writer; this store takes and "
                f"gives its blocks only with that writer's key (use a key of your own under "
                f"another salt)"
            )

    def _remove_keys(self, keys: Iterable[Key], now: float, clear: bool) -> tuple[int, int]:
        removed = refused = 0
        per_tier: dict[str, list[Key]] = collections.defaultdict(list)
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                continue
            if block.move is not None or self._leased(block, now):
                refused += 1
                continue
            removed += 1
            for tier in block.copies:
                per_tier[tier].append(key)
        for tier_name, tier_keys in per_tier.items():
            emptied = clear and len(tier_keys) == len(self._tiers[self._by_name[tier_name]].lru)
            self._drop_copies(tier_keys, tier_name, event=not emptied)
            if emptied:
                self._emit(Cleared(tier_name))
        self._count["removed_blocks"] += removed
        return removed, refused

    def _expire(self, now: float) -> None:
        for put_id in [
            p for p, (_, began) in self._puts.items() if began + self.put_timeout_s <= now
        ]:
            self.abort_put(put_id)
            self._count["expired_puts"] += 1
        for lease_id in [i for i, (lease, _) in self._leases.items() if lease.expires <= now]:
            self.release(lease_id)
            self._count["expired_leases"] += 1
        for block in self._blocks.values():
            if block.pin == "soft" and block.pin_expires <= now:
                block.pin, block.pin_expires = None, math.inf


def _keys(namespace: KVNamespace, hashes: Sequence[bytes], chain: bool = True) -> list[Key]:
    """The keys of ``hashes`` under ``namespace``, each checked; a ``chain`` names each block
    once."""
    if not isinstance(namespace, KVNamespace):
        raise TypeError(f"namespace must be a KVNamespace, got {type(namespace).__name__}")
    if isinstance(hashes, (bytes, str)):
        raise TypeError("hashes is a sequence of block hashes (bytes), not one value")
    if not all(type(h) is bytes and h for h in hashes):
        bad = next(h for h in hashes if type(h) is not bytes or not h)
        raise TypeError(f"a block hash is non-empty bytes, got {bad!r:.40}")
    keys = [(namespace, h) for h in hashes]
    if chain and len(set(hashes)) != len(keys):
        raise ValueError("a chain of block hashes names each block once")
    return keys
