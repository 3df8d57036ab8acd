"""Incremental detokenizing and stop strings (``orchestr.roles._common._text``): the pieces
add up to the whole text's decode, with a real checkpoint's tokenizer; a stop string is
found where a search of the whole text finds it; and a token's cost does not grow with the
output's length."""

from __future__ import annotations

import itertools
import pathlib
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestr.roles import models
from orchestr.roles._common._text import IncrementalText, StopFinder


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> models.Tokenizer:
    folder = pathlib.Path(models.make_tiny("llama", tmp_path_factory.mktemp("t") / "llama"))
    return models.Tokenizer(folder)


WORDS = ["hello", " world", "é", "🙂", " the", "\n", "ü", "  ", "END", "x", "日本", "!"]


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=30), step=st.integers(1, 4))
def test_pieces_add_up_to_the_whole_decode(
    tokenizer: models.Tokenizer, words: list[str], step: int
) -> None:
    tokens = tokenizer.encode("".join(words))
    text = IncrementalText(tokenizer.decode)
    pieces = [text.push(tokens[i : i + step]) for i in range(0, len(tokens), step)]
    pieces.append(text.flush())
    assert "".join(pieces) == tokenizer.decode(tokens) == text.text
    assert all("\ufffd" not in p for p in pieces[:-1])  # incomplete characters wait


def test_a_character_split_over_tokens_waits_until_it_is_whole() -> None:
    text = IncrementalText(lambda tokens: bytes(tokens).decode(errors="replace"))
    assert [text.push([97]), text.push([0xC3]), text.push([0xA9])] == ["a", "", "é"]
    assert text.push([0xF0, 0x9F]) == "" and text.flush() == "\ufffd"


def _byte_fallback(vocab: dict[int, str]) -> Callable[[list[int]], str]:
    """A decoder as byte fallback works (Llama 2, Mistral): a run of byte tokens decodes as
    one group, to its text when the group is valid UTF-8, else to one U+FFFD per byte."""

    def decode(tokens: list[int]) -> str:
        out, run = [], bytearray()
        for t in [*tokens, -1]:
            if 0 <= t < 256:
                run.append(t)
                continue
            if run:
                try:
                    out.append(run.decode())
                except UnicodeDecodeError:
                    out.append("\ufffd" * len(run))
                run.clear()
            if t >= 0:
                out.append(vocab[t])
        return "".join(out).removeprefix(" ")  # a text's leading space is stripped

    return decode


def test_byte_runs_cut_mid_character_never_decode_to_replacements() -> None:
    vocab = {256: " Hi", 257: " the", 258: " end"}
    decode = _byte_fallback(vocab)
    tokens = [256, *"漢字語".encode(), 257, *"é🙂".encode(), 258]
    for step in (1, 2, 3):
        text = IncrementalText(decode)
        pieces = [text.push(tokens[i : i + step]) for i in range(0, len(tokens), step)]
        pieces.append(text.flush())
        assert "".join(pieces) == decode(tokens) == "Hi漢字語 theé🙂 end", (step, pieces)


def test_tokens_of_no_text_do_not_grow_the_window() -> None:
    calls: list[int] = []

    def decode(tokens: list[int]) -> str:
        calls.append(len(tokens))
        return "".join("" if t == 0 else chr(96 + t) for t in tokens)

    text = IncrementalText(decode)
    assert [text.push([0]) for _ in range(1000)] == [""] * 1000
    assert text.push([1]) == "a" and max(calls) <= 2


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abcEND", max_size=60),
    stops=st.lists(st.text(alphabet="abcEND", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 60), max_size=8),
)
def test_a_stop_string_is_found_where_the_whole_text_has_it_first(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    finder = StopFinder(stops)
    hit = None
    fed = 0
    for a, b in itertools.pairwise(bounds):
        hit = finder.feed(text[a:b])
        fed = b
        if hit is not None:
            break
    # the first place any stop string ends, and of those found there, the earliest start
    ends = [(text.find(s) + len(s), s) for s in stops if s in text]
    if not ends:
        assert hit is None
        return
    assert hit is not None
    at, stop = hit
    assert text[at : at + len(stop)] == stop and at + len(stop) <= fed
    assert fed == min(b for b in bounds if b >= min(e for e, _ in ends))  # no later than that
    assert stop not in text[: at + len(stop) - 1]  # not found in what was fed before


def test_a_token_costs_the_same_at_any_length() -> None:
    calls: list[int] = []

    def decode(tokens: list[int]) -> str:
        calls.append(len(tokens))
        return "".join(chr(97 + t % 26) for t in tokens)

    text = IncrementalText(decode)
    finder = StopFinder(["zzzz"])
    for t in range(5000):
        assert finder.feed(text.push([t % 25])) is None
    assert max(calls) <= 5  # the window, never the whole output
