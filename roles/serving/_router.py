"""The KV-aware router, sans-IO: which generator a request goes to.

It follows each generator's prefix cache through the events its block pool emits
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), and the KV store's through the
store's (``Stored``, ``Removed``, ``Cleared``), and prices a request (its chain of full-block
hashes) on each generator in rotation with Dynamo's rule:

    cost(g) = prefill_weight * (prefill_blocks(g) + new_blocks(g)) + decode_blocks(g)

``prefill_blocks`` and ``decode_blocks`` are the generator's load (blocks of prompts waiting
to be computed, and of sequences decoding); ``new_blocks`` are the request's blocks past the
prefix ``g`` has cached: each costs 1, except those the store holds, which cost ``store_cost``
(onboarding a block is cheaper than computing it). The cheapest wins; ties go to the less
loaded, then to the name that sorts first. ``round_robin`` and ``least_loaded`` (the least
``prefill_blocks + decode_blocks``) are there to compare against. A generator taken out of
rotation (it died) is never chosen again, and its late events are ignored; one added again
starts with an empty cache.

**Expected blocks.** A generator reports a prompt's blocks only once it has computed them, so
requests sharing a prefix that arrive while the first is still in prefill would each be
priced as a miss everywhere and spread over the generators. :meth:`Router.expect` records that
a request's blocks are on their way to the generator it was routed to; they count as cached
there (for :meth:`Router.choose` given ``now``) until the generator's own event confirms them
or ``expect_s`` seconds pass (a request cancelled before its prefill never stores them).

**Cost.** The router keeps an index of which generators hold each block (a bit mask per
hash), so a request's cached prefix on every generator comes from one walk down its chain
(the masks intersected block by block), not one walk per generator: 128 generators are priced
in about 70 microseconds here.

Hashes are the engine's chained ones, which already cover the model, weight version and salt,
so one router serves one model's generators with one block size. No I/O, no clock here: the
caller passes ``now``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from orchestr.errors import OrchestrError

from ..generator._core._blocks import AllBlocksCleared, BlockRemoved, BlockStored, chain_hashes
from ..kvstore._types import Cleared, Removed, Stored

__all__ = [
    "POLICIES",
    "Choice",
    "GeneratorLostError",
    "Load",
    "NoWorkerError",
    "OverloadedError",
    "Router",
    "ServingError",
    "prompt_hashes",
]

POLICIES = ("kv", "round_robin", "least_loaded")


class ServingError(OrchestrError):
    """A request cannot be served; the message says why."""


class OverloadedError(ServingError):
    """The front door has ``max_pending`` requests in flight already; try again later."""


class GeneratorLostError(ServingError):
    """The generator serving a request died or failed before the request finished."""


class NoWorkerError(ServingError):
    """No generator is in rotation."""


@dataclasses.dataclass(frozen=True)
class Load:
    """A generator's work in KV blocks: of prompts still to prefill, and of sequences
    decoding."""

    prefill_blocks: int = 0
    decode_blocks: int = 0

    @property
    def total(self) -> int:
        return self.prefill_blocks + self.decode_blocks


@dataclasses.dataclass(frozen=True)
class Choice:
    """Where a request goes: ``cached_blocks`` of its prefix are in that generator's cache,
    ``store_blocks`` more in the KV store; ``cost`` as the module docstring defines it."""

    worker: str
    cached_blocks: int
    store_blocks: int
    cost: float


class Router:
    """Routes requests over the generators :meth:`add` put in rotation (see the module
    docstring). Raises ``ValueError`` for a bad policy or weight."""

    def __init__(
        self,
        policy: str = "kv",
        *,
        prefill_weight: float = 1.0,
        store_cost: float = 0.25,
        expect_s: float = 30.0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; use one of {', '.join(POLICIES)}")
        # an infinite weight would make a generator with nothing to prefill cost nan
        if not 0 <= prefill_weight < float("inf") or not 0 <= store_cost <= 1:
            raise ValueError(
                f"prefill_weight must be finite and >= 0 and store_cost within [0, 1], got "
                f"{prefill_weight}, {store_cost}"
            )
        if not expect_s >= 0:
            raise ValueError(f"expect_s must be >= 0, got {expect_s}")
        self.policy, self.prefill_weight, self.store_cost = policy, prefill_weight, store_cost
        self.expect_s = expect_s
        self._cached: dict[str, set[bytes]] = {}
        # Who holds a block: hash -> a bit mask of generators (bit 1 << slot), so the cached
        # prefix of a request is found for every generator at once (:meth:`_overlaps`).
        self._holders: dict[bytes, int] = {}
        self._bit: dict[str, int] = {}
        self._slots: list[str | None] = []  # slot -> generator holding it
        self._sorted: list[str] | None = []
        self._expected: dict[str, dict[bytes, float]] = {}  # worker -> hash -> until
        self._prune_at: dict[str, int] = {}  # worker -> expected's size that prunes it
        self._store: dict[str, set[bytes]] = {}  # tier -> hashes held there
        self._turn = itertools.count()

    @property
    def workers(self) -> list[str]:
        """The generators in rotation, sorted."""
        if self._sorted is None:
            self._sorted = sorted(self._cached)
        return list(self._sorted)

    def add(self, worker: str) -> None:
        """Put ``worker`` in rotation with an empty cache. Raises ``ValueError`` if it is in
        rotation already."""
        if not worker or worker in self._cached:
            raise ValueError(f"worker {worker!r} is empty or in rotation already")
        slot = next((i for i, w in enumerate(self._slots) if w is None), len(self._slots))
        if slot == len(self._slots):
            self._slots.append(None)
        self._slots[slot], self._bit[worker] = worker, 1 << slot
        self._cached[worker] = set()
        self._expected[worker] = {}
        self._sorted = None

    def remove(self, worker: str) -> bool:
        """Take ``worker`` out of rotation (it died or is draining). Idempotent."""
        self._expected.pop(worker, None)
        self._prune_at.pop(worker, None)
        cache = self._cached.pop(worker, None)
        if cache is None:
            return False
        bit = self._bit.pop(worker)
        _drop(self._holders, bit, cache)
        self._slots[bit.bit_length() - 1] = None
        self._sorted = None
        return True

    def expect(self, worker: str, hashes: Sequence[bytes], now: float) -> None:
        """``worker`` was given a request of ``hashes``: count them as cached there until
        its events confirm them or ``expect_s`` passes (module docstring)."""
        expected = self._expected.get(worker)
        if expected is None:
            return
        if len(expected) > self._prune_at.get(worker, 1024):  # drop the expired now and then
            for h in [h for h, until in expected.items() if until <= now]:
                del expected[h]
            self._prune_at[worker] = 2 * len(expected) + 1024  # amortised: a scan per doubling
        cached = self._cached[worker]
        until = now + self.expect_s
        for h in hashes:
            if h not in cached:
                expected[h] = until

    def apply(self, worker: str, events: Iterable[Any]) -> bool:
        """Follow ``worker``'s block pool events, in order; ``False`` (and nothing changes)
        for a worker not in rotation."""
        cache = self._cached.get(worker)
        if cache is None:
            return False
        events = list(events)
        _follow(cache, events, self._holders, self._bit[worker])
        expected = self._expected[worker]
        if expected:  # confirmed: an expected block is never cached when expect() records it
            for event in events:
                if isinstance(event, BlockStored):
                    for h in event.block_hashes:
                        if h in cache:
                            expected.pop(h, None)
        return True

    def apply_store(self, events: Iterable[Any]) -> None:
        """Follow the KV store's events, in order, per tier (a block in any tier is onboarded:
        one on disk is promoted first)."""
        for event in events:
            _follow(self._store.setdefault(event.tier, set()), [event])

    def forget_store(self) -> None:
        """Forget what the store holds (its events were lost, or it went away): no store hit
        is counted until its events say so again."""
        self._store.clear()

    def overlap(self, worker: str, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes``, from the first, ``worker`` has cached."""
        return _prefix(self._cached.get(worker, set()), hashes)

    def choose(
        self,
        hashes: Sequence[bytes],
        loads: Mapping[str, Load] | None = None,
        now: float | None = None,
    ) -> Choice:
        """The generator for a request whose full blocks hash to ``hashes`` (a generator
        missing from ``loads`` has none); with ``now``, the blocks :meth:`expect` recorded
        and not yet expired count as cached. Raises :class:`NoWorkerError` when none is in
        rotation."""
        if not self._cached:
            raise NoWorkerError(
                "no generator is in rotation: every one died or was removed; add one or wait "
                "for a restart"
            )
        loads = loads or {}
        none = Load()
        memo: dict[int, int] = {}  # store hits past a cached prefix, by its length
        if self.policy == "round_robin":
            workers = self.workers
            worker = workers[next(self._turn) % len(workers)]
        elif self.policy == "least_loaded":
            worker = min(
                (ld.prefill_blocks + ld.decode_blocks, w)
                for w in self._cached
                for ld in (loads.get(w, none),)
            )[1]
        else:
            return self._choose_kv(hashes, loads, now, memo)
        cached = _prefix(self._cached[worker], hashes)
        cost, cached, from_store = self._price(
            worker, hashes, loads.get(worker, none), now, memo, cached
        )
        return Choice(worker, cached, from_store, cost)

    def _choose_kv(
        self,
        hashes: Sequence[bytes],
        loads: Mapping[str, Load],
        now: float | None,
        memo: dict[int, int],
    ) -> Choice:
        """The kv rule, in one pass: each generator's cached prefix comes from the index
        (:meth:`_overlaps`), then its expected blocks extend it as :meth:`_price` does, and
        the cheapest key wins. :meth:`_price`'s terms, inlined: a request is priced on every
        generator."""
        none = Load()
        n, pw, sc = len(hashes), self.prefill_weight, self.store_cost
        overlap = self._overlaps(hashes).get
        expected_of = self._expected
        best: tuple[float, int, str, int, int] | None = None
        for w, cache in self._cached.items():
            cached = overlap(w, 0)
            if now is not None and cached < n:
                expected = expected_of[w]
                if expected and expected.get(hashes[cached], now) > now:
                    while cached < n and (
                        hashes[cached] in cache or expected.get(hashes[cached], now) > now
                    ):
                        cached += 1
            stored = memo.get(cached)
            if stored is None:  # the same for every worker with this much cached
                stored = memo[cached] = self._stored_after(hashes, cached)
            load = loads.get(w, none)
            pb, db = load.prefill_blocks, load.decode_blocks
            cost = pw * (pb + ((n - cached - stored) + sc * stored)) + db
            if best is None or cost <= best[0]:
                key = (cost, pb + db, w, cached, stored)
                if best is None or key < best:
                    best = key
        assert best is not None
        cost, _, worker, cached, from_store = best
        return Choice(worker, cached, from_store, cost)

    def _overlaps(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """How many of ``hashes``, from the first, each generator holding at least one of
        them has cached: the masks of the generators holding each block, intersected in
        turn."""
        holders, n = self._holders, len(hashes)
        alive = holders.get(hashes[0], 0) if n else 0
        out: dict[str, int] = {}
        i = 1
        while alive:
            held = alive & holders.get(hashes[i], 0) if i < n else 0
            gone = alive & ~held
            while gone:  # those whose prefix ends at block i
                low = gone & -gone
                out[self._slots[low.bit_length() - 1]] = i  # type: ignore[index]
                gone ^= low
            alive, i = held, i + 1
        return out

    def _price(
        self,
        worker: str,
        hashes: Sequence[bytes],
        load: Load,
        now: float | None,
        memo: dict[int, int],
        cached: int,
    ) -> tuple[float, int, int]:
        """``(cost, cached blocks, store blocks)`` of ``hashes`` on ``worker``, whose cache
        holds the first ``cached`` of them."""
        cache = self._cached[worker]
        if now is not None and cached < len(hashes) and self._expected[worker]:
            expected = self._expected[worker]
            while cached < len(hashes) and (
                hashes[cached] in cache or expected.get(hashes[cached], now) > now
            ):
                cached += 1
        stored = memo.get(cached)
        if stored is None:  # the same for every worker with this much cached
            stored = memo[cached] = self._stored_after(hashes, cached)
        new = (len(hashes) - cached - stored) + self.store_cost * stored
        cost = self.prefill_weight * (load.prefill_blocks + new) + load.decode_blocks
        return cost, cached, stored

    def _stored_after(self, hashes: Sequence[bytes], start: int) -> int:
        """How many of ``hashes`` from ``start`` on the KV store holds, in a row."""
        stored = 0
        tiers = self._store.values()
        for h in hashes[start:]:
            if not any(h in tier for tier in tiers):
                break
            stored += 1
        return stored


def _prefix(cache: set[bytes], hashes: Sequence[bytes]) -> int:
    n = 0
    for h in hashes:
        if h not in cache:
            break
        n += 1
    return n


def _follow(
    cache: set[bytes],
    events: Iterable[Any],
    holders: dict[bytes, int] | None = None,
    bit: int = 0,
) -> None:
    """Apply a generator pool's or the store's stored/removed/cleared events, in order (and
    to the ``holders`` index under ``bit``, for a generator's)."""
    for event in events:
        if isinstance(event, (BlockStored, Stored)):
            if holders is not None:
                for h in event.block_hashes:
                    if h not in cache:
                        holders[h] = holders.get(h, 0) | bit
            cache.update(event.block_hashes)
        elif isinstance(event, (BlockRemoved, Removed)):
            if holders is not None:
                _drop(holders, bit, {h for h in event.block_hashes if h in cache})
            cache.difference_update(event.block_hashes)
        elif isinstance(event, (AllBlocksCleared, Cleared)):
            if holders is not None:
                _drop(holders, bit, cache)
            cache.clear()
        else:
            raise TypeError(f"not a block event: {event!r:.80}")


def _drop(holders: dict[bytes, int], bit: int, hashes: Iterable[bytes]) -> None:
    """Take ``bit`` off the holders of ``hashes`` (each held under it)."""
    for h in hashes:
        mask = holders[h] & ~bit
        if mask:
            holders[h] = mask
        else:
            del holders[h]


def prompt_hashes(
    prompt: Sequence[int], size: int, extra: Sequence[Any], cache_salt: str | None = None
) -> list[bytes]:
    """The chained hashes of ``prompt``'s full blocks of ``size`` tokens under ``extra``
    keys, as an engine keys them (the last token is always computed, so a block holding it
    has none; the last extra key is a request's ``cache_salt``); ``[]`` for ``size`` 0 (no
    prefix cache)."""
    if size <= 0:
        return []
    if cache_salt is not None and extra:
        extra = [*extra[:-1], cache_salt]
    return list(chain_hashes(None, prompt, size, extra, range((len(prompt) - 1) // size)))
