"""A KV store's tiers, sans-IO: the blocks and their copies, each tier's slots and least
recently used order, the eviction order, the moves between tiers, and the numbered event log.
:class:`~._index.BlockIndex` builds puts, leases and pins on it. No I/O here."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence

from ._types import (
    BlockLocation,
    EventPage,
    KVNamespace,
    KVStoreError,
    Lease,
    Move,
    Removed,
    Stored,
    StoreEvent,
    Tier,
)

__all__ = ["Block", "Key", "TieredBlocks"]

Key = tuple[KVNamespace, bytes]


@dataclasses.dataclass
class Block:
    copies: dict[str, int] = dataclasses.field(default_factory=dict)  # tier -> slot
    leases: set[int] = dataclasses.field(default_factory=set)
    move: int | None = None  # the move in flight: its source and target stay put
    pin: str | None = None  # "soft" | "hard"
    pin_expires: float = math.inf


@dataclasses.dataclass
class _Tier:
    spec: Tier
    free: list[int]
    lru: collections.OrderedDict[Key, None] = dataclasses.field(
        default_factory=collections.OrderedDict
    )  # blocks with a copy here, least recently used first

    @property
    def used(self) -> int:
        return self.spec.blocks - len(self.free)


class TieredBlocks:
    """Blocks over ``tiers`` (fastest first), and what moves between them."""

    def __init__(
        self, tiers: Sequence[Tier], high_watermark: float, low_watermark: float, max_events: int
    ) -> None:
        if not tiers or len({t.name for t in tiers}) != len(tiers):
            raise ValueError("a store needs one or more tiers with distinct names")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError(
                f"watermarks must satisfy 0 < low <= high <= 1, got {low_watermark}, "
                f"{high_watermark}"
            )
        if max_events < 1:
            raise ValueError(f"max_events must be positive, got {max_events}")
        self._tiers = [_Tier(t, list(range(t.blocks - 1, -1, -1))) for t in tiers]
        self._by_name = {t.spec.name: i for i, t in enumerate(self._tiers)}
        self.high_watermark, self.low_watermark = high_watermark, low_watermark
        self._blocks: dict[Key, Block] = {}
        self._leases: dict[int, tuple[Lease, list[Key]]] = {}  # with the blocks each holds
        self._moves: dict[int, Move] = {}
        self._ids = itertools.count(1)
        self._events: collections.deque[tuple[int, StoreEvent]] = collections.deque(
            maxlen=max_events
        )
        self._seq = 0
        self._count: collections.Counter[str] = collections.Counter()

    def moved(self, move_id: int, now: float, *, ok: bool = True) -> None:
        """The shell made a move's copy (``ok``) or failed to: the target copy becomes readable
        (and a demoted source copy goes, unless leased meanwhile), or its slot is freed.
        Raises :class:`KVStoreError` for a move not in flight."""
        move = self._moves.pop(move_id, None)
        if move is None:
            raise KVStoreError(f"move {move_id} is not in flight (reported twice?)")
        key = (move.namespace, move.block_hash)
        block = self._blocks[key]
        block.move = None
        target = self._tiers[self._by_name[move.target.tier]]
        if not ok:
            target.free.append(move.target.slot)
            self._count["failed_moves"] += 1
            return
        block.copies[move.target.tier] = move.target.slot
        target.lru[key] = None
        self._emit(Stored(move.namespace, (move.block_hash,), move.target.tier))
        demoted = self._by_name[move.target.tier] > self._by_name[move.source.tier]
        self._count["demotions" if demoted else "promotions"] += 1
        if demoted and not self._leased(block, now):
            self._drop_copies([key], move.source.tier)

    def events(self, after: int = 0) -> EventPage:
        """The events numbered above ``after`` that are still kept (see :class:`EventPage`)."""
        oldest = self._events[0][0] if self._events else self._seq + 1
        picked = tuple(e for e in self._events if e[0] > after)
        return EventPage(picked, picked[-1][0] if picked else max(after, 0), after < oldest - 1)

    def snapshot(self) -> tuple[int, dict[str, list[Key]]]:
        """The last event's number and, per tier, every block with a copy there (least
        recently used first): a consumer's starting point."""
        return self._seq, {t.spec.name: list(t.lru) for t in self._tiers}

    # -- inside --------------------------------------------------------------------------------

    def _plan_moves(self, now: float) -> list[Move]:
        """Trim the last tier to its low watermark if over its high one; return the demotions
        that bring each other tier over its high watermark down to its low one."""
        moves: list[Move] = []
        for i, tier in enumerate(self._tiers):
            leaving = sum(  # demotions in flight: their sources go once they are reported
                m.source.tier == tier.spec.name and self._by_name[m.target.tier] > i
                for m in self._moves.values()
            )
            if tier.used - leaving <= self.high_watermark * tier.spec.blocks:
                continue
            goal = math.floor(self.low_watermark * tier.spec.blocks)
            if i == len(self._tiers) - 1:
                while tier.used > goal and self._evict(i, now):
                    pass
                continue
            lower = self._tiers[i + 1].spec.name
            for key in list(tier.lru):
                if tier.used - leaving <= goal:
                    break
                block = self._blocks[key]
                if block.move is not None or self._leased(block, now):
                    continue
                if any(self._by_name[t] > i for t in block.copies):
                    self._drop_copies([key], tier.spec.name)  # a copy lower down already
                    continue
                slot = self._take_slot(i + 1, now)
                if slot is None:
                    break
                moves.append(self._start_move(key, block, tier.spec.name, lower, slot))
                leaving += 1
        return moves

    def _emit(self, event: StoreEvent) -> None:
        self._seq += 1
        self._events.append((self._seq, event))

    def _touch(self, key: Key) -> None:
        block = self._blocks.get(key)
        for tier in block.copies if block else ():
            self._tiers[self._by_name[tier]].lru.move_to_end(key)

    def _leased(self, block: Block, now: float) -> bool:
        return any(self._leases[i][0].expires > now for i in block.leases if i in self._leases)

    def _nearest_copy(self, block: Block) -> str:
        """The tier of the block's copy closest to the first (the one to promote from)."""
        return min(block.copies, key=self._by_name.__getitem__)

    def _start_move(self, key: Key, block: Block, source: str, target: str, slot: int) -> Move:
        move = Move(
            next(self._ids),
            key[0],
            key[1],
            BlockLocation(key[1], source, block.copies[source]),
            BlockLocation(key[1], target, slot),
        )
        self._moves[move.id] = move
        block.move = move.id
        return move

    def _take_slot(self, i: int, now: float) -> int | None:
        tier = self._tiers[i]
        if not tier.free and not self._evict(i, now):
            return None
        return tier.free.pop()

    def _evict(self, i: int, now: float) -> bool:
        """Free one slot of tier ``i``: drop the least recently used copy that has another
        copy elsewhere, else the least recently used unpinned block, else soft pinned one."""
        best: tuple[int, Key] | None = None
        for key in self._tiers[i].lru:
            block = self._blocks[key]
            if block.move is not None or self._leased(block, now):
                continue
            pinned = block.pin if block.pin_expires > now else None
            rank = 0 if len(block.copies) > 1 else {None: 1, "soft": 2}.get(pinned, 3)
            if rank < 3 and (best is None or rank < best[0]):
                best = (rank, key)
                if rank == 0:
                    break
        if best is None:
            return False
        self._count[f"evicted_{self._tiers[i].spec.name}"] += 1
        self._drop_copies([best[1]], self._tiers[i].spec.name)
        return True

    def _drop_copies(self, keys: Iterable[Key], tier_name: str, event: bool = True) -> None:
        tier = self._tiers[self._by_name[tier_name]]
        gone: dict[KVNamespace, list[bytes]] = collections.defaultdict(list)
        for key in keys:
            block = self._blocks[key]
            tier.free.append(block.copies.pop(tier_name))
            del tier.lru[key]
            if not block.copies:
                del self._blocks[key]
            gone[key[0]].append(key[1])
        for namespace, hashes in gone.items() if event else ():
            self._emit(Removed(namespace, tuple(hashes), tier_name))
