"""The streamed requests' outbox (sans-IO): deltas merge while nobody reads, the last delta
carries the completion's end, readers get only their own requests, and unread block events
are bounded by a snapshot."""

from __future__ import annotations

import dataclasses
import math

import torch

from orchestr.roles import Completion, Request
from orchestr.roles.generator._core._blocks import AllBlocksCleared, BlockRemoved, BlockStored
from orchestr.roles.generator._core._outbox import MAX_EVENTS, Outbox
from orchestr.roles.generator._engines._requests import Live


class FakeEngine:
    def __init__(self) -> None:
        self.lives: dict[str, Live] = {}

    def start(self, rid: str, top: int = 0) -> Live:
        request = Request(rid, [1], 8, top_logprobs=top)
        live = Live(request, torch.Generator(), 0.0, frozenset())
        self.lives[rid] = live
        return live

    def live(self, request_id: str) -> Live | None:
        return self.lives.get(request_id)

    def finish(self, rid: str, reason: str = "stop", text: str | None = None) -> Completion:
        live = self.lives.pop(rid)
        live.text = text
        return live.finish(reason, 0, 1.0)


def give(live: Live, token: int, top: dict[int, float] | None = None) -> None:
    live.record(token, -0.5 * token, -0.5 * token, top, 0)


def test_deltas_merge_until_read_and_the_last_one_ends_the_request() -> None:
    engine, box = FakeEngine(), Outbox()
    a = engine.start("a")
    b = engine.start("b", top=1)
    box.add("reader", ["a", "b"])
    give(a, 5)
    give(b, 6, {6: -0.1})
    others, woken = box.collect(engine, [])
    assert others == [] and woken == {"reader"}
    give(a, 7)
    box.collect(engine, [])
    deltas, events = box.take("reader")
    assert events == []
    assert {d.id: (d.tokens, d.logprobs, d.top_logprobs) for d in deltas} == {
        "a": ([5, 7], [-2.5, -3.5], None),
        "b": ([6], [-3.0], [{6: -0.1}]),
    }
    assert box.take("reader") == ([], [])
    # a completes with one more token, never seen running
    give(a, 9)
    done = engine.finish("a", "stop", text="xyz")
    box.collect(engine, [done])
    (delta,) = box.take("reader")[0]
    assert (delta.id, delta.tokens, delta.finish_reason, delta.text) == ("a", [9], "stop", "xyz")
    assert "a" not in box and "b" in box


def test_completions_not_streamed_pass_through_and_readers_are_apart() -> None:
    engine, box = FakeEngine(), Outbox()
    x, y = engine.start("x"), engine.start("y")
    engine.start("plain")
    box.add("one", ["x"])
    box.add("two", ["y"])
    give(x, 1)
    give(y, 2)
    plain = engine.finish("plain", "length")
    others, woken = box.collect(engine, [plain])
    assert others == [plain] and woken == {"one", "two"}
    assert [d.id for d in box.take("one")[0]] == ["x"]
    assert [d.id for d in box.take("two")[0]] == ["y"]
    # dropping with a reason tells the reader; without, forgets what it was owed
    give(x, 3)
    box.collect(engine, [])
    assert box.drop("x", "dropped") == "one"
    (delta,) = box.take("one")[0]
    assert delta.tokens == [3] and delta.finish_reason == "dropped"
    give(y, 4)
    box.collect(engine, [])
    assert box.drop("y") == "two" and box.take("two") == ([], [])
    assert box.drop("y") is None
    # a reader removed names its requests still running, to cancel
    engine.start("z")
    box.add("one", ["z"])
    assert box.remove_reader("one") == ["z"] and "z" not in box
    assert box.readers == ["two"]


def test_block_events_reach_every_reader_and_stay_bounded() -> None:
    box = Outbox()
    assert box.events([BlockStored([b"h0"], None, [1, 2], 2)], list) == set()  # nobody yet
    box.add_reader("r1")
    box.add_reader("r2")
    events = [BlockStored([b"h1"], None, [1, 2], 2), BlockRemoved([b"h1"]), AllBlocksCleared()]
    assert box.events(events, list) == {"r1", "r2"}
    assert box.take("r1")[1] == [("stored", [b"h1"]), ("removed", [b"h1"]), ("cleared", [])]
    for i in range(MAX_EVENTS):
        box.events([BlockStored([i.to_bytes(4, "big")], None, [1, 2], 2)], lambda: [b"now"])
    assert box.take("r1")[1] == [("stored", [i.to_bytes(4, "big")]) for i in range(MAX_EVENTS)]
    box.events([BlockRemoved([b"x"])], lambda: [b"now"])
    # r2 went past MAX_EVENTS unread at event MAX_EVENTS - 3 (it had three before): from
    # there on it has the snapshot, then what came after
    after = [("stored", [i.to_bytes(4, "big")]) for i in range(MAX_EVENTS - 2, MAX_EVENTS)]
    assert box.take("r2")[1] == [("cleared", []), ("stored", [b"now"]), *after, ("removed", [b"x"])]


def test_a_completion_field_the_outbox_drops_is_only_the_prompt() -> None:
    """What a finished streamed request's last delta carries is what a front door needs of
    its :class:`Completion` (the tokens, log-probs and how it ended)."""
    names = {f.name for f in dataclasses.fields(Completion)}
    carried = {"tokens", "logprobs", "top_logprobs", "finish_reason", "text", "stop_reason"}
    assert carried <= names
    engine, box = FakeEngine(), Outbox()
    live = engine.start("a")
    box.add("r", ["a"])
    give(live, 4)
    done = engine.finish("a", "length")
    assert math.isnan(done.ttft_s)
    box.collect(engine, [done])
    (delta,) = box.take("r")[0]
    assert (delta.tokens, delta.logprobs, delta.finish_reason) == ([4], [-2.0], "length")
