"""A sequence's text as its tokens arrive, decoded incrementally (:class:`IncrementalText`),
and stop strings looked for in it as it grows (:class:`StopFinder`). Sans-IO: both take the
tokenizer's ``decode`` and nothing else.

Decoding a whole output after every token costs the square of its length; decoding only the
new token loses what depends on its neighbours (a leading space a tokenizer strips at the
start of a text, a character whose bytes span tokens). :class:`IncrementalText` decodes a
short window instead: the tokens since the last text it gave out plus a few before them as
context, and gives out what the window's text has beyond the context's. The context is the
tokens given out at the last push, so the window always starts where a character did (a
tokenizer that decodes a run of byte tokens as one group, as byte fallback does, would decode
a run cut mid-character to replacement characters). Text that ends in an incomplete
character (U+FFFD) is held back until the character completes. Each token costs a decode of
a few tokens, whatever the output's length.

:class:`StopFinder` looks for stop strings in the new text plus the last ``longest - 1``
characters before it (a stop string found now ends in the new text), so each token costs
time in the longest stop string's length, not the output's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["IncrementalText", "StopFinder"]

Decode = Callable[[list[int]], str]


class IncrementalText:
    """The text of the tokens :meth:`push`-ed so far, one piece per push."""

    __slots__ = ("_decode", "_pieces", "_prefix", "_read", "_tokens", "length")

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._tokens: list[int] = []
        self._prefix = 0  # the window's first token: context starts here
        self._read = 0  # tokens before this one are given out as text
        self._pieces: list[str] = []
        self.length = 0  # characters given out

    def push(self, tokens: Sequence[int]) -> str:
        """Add ``tokens``; returns the text they complete (``""`` while a character is
        incomplete)."""
        self._tokens.extend(tokens)
        before = self._decode(self._tokens[self._prefix : self._read])
        window = self._decode(self._tokens[self._prefix :])
        if window.endswith("\ufffd") or len(window) < len(before):
            return ""
        if window == before:  # tokens of no text (special ones skipped): context from now
            self._prefix, self._read = self._read, len(self._tokens)
            return ""
        new = window[len(before) :]
        self._prefix, self._read = self._read, len(self._tokens)
        if new:
            self._pieces.append(new)
            self.length += len(new)
        return new

    def flush(self) -> str:
        """The text held back (an incomplete character at the end, as U+FFFD): the end of
        the sequence."""
        before = self._decode(self._tokens[self._prefix : self._read])
        new = self._decode(self._tokens[self._prefix :])[len(before) :]
        self._prefix, self._read = self._read, len(self._tokens)
        if new:
            self._pieces.append(new)
            self.length += len(new)
        return new

    @property
    def text(self) -> str:
        """Everything given out so far."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""


class StopFinder:
    """Finds the first of ``stops`` (non-empty strings) in a text fed piece by piece."""

    __slots__ = ("_keep", "_seen", "_tail", "stops")

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self._keep = max(map(len, self.stops), default=1) - 1
        self._tail = ""  # the last _keep characters fed
        self._seen = 0  # characters fed

    def feed(self, new: str) -> tuple[int, str] | None:
        """Add ``new``; returns where the first stop string found starts (in characters of
        the whole text fed) and which it is, else ``None``. A stop string is found once all of
        it was fed; of two, the one that starts first (then the longer) wins."""
        if not new:
            return None
        window = self._tail + new
        start = self._seen - len(self._tail)
        found = [(i, -len(s), s) for s in self.stops if (i := window.find(s)) >= 0]
        self._seen += len(new)
        self._tail = window[-self._keep :] if self._keep else ""
        if not found:
            return None
        i, _, stop = min(found)
        return start + i, stop
