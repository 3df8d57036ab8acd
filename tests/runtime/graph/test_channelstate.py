"""The channel core under random loss, duplication, reordering and consumer restarts."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestr._graph._channelstate import Item, Receiver, Sender, Staleness
from orchestr.errors import ConfigError


def run_stream(
    n: int, window: int, ordered: bool, seed: int, restarts: int, loss: float, dup: float
) -> tuple[list[int], Sender, Receiver]:
    """Push ``n`` items through a lossy, duplicating, reordering link; restart the consumer
    ``restarts`` times (it keeps only what it saved with its effects). Returns the effects."""
    rng = random.Random(seed)
    sender = Sender(window)
    effects: list[int] = []  # what the consumer's effects recorded, with its saved mark
    saved = -1
    receiver = Receiver(ordered=ordered, committed=saved)
    in_flight: list[Item] = []
    restart_at = sorted(rng.sample(range(1, 4 * n + 1), restarts)) if restarts else []
    produced = 0
    tick = 0
    while produced < n or sender.unacked:
        tick += 1
        assert tick < 200 * n + 1000, "the stream stopped making progress"
        if restart_at and tick >= restart_at[0]:
            restart_at.pop(0)
            receiver = Receiver(ordered=ordered, committed=saved)  # the process died
            in_flight = sender.redeliver()  # what was on the wire is gone; resend
            rng.shuffle(in_flight) if not ordered else None
            continue
        while produced < n and sender.free:
            item = sender.offer(produced)
            assert item is not None
            in_flight.append(item)
            produced += 1
        if not in_flight:
            in_flight = sender.redeliver()  # a timeout: resend what is unacked
            continue
        i = rng.randrange(len(in_flight)) if not ordered else 0
        item = in_flight.pop(i)
        if rng.random() < loss:
            continue
        if rng.random() < dup:
            in_flight.insert(rng.randrange(len(in_flight) + 1), item)
        for ready in receiver.receive(item):
            effects.append(ready.value)  # the effect and the mark are saved together
            mark = receiver.commit(ready.seq)
            saved = mark
            if ordered:
                sender.ack(mark)
            else:
                sender.ack_one(ready.seq)
    return effects, sender, receiver


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    window=st.integers(1, 32),
    ordered=st.booleans(),
    seed=st.integers(0, 2**32),
    restarts=st.integers(0, 3),
)
def test_every_effect_happens_once(
    n: int, window: int, ordered: bool, seed: int, restarts: int
) -> None:
    effects, sender, _ = run_stream(n, window, ordered, seed, restarts, loss=0.1, dup=0.1)
    assert sorted(effects) == list(range(n))  # each item's effect exactly once
    if ordered:
        assert effects == list(range(n))  # and in order on an ordered edge
    assert not sender.unacked


def test_ten_thousand_items_three_restarts() -> None:
    effects, _, _ = run_stream(10_000, 64, True, 7, 3, loss=0.05, dup=0.05)
    assert effects == list(range(10_000))


def test_window_is_backpressure() -> None:
    sender = Sender(2)
    a, b = sender.offer("a"), sender.offer("b")
    assert a is not None and b is not None and sender.offer("c") is None and sender.free == 0
    assert sender.ack(0) == 1 and sender.free == 1
    with pytest.raises(ValueError, match="only 2 were sent"):
        sender.ack(5)
    assert sender.redeliver() == [b]


def test_staleness_drops_or_requeues_and_counts() -> None:
    for policy in ("drop", "requeue"):
        receiver = Receiver(staleness=Staleness(eta=1, policy=policy))
        receiver.set_version(5)
        got = receiver.receive(Item(0, "old", version=3))
        got += receiver.receive(Item(1, "ok", version=4))
        got += receiver.receive(Item(2, "unversioned"))
        assert [i.value for i in got] == ["ok", "unversioned"]
        assert receiver.committed == 0  # the stale one counts as handled: never redelivered
        if policy == "drop":
            assert receiver.dropped == 1 and receiver.take_requeued() == []
        else:
            assert receiver.dropped == 0 and [i.value for i in receiver.take_requeued()] == ["old"]
        assert receiver.receive(Item(0, "old", version=3)) == []  # a redelivery is a duplicate
        assert receiver.duplicates == 1


def test_bad_settings_are_refused() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError):
            Sender(bad)
    with pytest.raises(ConfigError):
        Staleness(eta=-1)
    with pytest.raises(ConfigError):
        Staleness(eta=1, policy="keep")
    receiver = Receiver()
    receiver.commit(0)
    with pytest.raises(ValueError, match="committed already"):
        receiver.commit(0)
