"""Where blocks lie in a :class:`~._cache.KVCache`'s memory, as spans a peer reads one-sided.

The memory is ``planes`` layer planes of ``plane_bytes`` each (every layer's keys, then every
layer's values); a block is ``row_bytes`` of each plane, at ``block * row_bytes``. A copy of
``count`` blocks is laid out as :meth:`~._cache.KVCache.planes_of` takes it: plane by plane,
each plane's blocks in order. Runs of consecutive block ids that go to consecutive places
in the copy are one span, so blocks allocated one after another cost one span per plane,
whatever their number.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence

import torch

__all__ = ["block_spans", "copy_blocks", "plane_spans", "same_keys"]


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


def copy_blocks(
    planes: Sequence[torch.Tensor],
    blocks: Sequence[int],
    source: torch.Tensor,
    theirs: Sequence[int],
    plane_bytes: int,
) -> None:
    """Copy blocks ``theirs`` of another pool's memory laid out as these ``planes`` (each
    ``[num_blocks, ...]``) are (``source``: its bytes as a flat ``uint8`` tensor,
    ``plane_bytes`` to a plane) into ``blocks`` of the planes, plane by plane, a run of
    consecutive ids on both sides at a time. Raises ``ValueError`` for lists of different
    lengths, a source of another layout or a block id outside its pool."""
    if len(blocks) != len(theirs):
        raise ValueError(f"{len(blocks)} blocks here for {len(theirs)} there")
    row = planes[0][0].numel() * planes[0].element_size()
    if source.numel() != len(planes) * plane_bytes or plane_bytes % row:
        raise ValueError("the source is not a block pool of this layout")
    here, there = planes[0].shape[0], plane_bytes // row
    if not all(0 <= b < here for b in blocks) or not all(0 <= t < there for t in theirs):
        raise ValueError(f"a block id lies outside its pool ({here} blocks here, {there} there)")
    runs: list[list[int]] = []  # [first here, first there, count]
    for b, t in zip(blocks, theirs, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == b and runs[-1][1] + runs[-1][2] == t:
            runs[-1][2] += 1
        else:
            runs.append([b, t, 1])
    src = source.view(len(planes), -1, row)
    for i, plane in enumerate(planes):
        dst = plane.view(plane.shape[0], -1).view(torch.uint8)
        if dst.device.type == "cpu" and source.device.type == "cpu":
            # memmove: torch's copy of uint8 rows runs at a quarter of it on these cores
            to, at = dst.data_ptr(), src[i].data_ptr()
            for here, there, n in runs:
                ctypes.memmove(to + here * row, at + there * row, n * row)
        else:
            for here, there, n in runs:
                dst[here : here + n].copy_(src[i, there : there + n])


def same_keys(keys: Sequence[bytes], theirs: Sequence[bytes], start: int = 0) -> int:
    """How many of ``keys``, from the first, a handoff's keys ``theirs`` share (those before
    ``start`` taken as shared): the blocks of the handoff that are this prompt's."""
    same = start
    while same < min(len(keys), len(theirs)) and keys[same] == theirs[same]:
        same += 1
    return same
