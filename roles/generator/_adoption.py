"""What the scheduler does with KV blocks computed elsewhere (a KV store, a prefill
generator): the keys a prompt's blocks would have, how many of them are cached, and entering
blocks into the prefix cache. A part of :class:`~._scheduler.Scheduler`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._blocks import BlockPool, chain_hashes

__all__ = ["BlocksFromElsewhere"]


class BlocksFromElsewhere:
    """The scheduler's methods for blocks from elsewhere, over its ``pool`` and
    ``extra_keys``."""

    pool: BlockPool
    extra_keys: tuple[Any, ...]

    def prompt_keys(self, prompt: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The keys of ``prompt``'s blocks that a prefix hit may cover (the full ones before
        its last token), chained as :meth:`_admit` computes them."""
        size, extra = self.pool.block_size, (*self.extra_keys, cache_salt)
        return list(chain_hashes(None, prompt, size, extra, range((len(prompt) - 1) // size)))

    def keyed(
        self, prompt: Sequence[int], cache_salt: str | None = None
    ) -> tuple[tuple[Any, ...], list[bytes]]:
        """:meth:`prompt_keys` with the extra keys they are made under: a ``Seq``'s
        ``known_keys``, so admitting it does not hash the prompt again."""
        return (*self.extra_keys, cache_salt), self.prompt_keys(prompt, cache_salt)

    def cached_run(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are in the prefix cache."""
        n = 0
        while n < len(keys) and self.pool.lookup(keys[n]) is not None:
            n += 1
        return n

    def adopt(
        self, keys: Sequence[bytes], prompt: Sequence[int], start: int, count: int
    ) -> tuple[int, list[int]]:
        """Enter blocks whose keys and values come from elsewhere into the prefix cache:
        those of ``keys[start : start + count]`` (``prompt_keys(prompt)``) not cached yet,
        after ``keys[:start]``. Returns the index of the first key entered and its blocks
        (fill them before the next step; they are free and cached, as blocks a finished
        request left). Nothing when a key before ``start`` is not cached (any more): they
        could not be reached. At most the free blocks are used; the prefix is held
        meanwhile, so they never evict it."""
        first, prefix, blocks = self.reserve(keys, start, count)
        self.enter_reserved(keys, prompt, first, prefix, blocks, keep=True)
        return first, blocks

    def reserve(
        self, keys: Sequence[bytes], start: int, count: int
    ) -> tuple[int, list[int], list[int]]:
        """The first half of :meth:`adopt`, for blocks to fill before they are entered: the
        index of the first key of ``keys[start : start + count]`` not cached, the cached
        blocks before it and blocks for those from it on, all held (the new ones in no
        cache) until :meth:`enter_reserved`."""
        first = self.cached_run(keys[: start + count])
        if first < start or first >= start + count:
            return first, [], []
        prefix = [b for b in map(self.pool.lookup, keys[:first]) if b is not None]
        free_prefix = sum(1 for b in prefix if self.pool.refs[b] == 0)
        n = min(start + count - first, self.pool.num_free - free_prefix)
        if n <= 0:
            return first, [], []
        self.pool.take(prefix)
        return first, prefix, self.pool.allocate(n)

    def enter_reserved(
        self,
        keys: Sequence[bytes],
        prompt: Sequence[int],
        first: int,
        prefix: list[int],
        blocks: list[int],
        *,
        keep: bool,
    ) -> None:
        """End a :meth:`reserve`: with ``keep``, ``blocks`` (filled) enter the prefix cache
        under ``keys[first:]`` (a key cached meanwhile keeps its block); all are let go."""
        if keep and blocks:
            size = self.pool.block_size
            parent = keys[first - 1] if first else None
            tokens = list(prompt[first * size : (first + len(blocks)) * size])
            self.pool.commit(blocks, keys[first : first + len(blocks)], parent, tokens, log=False)
        self.pool.release(reversed(prefix + blocks))  # the tail is evicted first
