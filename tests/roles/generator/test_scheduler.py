"""The paged KV cache's block pool and the scheduler over it, sans-IO: prefix hits, chunked
prefill, preemption, admission control, and a property test that every block comes back."""

from __future__ import annotations

import hashlib
import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestr.roles.generator._core._blocks import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    chain_hashes,
    hash_block,
)
from orchestr.roles.generator._core._scheduler import Scheduler, Seq, Step


def run(sched: Scheduler, rng: random.Random, steps: int = 10_000) -> list[Step]:
    """Drive ``sched`` with random sampled tokens until nothing is left; the steps taken."""
    done: list[Step] = []
    for _ in range(steps):
        if not sched.running and not sched.waiting:
            return done
        step = sched.schedule()
        assert step.scheduled, "a step with work left scheduled nothing"
        assert step.num_tokens <= sched.token_budget
        sampled = {s.id: rng.randrange(50) for s, n in step.scheduled if step.samples(s, n)}
        sched.update(step, sampled)
        check_blocks(sched)
        done.append(step)
    raise AssertionError("the scheduler did not drain")


def check_blocks(sched: Scheduler) -> None:
    pool = sched.pool
    held = [b for s in sched.running for b in s.blocks]
    for b in range(pool.num_blocks):
        assert pool.refs[b] == held.count(b)
    assert pool.num_free == sum(1 for r in pool.refs if r == 0)
    for s in sched.running:
        assert len(s.blocks) >= sched.blocks_for(s.num_computed)
    for s in sched.waiting:
        assert not s.blocks and s.num_computed == 0


def test_a_shared_prefix_is_computed_once_and_hits_count_whole_blocks() -> None:
    pool = BlockPool(64, 4)
    sched = Scheduler(pool, max_batch=8, token_budget=64, extra_keys=("m", 0))
    prefix = list(range(10))  # two full blocks and two tokens
    first = Seq("a", [*prefix, 90], 3)
    sched.add(first)
    run(sched, random.Random(0))
    assert (first.cached_tokens, sched.hits, sched.queries) == (0, 0, 11)
    second = Seq("b", [*prefix, 91, 92], 2)
    sched.add(second)
    step = sched.schedule()
    assert second.cached_tokens == 8  # the third block differs; a part-block is a miss
    assert step.scheduled == [(second, 4)] and (sched.hits, sched.queries) == (8, 23)
    # a prompt that is all cached still computes its last token
    same = Seq("c", prefix[:8], 2)
    sched.add(same)
    assert sched.schedule().scheduled[-1] == (same, 4) and same.cached_tokens == 4
    # another salt, or other weights, never share blocks
    salted = Seq("d", [*prefix, 90], 2, cache_salt="tenant-2")
    sched.add(salted)
    sched.schedule()
    assert salted.cached_tokens == 0
    other = Scheduler(pool, max_batch=8, token_budget=64, extra_keys=("m", 1))
    newer = Seq("e", [*prefix, 90], 2)
    other.add(newer)
    other.schedule()
    assert newer.cached_tokens == 0


def test_events_name_the_blocks_their_parents_and_tokens() -> None:
    pool = BlockPool(4, 2)
    sched = Scheduler(pool, max_batch=4, token_budget=16)
    seq = Seq("a", [1, 2, 3, 4, 5], 1)
    sched.add(seq)
    run(sched, random.Random(1))
    (stored,) = pool.take_events()
    k1 = hash_block(None, [1, 2], [None])
    k2 = hash_block(k1, [3, 4], [None])
    assert stored == BlockStored([k1, k2], None, [1, 2, 3, 4], 2)
    # new work takes the free blocks: the cached ones go, the tail of the sequence first
    sched.add(Seq("b", [7, 8, 9, 7, 8, 9, 7], 1))
    sched.schedule()
    removed = [e for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert [k for e in removed for k in e.block_hashes] == [k2, k1]
    assert not pool.clear_cache()  # blocks in use
    sched.finish(sched.running[0], "cancelled")
    assert pool.clear_cache() and pool.take_events() == [AllBlocksCleared()]
    assert pool.cached == {}


@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=70),
    extra=st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1), st.text(), st.binary())),
    size=st.integers(1, 9),
)
def test_hashes_in_a_chain_are_hash_blocks_one_after_the_other(
    tokens: list[int], extra: list[object], size: int
) -> None:
    full = len(tokens) // size
    want: list[bytes] = []
    parent: bytes | None = None
    for b in range(full):
        parent = hash_block(parent, tokens[b * size : (b + 1) * size], extra)
        # the key's definition: SHA-256 of the msgpack array [parent, tokens, extra]
        payload = [want[-1] if want else None, tokens[b * size : (b + 1) * size], extra]
        assert parent == hashlib.sha256(msgpack.packb(payload, use_bin_type=True)).digest()
        want.append(parent)
    assert list(chain_hashes(None, tokens, size, extra, range(full))) == want
    assert list(chain_hashes(None, tuple(tokens), size, tuple(extra), range(full))) == want
    if full > 1:  # from a block in the middle, chained on the one before
        assert list(chain_hashes(want[0], tokens, size, extra, range(1, full))) == want[1:]


def test_keys_a_router_made_are_used_while_they_are_the_schedulers_own() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7]

    def stored(known: tuple[tuple[object, ...], list[bytes]] | None) -> list[bytes]:
        pool = BlockPool(8, 2)
        sched = Scheduler(pool, max_batch=4, token_budget=16, extra_keys=("m", 2))
        sched.add(Seq("a", prompt, 1, known_keys=known))
        run(sched, random.Random(0))
        return [k for e in pool.take_events() if isinstance(e, BlockStored) for k in e.block_hashes]

    sched = Scheduler(BlockPool(8, 2), max_batch=4, token_budget=16, extra_keys=("m", 2))
    extra, keys = sched.keyed(prompt)
    assert (extra, keys) == (("m", 2, None), sched.prompt_keys(prompt)) and len(keys) == 3
    made = stored(None)
    assert made[:3] == keys and stored((extra, keys)) == made
    # known keys are taken as given while their extra keys are the scheduler's (a wrong one
    # shows), and ignored once those differ (new weights): the keys are made again
    wrong = [b"x" * 32, *keys[1:]]
    assert stored((extra, wrong))[0] == b"x" * 32
    assert stored((("m", 1, None), wrong)) == made


def test_chunked_prefill_shares_the_budget_with_running_decodes() -> None:
    sched = Scheduler(BlockPool(64, 4), max_batch=4, token_budget=8)
    short = Seq("short", [1, 2], 20)
    sched.add(short)
    sched.update(sched.schedule(), {"short": 5})
    sched.add(Seq("long", list(range(30)), 2))
    chunks = []
    while len(short.output) < 5:
        step = sched.schedule()
        assert step.scheduled[0] == (short, 1)  # the decode goes first, every step
        chunks.append(step.scheduled[1][1])
        sched.update(step, {s.id: 7 for s, n in step.scheduled if step.samples(s, n)})
    assert chunks == [7, 7, 7, 7]


def test_preemption_recomputes_the_last_admitted_and_admission_refuses_the_impossible() -> None:
    pool = BlockPool(6, 2)
    sched = Scheduler(pool, max_batch=4, token_budget=32)
    with pytest.raises(ValueError, match=r"can never fit: 6 prompt tokens .* need 7 blocks"):
        sched.add(Seq("big", list(range(6)), 8))
    a, b = Seq("a", [1, 2, 3], 6), Seq("b", [4, 5, 6], 6)
    sched.add(a)
    sched.add(b)
    steps = run(sched, random.Random(2))
    assert sched.preemptions >= 1 and b.preemptions >= 1 and a.preemptions == 0
    assert any(b in s.preempted for s in steps)
    assert len(a.output) == len(b.output) == 6
    assert pool.num_free == pool.num_blocks


def test_cancel_frees_at_once_and_stop_tokens_finish() -> None:
    pool = BlockPool(16, 4)
    sched = Scheduler(pool, max_batch=4, token_budget=16)
    a, b = Seq("a", list(range(9)), 10, stop_ids=frozenset({3})), Seq("b", [1], 10)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    sched.finish(b, "cancelled")
    done = sched.update(step, {"a": 3, "b": 1})
    assert done == [a] and a.finish_reason == "stop" and b.output == []
    assert pool.num_free == 16 and not sched.running


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    blocks=st.integers(4, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    budget=st.integers(1, 64),
    max_batch=st.integers(1, 6),
)
def test_every_block_comes_back_whatever_the_workload(
    seed: int, blocks: int, block_size: int, budget: int, max_batch: int
) -> None:
    """Random prompts (some sharing prefixes), limits, stop tokens and cancellations: at
    every step each block's count is its holders', and at the end every block is free."""
    rng = random.Random(seed)
    pool = BlockPool(blocks, block_size)
    sched = Scheduler(pool, max_batch=max_batch, token_budget=budget)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    seqs = []
    for i in range(rng.randint(1, 12)):
        prompt = [*rng.choice(prefixes)[: rng.randint(1, 12)], rng.randrange(50)]
        seq = Seq(str(i), prompt, rng.randint(1, 10), stop_ids=frozenset({rng.randrange(50)}))
        try:
            sched.add(seq)
        except ValueError:
            assert sched.blocks_for(len(prompt) + seq.max_tokens) > blocks
            continue
        seqs.append(seq)
    for _ in range(10_000):
        if not sched.running and not sched.waiting:
            break
        if rng.random() < 0.05:
            live = [s for s in seqs if s.status != "finished"]
            sched.finish(rng.choice(live), "cancelled")
            check_blocks(sched)
            continue
        step = sched.schedule()
        assert step.scheduled and step.num_tokens <= budget
        sampled = {s.id: rng.randrange(50) for s, n in step.scheduled if step.samples(s, n)}
        sched.update(step, sampled)
        check_blocks(sched)
    assert all(s.status == "finished" for s in seqs)
    assert pool.num_free == blocks and all(r == 0 for r in pool.refs)
    assert sched.hits <= sched.queries
    for s in seqs:
        if s.finish_reason == "length":
            assert len(s.output) == s.max_tokens
        assert s.cached_tokens < s.num_tokens


def test_reserved_blocks_are_entered_or_let_go_and_hold_their_prefix() -> None:
    pool = BlockPool(8, 2)
    sched = Scheduler(pool, max_batch=2, token_budget=16)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    keys = sched.prompt_keys(prompt)  # 4 full blocks before the last token
    sched.add(Seq("a", prompt[:5], 1))  # caches the first 2 blocks
    run(sched, random.Random(0))
    assert sched.cached_run(keys) == 2
    first, prefix, blocks = sched.reserve(keys, 2, 2)
    assert first == 2 and len(prefix) == 2 and len(blocks) == 2
    assert all(pool.refs[b] == 1 for b in prefix + blocks)  # held: nothing evicts them
    with pytest.raises(ValueError):
        pool.allocate(pool.num_free + 1)
    sched.enter_reserved(keys, prompt, first, prefix, blocks, keep=False)
    assert sched.cached_run(keys) == 2 and pool.num_free == 8  # let go: nothing entered
    reserved = sched.reserve(keys, 2, 2)
    sched.enter_reserved(keys, prompt, *reserved, keep=True)
    assert sched.cached_run(keys) == 4 and pool.num_free == 8  # entered, free and cached
    assert sched.reserve(keys, 2, 2) == (4, [], [])  # nothing left to reserve
    assert sched.reserve(keys, 5, 0)[1:] == ([], [])


def state(sched: Scheduler) -> tuple[object, ...]:
    pool = sched.pool
    seqs = [
        (s.id, s.status, s.output, s.num_computed, s.blocks, s.keys, s.finish_reason)
        for s in [*sched.running, *sched.waiting]
    ]
    free = [*range(pool._fresh, pool.num_blocks), *pool._free]
    return seqs, pool.refs, pool.hashes, pool.cached, free, pool.take_events()


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    blocks=st.integers(8, 60),
    block_size=st.sampled_from([1, 2, 4, 16]),
    budget=st.integers(1, 64),
    max_batch=st.integers(1, 6),
    cache_outputs=st.booleans(),
)
def test_a_run_of_decode_steps_in_one_go_leaves_what_the_steps_leave(
    seed: int, blocks: int, block_size: int, budget: int, max_batch: int, cache_outputs: bool
) -> None:
    """Two schedulers, the same requests arriving at the same steps, one sampling token 7
    step by step, the other advancing every run of alike decode steps in one go (up to the
    next arrival): after each run both hold the same blocks, cache, free queue and events,
    and the same sequences finish at the same steps. Prompts share prefixes and samples
    share outputs, so the cache's order matters."""
    rng = random.Random(seed)
    a, b = (
        Scheduler(
            BlockPool(blocks, block_size),
            max_batch=max_batch,
            token_budget=budget,
            cache_outputs=cache_outputs,
        )
        for _ in range(2)
    )
    prefixes = [[rng.randrange(5) for _ in range(rng.randint(1, 12))] for _ in range(2)]
    arrivals: dict[int, list[tuple[str, list[int], int]]] = {}
    for i in range(rng.randint(1, 10)):
        prompt = [*rng.choice(prefixes)[: rng.randint(1, 12)], rng.randrange(3)]
        out = rng.randint(1, 30)
        if -(-(len(prompt) + out) // block_size) <= blocks:
            arrivals.setdefault(rng.randrange(40), []).append((str(i), prompt, out))
    finished: dict[str, list[tuple[int, str]]] = {"a": [], "b": []}
    bulk_runs = 0
    t = 0
    while t < 5_000:
        for rid, prompt, out in arrivals.get(t, []):
            a.add(Seq(rid, list(prompt), out))
            b.add(Seq(rid, list(prompt), out))
        if not a.running and not a.waiting:
            if t > max(arrivals, default=0):
                break
            t += 1
            continue
        later = [s for s in arrivals if s > t]
        k = b.decode_run((min(later) - t) if later else 10_000)
        if k >= 2:
            bulk_runs += 1
            finished["b"] += [(t + k - 1, s.id) for s in b.advance_decodes(k, 7)]
        else:
            k = 1
            step = b.schedule()
            sampled = {s.id: 7 for s, n in step.scheduled if step.samples(s, n)}
            finished["b"] += [(t, s.id) for s in b.update(step, sampled)]
        for j in range(k):
            step = a.schedule()
            sampled = {s.id: 7 for s, n in step.scheduled if step.samples(s, n)}
            finished["a"] += [(t + j, s.id) for s in a.update(step, sampled)]
        t += k
        assert state(a) == state(b)
    assert finished["a"] == finished["b"]
    assert not a.running and not a.waiting
    if bulk_runs:
        check_blocks(b)


def test_a_run_of_decodes_stops_at_an_admission_a_block_shortage_or_an_end() -> None:
    sched = Scheduler(BlockPool(16, 4), max_batch=2, token_budget=64, cache_outputs=False)
    sched.add(Seq("a", [1, 2, 3], 20))
    step = sched.schedule()
    sched.update(step, {"a": 0})
    assert sched.decode_run(100) == 19  # its last token ends it
    sched.add(Seq("b", [4], 5))
    assert sched.decode_run(100) == 0  # the next step admits b
    sched.update(sched.schedule(), {"a": 0, "b": 0})
    # 16 blocks of 4: a (5 tokens computed) and b (1) grow to 13 blocks together at most
    assert sched.decode_run(100) == 4  # b's last token
    assert [s.id for s in sched.advance_decodes(4, 0)] == ["b"]
    with pytest.raises(ValueError, match="not a run"):
        sched.advance_decodes(20, 0)
    tight = Scheduler(BlockPool(6, 4), max_batch=2, token_budget=64)
    tight.add(Seq("c", [1], 20))
    tight.add(Seq("e", [2], 20))
    tight.update(tight.schedule(), {"c": 0, "e": 0})
    # a block each; 4 free: three each hold 12 tokens, so 11 more steps before a preemption
    assert tight.decode_run(100) == 11
    stopping = Scheduler(BlockPool(8, 4), max_batch=2, token_budget=64)
    stopping.add(Seq("d", [1], 5, stop_ids=frozenset({9})))
    stopping.update(stopping.schedule(), {"d": 0})
    with pytest.raises(ValueError, match="stops"):
        stopping.advance_decodes(2, 9)
