"""Where blocks lie in a :class:`~._paged.PagedKV`'s memory, as spans a peer reads one-sided.

The memory is ``planes`` layer planes of ``plane_bytes`` each (every layer's keys, then every
layer's values); a block is ``row_bytes`` of each plane, at ``block * row_bytes``. A copy of
``count`` blocks is laid out as :meth:`~._paged.PagedKV.planes_of` takes it: plane by plane,
each plane's blocks in order. Runs of consecutive block ids that go to consecutive places
in the copy are one span, so blocks allocated one after another cost one span per plane,
whatever their number.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["block_spans", "plane_spans"]


def block_spans(
    blocks: list[int], planes: int, plane_bytes: int, row_bytes: int
) -> list[tuple[int, int, int]]:
    """Where ``blocks`` lie in a memory of ``planes`` planes: ``(offset, nbytes, at)`` per
    plane per run of consecutive block ids, ``at`` being where the span goes in a copy of
    ``blocks`` (in their order)."""
    return plane_spans(
        blocks, range(len(blocks)), range(planes), plane_bytes, row_bytes, len(blocks)
    )


def plane_spans(
    blocks: Sequence[int],
    places: Sequence[int],
    planes: Iterable[int],
    plane_bytes: int,
    row_bytes: int,
    count: int,
) -> list[tuple[int, int, int]]:
    """Spans of ``planes`` (plane indexes) of ``blocks``, block ``blocks[j]`` going to place
    ``places[j]`` of a copy of ``count`` blocks: ``(offset, nbytes, at)``, in plane order.
    Raises ``ValueError`` for places outside the copy or lists of different lengths."""
    if len(blocks) != len(places):
        raise ValueError(f"{len(blocks)} blocks and {len(places)} places")
    if any(not 0 <= p < count for p in places):
        raise ValueError(f"a place lies outside a copy of {count} blocks")
    runs: list[list[int]] = []  # [first block, blocks in the run, first place]
    for b, at in zip(blocks, places, strict=True):
        last = runs[-1] if runs else None
        if last is not None and last[0] + last[1] == b and last[2] + last[1] == at:
            last[1] += 1
        else:
            runs.append([b, 1, at])
    return [
        (p * plane_bytes + first * row_bytes, n * row_bytes, (p * count + at) * row_bytes)
        for p in planes
        for first, n, at in runs
    ]
