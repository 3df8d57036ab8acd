"""The paged KV cache's bookkeeping, sans-IO (no torch): a fixed pool of blocks with
reference counts, and the prefix cache over it.

A full block is keyed by a chained hash: of its parent block's hash, its tokens and the
request's extra keys (the model, the weight version, a per-request ``cache_salt``), so a
block is reused only by a request with the same tokens before it under the same weights and
salt. A block whose last user left stays cached, at the tail of the free queue, until it is
needed for new work: allocation takes free blocks from the head, evicting the cached ones it
takes. The pool reports what it stores and evicts as events (:class:`BlockStored`,
:class:`BlockRemoved`, :class:`AllBlocksCleared`), with the hashes, the parent hash, the
tokens and the tier, for a KV store or a router to follow.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import msgpack

__all__ = [
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "chain_hashes",
    "hash_block",
]

TIER = "device"


@dataclasses.dataclass(frozen=True)
class BlockStored:
    """Full blocks entered the prefix cache: ``block_hashes`` in order, the first one's
    ``parent_hash`` (``None`` at a sequence's start), their ``token_ids`` end to end."""

    block_hashes: list[bytes]
    parent_hash: bytes | None
    token_ids: list[int]
    block_size: int
    tier: str = TIER


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    """Blocks left the prefix cache (evicted for new work)."""

    block_hashes: list[bytes]
    tier: str = TIER


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block left the prefix cache at once."""

    tier: str = TIER


Event = BlockStored | BlockRemoved | AllBlocksCleared


def hash_block(parent: bytes | None, tokens: Sequence[int], extra: Sequence[Any]) -> bytes:
    """The key of a full block: SHA-256 over its parent's key, its tokens and the extra keys
    (msgpack-encoded; the extra keys must be msgpack values)."""
    return next(chain_hashes(parent, tokens, len(tokens), extra, range(1)))


def chain_hashes(
    parent: bytes | None, tokens: Sequence[int], size: int, extra: Sequence[Any], blocks: range
) -> Iterator[bytes]:
    """The keys of ``tokens``' full blocks numbered ``blocks`` (of ``size`` tokens), chained
    from ``parent`` (the key of the block before the first), each :func:`hash_block`'s: the
    SHA-256 of the msgpack array ``[parent, tokens, extra]``, with the extra keys encoded
    once. A generator: a caller that stops at the first key it has not cached hashes no
    further."""
    packer = msgpack.Packer(use_bin_type=True)
    pack, sha256 = packer.pack, hashlib.sha256
    tail = pack(list(extra))
    if not isinstance(tokens, (list, tuple)):  # msgpack encodes both as an array
        tokens = list(tokens)
    head = b"\x93" + pack(parent)  # the header of hash_block's 3-element array, its parent
    for b in blocks:
        h = sha256(head)
        h.update(pack(tokens[b * size : (b + 1) * size]))
        h.update(tail)
        parent = h.digest()
        head = b"\x93\xc4\x20" + parent  # a parent from here on: 32 bytes, as msgpack's bin 8
        yield parent


class BlockPool:
    """``num_blocks`` KV blocks of ``block_size`` tokens each.

    Every block is either in use (its reference count is the number of requests holding it)
    or in the free queue; a free block may still be cached (it has a hash, and a request with
    that prefix can take it back). Raises ``ValueError`` for a misuse (freeing a block not
    held, allocating more than is free): the caller checks :attr:`num_free` first."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs blocks of tokens, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        #: The free queue: the blocks never used yet (``_fresh`` onwards, in order), then
        #: those given back, in the order they were (kept apart so a large pool costs nothing
        #: to make).
        self._fresh = 0
        self._free: OrderedDict[int, None] = OrderedDict()
        self._events: list[Event] = []
        #: Blocks entered since :meth:`take_stored` (``None``: not kept), for offloading.
        self._stored: list[tuple[bytes, int]] | None = None

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free ones, cached or not)."""
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def usage(self) -> float:
        """The fraction of blocks in use."""
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks from the head of the free queue, each held once; a cached one leaves
        the cache (a :class:`BlockRemoved` event)."""
        if n > self.num_free:
            raise ValueError(f"{n} blocks asked for, {self.num_free} free")
        fresh = min(n, self.num_blocks - self._fresh)
        blocks = list(range(self._fresh, self._fresh + fresh))
        self._fresh += fresh
        blocks += [self._free.popitem(last=False)[0] for _ in range(n - fresh)]
        evicted = []
        for b in blocks:
            self.refs[b] = 1
            key = self.hashes[b]
            if key is not None:
                self.hashes[b] = None
                if self.cached.get(key) == b:
                    del self.cached[key]
                    evicted.append(key)
        if evicted:
            self._events.append(BlockRemoved(evicted))
        return blocks

    def lookup(self, key: bytes) -> int | None:
        """The cached block of ``key``, if any (not taken)."""
        return self.cached.get(key)

    def take(self, blocks: Iterable[int]) -> None:
        """Hold cached blocks once more (a prefix hit); a free one leaves the free queue."""
        for b in blocks:
            if self.refs[b] == 0:
                del self._free[b]
            self.refs[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one hold of each block, in the order given: a block nobody holds any more
        joins the tail of the free queue (so the first given is evicted first)."""
        for b in blocks:
            if self.refs[b] <= 0:
                raise ValueError(f"block {b} is not held")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free[b] = None

    def commit(
        self,
        blocks: Sequence[int],
        keys: Sequence[bytes],
        parent: bytes | None,
        tokens: list[int],
        *,
        log: bool = True,
    ) -> None:
        """``blocks`` just became full with ``tokens`` (theirs, end to end): enter them under
        ``keys``, the first one's parent being ``parent``. A key that another block holds
        already keeps that one (this block stays uncached). ``log``: kept for
        :meth:`take_stored` when that is on (not for blocks that came from a store)."""
        size = self.block_size
        run: list[int] = []  # indexes of a run of blocks entered one after another

        def report() -> None:
            if run:
                first = run[0]
                before = parent if first == 0 else keys[first - 1]
                ids = tokens[first * size : (run[-1] + 1) * size]
                self._events.append(BlockStored([keys[i] for i in run], before, ids, size))
                run.clear()

        for i, (b, key) in enumerate(zip(blocks, keys, strict=True)):
            if key in self.cached or self.hashes[b] is not None:
                report()
                continue
            self.hashes[b] = key
            self.cached[key] = b
            run.append(i)
            if log and self._stored is not None:
                self._stored.append((key, b))
        report()

    def clear_cache(self) -> bool:
        """Forget every cached block (new weights make them wrong for every request); only
        when no block is in use, else ``False`` and nothing changes."""
        if self.num_free != self.num_blocks:
            return False
        self.hashes = [None] * self.num_blocks
        self.cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def keep_stored(self, on: bool) -> None:
        """Whether to keep the blocks entered into the cache for :meth:`take_stored`."""
        self._stored = [] if on else None

    def take_stored(self) -> list[tuple[bytes, int]]:
        """``(key, block)`` of the blocks entered since the last call that still hold that
        key (not evicted meanwhile), in order."""
        if not self._stored:
            return []
        stored, self._stored = self._stored, []
        return [(key, b) for key, b in stored if self.hashes[b] == key]

    def take_events(self) -> list[Event]:
        """The events since the last call, in order."""
        events, self._events = self._events, []
        return events
