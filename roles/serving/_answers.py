"""OpenAI's answers, sans-IO: a choice's text shown as its tokens arrive (:class:`ChoiceText`),
the usage, finish reasons and log-probs in the shapes OpenAI's clients parse."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._common._text import IncrementalText

__all__ = ["ChoiceText", "chat_logprobs", "completion_logprobs", "finish_reason", "usage"]


class ChoiceText:
    """One choice's text as its tokens arrive: :meth:`push` gives the text that can be shown
    now. Text is decoded incrementally (:class:`~orchestr.roles._common._text.IncrementalText`:
    a token costs the same at any length), held back while it ends in an incomplete
    character (a multi-byte character split over tokens) and, with stop strings, by the last
    ``len(longest) - 1`` characters (they may begin a stop string); :meth:`finish` takes the
    last tokens and gives the rest, cut before the stop string."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self._text = IncrementalText(decode)
        self._hold = max(map(len, self.stops)) - 1 if self.stops else 0
        self._pending = ""  # decoded, not shown
        self.shown = 0  # characters shown

    def push(self, tokens: Sequence[int]) -> str:
        self._pending += self._text.push(tokens)
        cut = len(self._pending) - self._hold
        if cut <= 0:
            return ""
        new, self._pending = self._pending[:cut], self._pending[cut:]
        self.shown += len(new)
        return new

    def finish(self, tokens: Sequence[int], final: str | None) -> str:
        """The last ``tokens`` given, the text not shown yet; ``final`` is the completion's
        text when a stop string cut it (the last tokens complete the stop string, so they are
        never shown through :meth:`push`)."""
        self._text.push(tokens)
        self._text.flush()
        text = final if final is not None else self._text.text
        new = text[self.shown :]
        self.shown += len(new)
        self._pending = ""
        return new


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish reason for an engine's (``"cancelled"`` and ``"dropped"`` read
    ``"abort"``, as vLLM's do)."""
    if reason in (None, "stop", "length"):
        return reason
    return "abort"


def completion_logprobs(
    token_text: Any,
    tokens: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[dict[int, float]] | None,
    offset: int,
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for ``tokens``, text offsets from
    ``offset``."""
    texts = [token_text(t) for t in tokens]
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": texts,
        "token_logprobs": list(logprobs),
        "top_logprobs": None
        if top is None
        else [{token_text(k): v for k, v in entry.items()} for entry in top],
        "text_offset": offsets,
    }


def chat_logprobs(
    token_text: Any,
    tokens: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[dict[int, float]] | None,
) -> dict[str, Any]:
    """The chat ``logprobs`` object (``{"content": [...]}``) for ``tokens``."""

    def entry(t: int, lp: float) -> dict[str, Any]:
        text = token_text(t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        item = entry(t, lp)
        item["top_logprobs"] = [] if top is None else [entry(k, v) for k, v in top[i].items()]
        content.append(item)
    return {"content": content}
