"""The KV store's sans-IO block index: puts, leases, pins, tiers and events, on a clock the
tests move by hand, and a property test over random sequences of all of them."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestr.roles.kvstore import (
    BlockIndex,
    Cleared,
    KVNamespace,
    KVStoreError,
    LeaseExpiredError,
    Removed,
    Stored,
    Tier,
)

NS = KVNamespace("tiny-llama", block_size=16, weight_version=3)


def chain(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def index(host: int = 4, disk: int | None = None, **kw: float) -> BlockIndex:
    tiers = [Tier("host", host)] + ([Tier("disk", disk)] if disk else [])
    return BlockIndex(tiers, **kw)


def stored(idx: BlockIndex, hashes: list[bytes], now: float = 0.0) -> None:
    put = idx.begin_put(NS, hashes, now)
    idx.end_put(put.id, now)


def test_a_put_is_visible_only_once_ended_and_is_counted_in_tokens() -> None:
    idx = index(host=8)
    put = idx.begin_put(NS, chain("a", "b", "c"), 0.0)
    assert [w.slot for w in put.writes] == [0, 1, 2] and put.skipped == put.dropped == 0
    assert idx.match(NS, chain("a", "b"), 0.0).tokens == 0  # not yet
    assert idx.begin_put(NS, chain("a", "b", "d"), 0.0).skipped == 2  # being written
    assert idx.end_put(put.id, 1.0) == 3
    m = idx.match(NS, chain("a", "b", "x", "c"), 1.0)
    assert m.tokens == 32 and m.by_tier == {"host": 32}  # the prefix stops at "x"
    assert idx.match(KVNamespace("tiny-llama", 16, weight_version=4), chain("a"), 1.0).tokens == 0
    assert idx.match(KVNamespace("tiny-llama", 16, 3, salt="s"), chain("a"), 1.0).tokens == 0
    stats = idx.stats(1.0)
    assert (stats["query_tokens"], stats["hit_tokens"]) == (32 + 64 + 16 + 16, 32)
    page = idx.events()
    assert [e for _, e in page.events] == [Stored(NS, tuple(chain("a", "b", "c")), "host")]
    with pytest.raises(KVStoreError, match="is not open"):
        idx.end_put(put.id, 1.0)


def test_a_writer_that_never_ends_its_put_leaves_nothing_and_its_space_comes_back() -> None:
    idx = index(host=2, put_timeout_s=30.0)
    zombie = idx.begin_put(NS, chain("a", "b"), 0.0)
    blocked = idx.begin_put(NS, chain("c"), 1.0)
    assert blocked.writes == () and blocked.dropped == 1  # reserved slots are not evictable
    idx.maintain(29.0)
    assert idx.stats(29.0)["open_puts"] == 2
    idx.maintain(30.0)
    assert idx.stats(30.0)["expired_puts"] == 1 and idx.stats(30.0)["tiers"]["host"]["used"] == 0
    with pytest.raises(KVStoreError, match="not ended within 30.0 s"):
        idx.end_put(zombie.id, 31.0)
    assert idx.match(NS, chain("a"), 31.0).tokens == 0 and idx.events().events == ()
    again = idx.begin_put(NS, chain("a", "b"), 31.0)
    assert len(again.writes) == 2 and idx.abort_put(again.id) and not idx.abort_put(again.id)


def test_puts_evict_least_recently_used_blocks_but_never_leased_or_hard_pinned_ones() -> None:
    idx = index(host=3)
    stored(idx, chain("a", "b", "c"))
    idx.match(NS, chain("a"), 1.0)  # a is now the most recent
    lease = idx.lease(NS, chain("a"), 1.0, ttl=10.0)
    assert idx.pin(NS, chain("b"), 1.0, hard=True) == 1
    put = idx.begin_put(NS, chain("d", "e"), 2.0)
    assert [w.block_hash for w in put.writes] == [b"d"] and put.dropped == 1  # only c could go
    idx.end_put(put.id, 2.0)
    assert idx.stats(2.0)["evicted_host"] == 1
    assert idx.match(NS, chain("c"), 2.0).tokens == 0
    assert idx.remove(NS, chain("a", "b", "zz"), 2.0) == (1, 1)  # b goes (pins yield), a stays
    idx.check_lease(lease.id, 10.9)
    with pytest.raises(LeaseExpiredError, match="discard it"):
        idx.check_lease(lease.id, 11.0)
    assert idx.remove(NS, chain("a"), 11.0) == (1, 0)  # the lease ran out
    assert idx.release(lease.id) and not idx.release(lease.id)


def test_soft_pins_go_last_and_run_out() -> None:
    idx = index(host=2)
    stored(idx, chain("a", "b"))
    idx.pin(NS, chain("a"), 0.0, ttl=5.0)
    idx.match(NS, chain("b"), 1.0)  # b most recent; a still goes last: it is pinned
    assert idx.stats(1.0)["pinned"] == {"soft": 1, "hard": 0}
    stored(idx, chain("c"), 2.0)
    assert (
        idx.match(NS, chain("a"), 2.0).tokens == 16 and idx.match(NS, chain("b"), 2.0).tokens == 0
    )
    idx.lease(NS, chain("c"), 2.5)
    stored(idx, chain("d"), 3.0)  # the only unpinned block is leased: the soft pin yields
    assert idx.match(NS, chain("a"), 3.0).tokens == 0
    stored(idx, chain("e"), 4.0)
    idx.pin(NS, chain("e"), 4.0, ttl=1.0)
    idx.maintain(5.0)
    assert idx.stats(5.0)["pinned"]["soft"] == 0
    with pytest.raises(ValueError, match="hard pin lasts until unpinned"):
        idx.pin(NS, chain("e"), 5.0, hard=True, ttl=3.0)
    assert idx.unpin(NS, chain("e", "nope")) == 0


def test_demotion_at_the_high_watermark_and_promotion_on_a_lease() -> None:
    idx = index(host=10, disk=10, high_watermark=0.8, low_watermark=0.5)
    names = [f"b{i}" for i in range(9)]
    stored(idx, chain(*names))
    moves = idx.maintain(1.0)  # 9 of 10 used: down to 5, oldest first
    assert [m.block_hash for m in moves] == chain(*names[:4])
    assert all((m.source.tier, m.target.tier) == ("host", "disk") for m in moves)
    assert idx.maintain(1.0) == []  # the sources stay until the copies are reported
    for m in moves[:3]:
        idx.moved(m.id, 2.0)
    idx.moved(moves[3].id, 2.0, ok=False)
    with pytest.raises(KVStoreError, match="not in flight"):
        idx.moved(moves[3].id, 2.0)
    tiers = idx.stats(2.0)["tiers"]
    assert (tiers["host"]["used"], tiers["disk"]["used"]) == (6, 3)
    found = idx.match(NS, chain(*names), 2.0)
    assert found.tokens == 9 * 16 and found.by_tier == {"host": 6 * 16, "disk": 3 * 16}
    lease = idx.lease(NS, chain(*names[:2]), 3.0)
    assert [(b.block_hash, b.tier) for b in lease.blocks] == [(b"b0", "host"), (b"b1", "host")]
    assert [mv.source.tier for mv in lease.moves] == ["disk", "disk"]
    for mv in lease.moves:
        idx.moved(mv.id, 3.0)
    assert idx.match(NS, chain("b0"), 3.0).by_tier == {"host": 16, "disk": 16}  # both kept
    idx.release(lease.id)
    events = [e for _, e in idx.events().events]
    assert Removed(NS, (b"b0",), "host") in events and Stored(NS, (b"b0",), "disk") in events
    assert events[-1] == Stored(NS, (b"b1",), "host")


def test_clear_keeps_leased_blocks_and_reports_emptied_tiers() -> None:
    idx = index(host=4)
    stored(idx, chain("a", "b"))
    other = KVNamespace("other", 16)
    stored_other = idx.begin_put(other, chain("a"), 0.0)
    idx.end_put(stored_other.id, 0.0)
    assert idx.clear(1.0, namespace=other) == 0
    lease = idx.lease(NS, chain("a"), 1.0)
    assert idx.clear(1.0) == 1  # a is leased
    idx.release(lease.id)
    assert idx.clear(2.0) == 0
    tail = [e for _, e in idx.events().events][-3:]
    assert tail == [Removed(other, (b"a",), "host"), Removed(NS, (b"b",), "host"), Cleared("host")]


def test_events_replay_and_say_when_some_were_lost() -> None:
    idx = index(host=64, max_events=3)
    for i in range(5):
        stored(idx, chain(f"k{i}"))
    page = idx.events(after=0)
    assert page.lost and [s for s, _ in page.events] == [3, 4, 5] and page.last == 5
    assert not idx.events(after=2).lost and idx.events(after=5).events == ()
    seq, tiers = idx.snapshot()
    assert seq == 5 and [k[1] for k in tiers["host"]] == chain("k0", "k1", "k2", "k3", "k4")


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="distinct names"):
        BlockIndex([Tier("host", 1), Tier("host", 2)])
    with pytest.raises(ValueError, match="watermarks"):
        index(high_watermark=0.5, low_watermark=0.9)
    with pytest.raises(ValueError, match="at least one block"):
        Tier("host", 0)
    with pytest.raises(ValueError, match="block_size"):
        KVNamespace("m", 0)
    with pytest.raises(ValueError, match="block_size must be an integer, got True"):
        KVNamespace("m", True)
    with pytest.raises(ValueError, match="names its model"):
        KVNamespace(3, 16)
    assert hash(KVNamespace("m", 16, 1)) == hash(KVNamespace("m", 16, 1))
    idx = index()
    with pytest.raises(TypeError, match="KVNamespace"):
        idx.match("m", chain("a"), 0.0)
    with pytest.raises(TypeError, match="not one value"):
        idx.begin_put(NS, b"abc", 0.0)
    with pytest.raises(TypeError, match="non-empty bytes"):
        idx.begin_put(NS, [b"a", "b"], 0.0)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="each block once"):
        idx.begin_put(NS, chain("a", "a"), 0.0)
    with pytest.raises(ValueError, match="positive time"):
        idx.lease(NS, chain("a"), 0.0, ttl=0)
    assert idx.stats(0.0)["open_puts"] == 0  # nothing was reserved by the refused calls


# -- a property test over random operations --------------------------------------------------

HASHES = [f"h{i}".encode() for i in range(12)]
SPACES = [NS, KVNamespace("tiny-llama", 16, weight_version=4)]
chains = st.lists(st.sampled_from(HASHES), min_size=1, max_size=5, unique=True)
op = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(SPACES), chains),
    st.tuples(st.just("store"), st.sampled_from(SPACES), chains),
    st.tuples(
        st.just("put"),
        st.sampled_from(SPACES),
        st.lists(st.sampled_from(HASHES), max_size=5, unique=True),
    ),
    st.tuples(st.just("end"), st.integers(0, 7)),
    st.tuples(st.just("abort"), st.integers(0, 7)),
    st.tuples(st.just("lease_lower"), st.integers(0, 7)),
    st.tuples(st.just("lease_moving"), st.integers(0, 7)),
    st.tuples(
        st.just("lease"),
        st.sampled_from(SPACES),
        st.lists(st.sampled_from(HASHES), max_size=4, unique=True),
    ),
    st.tuples(st.just("release"), st.integers(0, 7)),
    st.tuples(st.just("pin"), st.sampled_from(SPACES), st.sampled_from(HASHES), st.booleans()),
    st.tuples(st.just("remove"), st.sampled_from(SPACES), st.sampled_from(HASHES)),
    st.tuples(st.just("maintain"), st.booleans()),
    st.tuples(st.just("moved"), st.integers(0, 7), st.booleans()),
    st.tuples(
        st.just("clear"),
    ),
    st.tuples(st.just("tick"), st.floats(0.1, 20.0)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, min_size=10, max_size=80))
def test_random_operations_keep_the_index_consistent(ops: list[tuple]) -> None:  # type: ignore[type-arg]
    """Whatever the order: no slot holds two things, leased blocks stay readable where their
    lease says until it runs out, and replaying the events rebuilds the snapshot."""
    idx = index(
        host=6, disk=5, high_watermark=0.7, low_watermark=0.4, lease_s=8.0, put_timeout_s=15.0
    )
    now = 0.0
    puts: list[int] = []
    leases: list = []  # type: ignore[type-arg]
    moves: list = []  # type: ignore[type-arg]
    for step in ops:
        kind = step[0]
        if kind == "store":
            idx.end_put(idx.begin_put(step[1], step[2], now).id, now)
        elif kind == "put":
            puts.append(idx.begin_put(step[1], step[2], now).id)
        elif kind == "end" and puts:
            pid = puts.pop(step[1] % len(puts))
            try:
                idx.end_put(pid, now)
            except KVStoreError:
                pass  # timed out meanwhile
        elif kind == "abort" and puts:
            idx.abort_put(puts.pop(step[1] % len(puts)))
        elif kind == "lease":
            lease = idx.lease(step[1], step[2], now)
            leases.append(lease)
            moves.extend(lease.moves)
        elif kind == "lease_lower" and _only_on_disk(idx):
            lower = _only_on_disk(idx)  # a lease of one of these promotes it
            namespace, block_hash = lower[step[1] % len(lower)]
            lease = idx.lease(namespace, [block_hash], now)
            leases.append(lease)
            for move in lease.moves:
                idx.moved(move.id, now)
        elif kind == "lease_moving" and moves:  # a block being demoted (or promoted)
            move = moves[step[1] % len(moves)]
            leases.append(idx.lease(move.namespace, [move.block_hash], now))
            moves.extend(leases[-1].moves)
        elif kind == "release" and leases:
            idx.release(leases.pop(step[1] % len(leases)).id)
        elif kind == "pin":
            idx.pin(step[1], [step[2]], now, hard=step[3])
        elif kind == "remove":
            idx.remove(step[1], [step[2]], now)
        elif kind == "maintain":  # the shell makes the copies at once, or later
            done = idx.maintain(now)
            for move in done if step[1] else ():
                idx.moved(move.id, now)
            moves.extend(() if step[1] else done)
        elif kind == "moved" and moves:
            move = moves.pop(step[1] % len(moves))
            idx.moved(move.id, now, ok=step[2])
            if not step[2]:  # a promotion that failed: the shell releases its lease
                for failed in [x for x in leases if move in x.moves]:
                    idx.release(failed.id)
                    leases.remove(failed)
        elif kind == "clear":
            idx.clear(now)
        elif kind == "tick":
            now += step[1]
        _check(idx, now, leases, moves)


def _only_on_disk(idx: BlockIndex) -> list:  # type: ignore[type-arg]
    tiers = idx.snapshot()[1]
    return [k for k in tiers["disk"] if k not in set(tiers["host"])]


def _check(idx: BlockIndex, now: float, leases: list, moves: list) -> None:  # type: ignore[type-arg]
    seq, snap = idx.snapshot()
    stats = idx.stats(now)
    # every slot is free, a stored copy, a put's reservation or a move's target, exactly once
    for tier in ("host", "disk"):
        t = idx._tiers[idx._by_name[tier]]
        taken = [b.copies[tier] for b in idx._blocks.values() if tier in b.copies]
        taken += [w.slot for put, _ in idx._puts.values() for w in put.writes if w.tier == tier]
        taken += [m.target.slot for m in idx._moves.values() if m.target.tier == tier]
        assert sorted(taken + t.free) == list(range(t.spec.blocks)), tier
        assert stats["tiers"][tier]["blocks"] == len(snap[tier])
    # a held lease's blocks are where it said: in host, or arriving there by its moves
    for lease in leases:
        if lease.expires <= now or lease.id not in idx._leases:
            continue
        pending = {m.id for m in idx._moves.values()}
        for loc, block in (
            (b, idx._blocks.get((lease.namespace, b.block_hash))) for b in lease.blocks
        ):
            assert block is not None, "a leased block was evicted or removed"
            arriving = [
                m for m in lease.moves if m.block_hash == loc.block_hash and m.id in pending
            ]
            assert block.copies.get("host") == loc.slot or arriving
    # the events, replayed from the start, give the snapshot's sets
    page = idx.events()
    assert not page.lost and page.last == seq
    replay: dict[str, set] = collections.defaultdict(set)  # type: ignore[type-arg]
    for _, e in page.events:
        if isinstance(e, Stored):
            replay[e.tier] |= {(e.namespace, h) for h in e.block_hashes}
        elif isinstance(e, Removed):
            assert {(e.namespace, h) for h in e.block_hashes} <= replay[e.tier]
            replay[e.tier] -= {(e.namespace, h) for h in e.block_hashes}
        else:
            replay[e.tier] = set()
    for tier in ("host", "disk"):
        assert replay[tier] == set(snap[tier]), tier
