"""The KV-aware router, sans-IO: it follows the generators' and the store's block events and
prices each request by its uncached blocks against each generator's load."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestr.roles.generator._core._blocks import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
)
from orchestr.roles.kvstore import Cleared, KVNamespace, Removed, Stored
from orchestr.roles.serving import Load, NoWorkerError, Router

A = [f"a{i}".encode() for i in range(8)]  # one prompt's chain of block hashes
B = [f"b{i}".encode() for i in range(8)]


def router(policy: str = "kv", **kw: float) -> Router:
    r = Router(policy, **kw)
    for name in ("g0", "g1", "g2"):
        r.add(name)
    return r


def test_it_follows_a_real_block_pool_through_its_events() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    r = router()
    blocks = pool.allocate(3)
    pool.commit(blocks, A[:3], None, [1, 2, 3, 4, 5, 6])
    r.apply("g1", pool.take_events())
    assert r.overlap("g1", A) == 3 and r.overlap("g0", A) == 0
    pool.release(blocks)
    pool.allocate(2)  # evicts the two oldest cached blocks: A[0] and A[1]
    r.apply("g1", pool.take_events())
    assert r.overlap("g1", A) == 0 and r.overlap("g1", A[2:]) == 1
    r.apply("g1", [AllBlocksCleared()])
    assert r.overlap("g1", A[2:]) == 0


def test_the_longest_prefix_wins_until_its_load_outweighs_it() -> None:
    r = router()
    r.apply("g1", [BlockStored(A[:6], None, [0] * 12, 2)])
    r.apply("g2", [BlockStored(A[:2], None, [0] * 4, 2)])
    choice = r.choose(A)
    assert (choice.worker, choice.cached_blocks, choice.cost) == ("g1", 6, 2.0)
    # g1 decoding 7 blocks' worth: 2 + 7 = 9 > g0's 8 uncached blocks, g2's 6
    busy = {"g1": Load(decode_blocks=7)}
    assert r.choose(A, busy).worker == "g2"
    # a prompt nobody has cached goes to the least loaded, then by name
    assert r.choose(B, {"g0": Load(1), "g1": Load(0, 1), "g2": Load()}).worker == "g2"
    assert r.choose(B).worker == "g0"
    # prefill waiting counts with prefill_weight
    heavy = Router(prefill_weight=3.0)
    heavy.add("g0")
    heavy.add("g1")
    heavy.apply("g0", [BlockStored(A[:4], None, [0] * 8, 2)])
    assert heavy.choose(A, {"g0": Load(prefill_blocks=3)}).worker == "g0"  # 3*(3+4) < 3*8
    assert heavy.choose(A, {"g0": Load(prefill_blocks=5)}).worker == "g1"  # 3*(5+4) > 3*8


def test_store_hits_count_at_their_onboarding_cost() -> None:
    r = router(store_cost=0.25)
    ns = KVNamespace("m", 2)
    r.apply("g0", [BlockStored(A[:2], None, [0] * 4, 2)])
    r.apply_store([Stored(ns, tuple(A[:6]), "host")])
    c0 = r.choose(A, {"g1": Load(decode_blocks=1), "g2": Load(decode_blocks=1)})
    # g0: 2 cached, 4 from the store at 0.25, 2 to compute: 3.0; the others: 6 * 0.25 + 2 + 1
    assert (c0.worker, c0.cached_blocks, c0.store_blocks, c0.cost) == ("g0", 2, 4, 3.0)
    # a demotion: on disk first, then gone from host memory; still in the store
    r.apply_store([Stored(ns, (A[2],), "disk"), Removed(ns, (A[2],), "host")])
    assert r.choose(A, {"g0": Load()}).store_blocks == 4
    r.apply_store([Cleared("disk")])  # the store's prefix now stops at A[2]
    assert r.choose(A, {"g0": Load()}).store_blocks == 0
    r.apply_store([Stored(ns, (A[2],), "disk")])
    r.forget_store()
    assert r.choose(A, {"g0": Load()}).store_blocks == 0


def test_round_robin_and_least_loaded_ignore_the_caches() -> None:
    rr = router("round_robin")
    rr.apply("g2", [BlockStored(A, None, [0] * 16, 2)])
    assert [rr.choose(A).worker for _ in range(4)] == ["g0", "g1", "g2", "g0"]
    ll = router("least_loaded")
    ll.apply("g2", [BlockStored(A, None, [0] * 16, 2)])
    loads = {"g0": Load(2, 2), "g1": Load(0, 3), "g2": Load(1, 3)}
    assert ll.choose(A, loads).worker == "g1"


def test_a_dead_generator_is_out_at_once_and_comes_back_empty() -> None:
    r = router()
    r.apply("g1", [BlockStored(A, None, [0] * 16, 2)])
    assert r.choose(A).worker == "g1"
    assert r.remove("g1") and not r.remove("g1")
    assert r.choose(A).worker == "g0" and r.workers == ["g0", "g2"]
    assert not r.apply("g1", [BlockRemoved(A[:1])])  # a late event of the dead one: ignored
    r.add("g1")
    assert r.overlap("g1", A) == 0  # a restarted generator's cache starts empty
    for name in r.workers:
        r.remove(name)
    with pytest.raises(NoWorkerError, match="no generator is in rotation"):
        r.choose(A)


def test_bad_settings_and_events_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown router policy 'random'"):
        Router("random")
    with pytest.raises(ValueError, match="store_cost within"):
        Router(store_cost=2.0)
    for weight in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="prefill_weight must be finite and >= 0"):
            Router(prefill_weight=weight)
    r = router()
    with pytest.raises(ValueError, match="in rotation already"):
        r.add("g0")
    with pytest.raises(TypeError, match="not a block event"):
        r.apply("g0", [("stored", A)])


def test_blocks_on_their_way_count_where_they_were_sent_until_confirmed_or_expired() -> None:
    r = router(expect_s=10.0)
    loads = {"g0": Load(0, 5), "g1": Load(0, 5), "g2": Load(0, 0)}
    first = r.choose(A, loads, now=0.0)
    assert first.worker == "g2"  # nothing cached anywhere: the least loaded
    r.expect("g2", A, now=0.0)
    # a second request of the same prefix, before g2 reported the blocks: still g2, even
    # once g2 is the busiest
    busy = {"g0": Load(0, 1), "g1": Load(0, 1), "g2": Load(0, 4)}
    second = r.choose(A[:6] + B[:2], busy, now=1.0)
    assert (second.worker, second.cached_blocks) == ("g2", 6)
    # without a clock, or once expired, expectations do not count
    assert r.choose(A, busy).worker == "g0"
    assert r.choose(A, busy, now=10.5).worker == "g0"
    # confirmed by the generator's events, they count for good (the events rule from then on)
    r.expect("g1", B, now=20.0)
    r.apply("g1", [BlockStored(B[:4], None, [0] * 8, 2)])
    assert r.choose(B, busy, now=100.0).cached_blocks == 4
    r.apply("g1", [BlockRemoved(B[:4])])
    assert r.choose(B, {"g1": Load(0, 0)}, now=21.0).cached_blocks == 0
    # a generator out of rotation takes its expectations with it
    r.expect("g0", A, now=30.0)
    r.remove("g0")
    r.add("g0")
    assert r.choose(A, {"g1": Load(0, 9), "g2": Load(0, 9)}, now=31.0) == r.choose(
        A, {"g1": Load(0, 9), "g2": Load(0, 9)}
    )


def _reference(
    caches: dict[str, set[bytes]],
    expected: dict[str, dict[bytes, float]],
    store: set[bytes],
    hashes: list[bytes],
    loads: dict[str, Load],
    now: float | None,
    store_cost: float,
    prefill_weight: float,
) -> tuple[float, int, str, int, int]:
    """The kv rule as the module docstring states it, every generator priced in turn."""
    keys = []
    for w, cache in caches.items():
        cached = 0
        while cached < len(hashes) and (
            hashes[cached] in cache
            or (now is not None and expected[w].get(hashes[cached], now) > now)
        ):
            cached += 1
        stored = 0
        while cached + stored < len(hashes) and hashes[cached + stored] in store:
            stored += 1
        load = loads.get(w, Load())
        new = (len(hashes) - cached - stored) + store_cost * stored
        cost = prefill_weight * (load.prefill_blocks + new) + load.decode_blocks
        keys.append((cost, load.total, w, cached, stored))
    return min(keys)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_kv_rule_prices_as_if_every_generator_were_priced_in_turn(seed: int) -> None:
    """Random generators come and go, store, evict and clear blocks of a few shared prompts,
    are sent requests (expected blocks) and carry random loads: every choice is the one that
    pricing each generator by its own cache gives."""
    rng = random.Random(seed)
    prompts = [[f"p{p}.{i}".encode() for i in range(12)] for p in range(4)]
    r = Router("kv", store_cost=0.5, prefill_weight=rng.choice([0.5, 1.0, 2.0]), expect_s=5.0)
    caches: dict[str, set[bytes]] = {}
    expected: dict[str, dict[bytes, float]] = {}
    store: set[bytes] = set()
    names = [f"g{i}" for i in range(9)]
    now = 0.0
    for _ in range(150):
        now += rng.random()
        op = rng.random()
        w = rng.choice(names)
        blocks = rng.choice(prompts)[: rng.randint(1, 12)]
        if op < 0.08:  # in or out of rotation
            if w in caches:
                assert r.remove(w)
                del caches[w], expected[w]
            else:
                r.add(w)
                caches[w], expected[w] = set(), {}
        elif w not in caches:
            continue
        elif op < 0.45:
            r.apply(w, [BlockStored(blocks, None, [0] * len(blocks), 1)])
            caches[w].update(blocks)
            for h in blocks:
                expected[w].pop(h, None)
        elif op < 0.6:
            gone = rng.sample(blocks, rng.randint(1, len(blocks)))
            r.apply(w, [BlockRemoved(gone + gone[:1])])  # a hash twice in one event
            caches[w].difference_update(gone)
        elif op < 0.63:
            r.apply(w, [AllBlocksCleared()])
            caches[w].clear()
        elif op < 0.7:
            r.apply_store([Stored(KVNamespace("m", 1), tuple(blocks), "cpu")])
            store.update(blocks)
        elif op < 0.8:
            r.expect(w, blocks, now)
            expected[w].update({h: now + 5.0 for h in blocks if h not in caches[w]})
        elif caches:
            loads = {g: Load(rng.randint(0, 6), rng.randint(0, 6)) for g in caches}
            at = rng.choice([None, now])
            choice = r.choose(blocks, loads, at)
            want = _reference(caches, expected, store, blocks, loads, at, 0.5, r.prefill_weight)
            got = (choice.cost, loads[choice.worker].total, choice.worker)
            assert (*got, choice.cached_blocks, choice.store_blocks) == want
            for g, cache in caches.items():
                assert r.overlap(g, blocks) == next(
                    (i for i, h in enumerate(blocks) if h not in cache), len(blocks)
                )
