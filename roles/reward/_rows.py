"""The rows ``Reward.score_rows`` takes, checked and made text. No I/O here.

A row is ``{"prompt": str, "completion": str, "completion_ids": [int, ...], "fields": {...}}``:
``completion`` or ``completion_ids`` (decoded with the checkpoint's tokenizer, special tokens
skipped, when there is no ``completion``; text wins when both are given), ``fields`` the
dataset row's other values (none when left out).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._spec import RESERVED

__all__ = ["ROW_KEYS", "parse_rows"]

ROW_KEYS = ("prompt", "completion", "completion_ids", "fields")

Decode = Callable[[list[int]], str]


def _completion(i: int, row: Mapping[str, Any], decode: Decode | None) -> str:
    text = row.get("completion")
    if text is not None:
        if not isinstance(text, str):
            raise ValueError(f"row {i}: 'completion' is text, got {type(text).__name__}")
        return text
    ids = row.get("completion_ids")
    if ids is None:
        raise ValueError(f"row {i} has neither 'completion' nor 'completion_ids'")
    if not isinstance(ids, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
    ):
        raise ValueError(f"row {i}: 'completion_ids' is a list of token ids, got {ids!r:.200}")
    if decode is None:
        raise ValueError(
            f"row {i} has only 'completion_ids': spawn Reward(functions=..., tokenizer=<the "
            f"checkpoint folder>) to decode them, or send 'completion' text"
        )
    return decode(list(ids))


def parse_rows(
    rows: Sequence[Mapping[str, Any]], decode: Decode | None
) -> list[tuple[str, str, dict[str, Any]]]:
    """``(prompt, completion, fields)`` per row, in order. Raises ``ValueError`` naming the
    first malformed row and what is wrong with it."""
    if not isinstance(rows, list | tuple):
        raise ValueError(f"score_rows takes a list of row dicts, got {type(rows).__name__}")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"row {i} is a dict with keys {', '.join(ROW_KEYS)}, got {row!r:.200}")
        unknown = sorted(set(row) - set(ROW_KEYS))
        if unknown:
            raise ValueError(f"row {i}: unknown keys {unknown} (a row has {', '.join(ROW_KEYS)})")
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError(f"row {i}: 'prompt' is text, got {type(prompt).__name__}")
        fields = row.get("fields") or {}
        if not isinstance(fields, Mapping) or not all(isinstance(k, str) for k in fields):
            raise ValueError(
                f"row {i}: 'fields' is a dict keyed by field name, got {fields!r:.200}"
            )
        clash = sorted(RESERVED & set(fields))
        if clash:
            raise ValueError(
                f"row {i}: a field may not be named {clash[0]!r} (the row's own prompt and "
                f"completion take those names)"
            )
        out.append((prompt, _completion(i, row, decode), dict(fields)))
    return out
