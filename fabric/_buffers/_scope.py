"""A buffer's scope: the byte ranges of its memory a peer may reach, when not all of it.

A scoped buffer (``Buffer(data, spans=...)``) is its own registration, with its own key, over
memory that other registrations may also cover; peers address it with the memory's own
offsets, and a transfer must lie inside one of its spans. Spans are kept as one flat tuple
``(start0, end0, start1, end1, ...)``, sorted, merged and strictly increasing, so a check is
one bisection and the whole scope is a single value that is swapped, never changed in place
(a reader on another thread sees the old scope or the new one). Scopes only grow
(:func:`widen`): a peer holding an older descriptor never loses what it was granted.

Who enforces a scope depends on the backend (its ``scoped`` attribute): ``"owner"`` where the
owning process (``inproc``, ``tcp``) or its adapter (``rdma``: one memory region per span)
refuses what lies outside; ``"reader"`` where the reader checks the owner-made descriptor
(``shm``: a reader on the owner's host, running as the same user, could reach the owner's
memory anyway, so the operating system's user is the boundary there). A backend without the
attribute never exports a scoped buffer. No I/O here.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

from orchestr.errors import DescriptorError

__all__ = ["Scope", "bounds", "covers", "flatten", "merge", "pairs", "parse", "widen"]

#: A scope as a flat tuple of span ends; ``None`` is the whole region.
Scope = tuple[int, ...]


def flatten(spans: Iterable[tuple[int, int]], length: int) -> Scope:
    """``(offset, nbytes)`` spans of a ``length``-byte region as a scope: sorted, with
    overlapping and touching spans merged, empty ones dropped. Raises :class:`DescriptorError`
    for a span that is not two integers inside the region."""
    cut: list[tuple[int, int]] = []
    for span in spans:
        try:
            offset, nbytes = span
        except (TypeError, ValueError):
            raise DescriptorError(f"a span is (offset, nbytes), got {span!r:.60}") from None
        if type(offset) is not int or type(nbytes) is not int:
            raise DescriptorError(f"a span is two integers, got {span!r:.60}")
        if offset < 0 or nbytes < 0 or offset + nbytes > length:
            raise DescriptorError(
                f"span [{offset}, +{nbytes}) lies outside the {length}-byte buffer"
            )
        if nbytes:
            cut.append((offset, offset + nbytes))
    return _merged(cut)


def _merged(cut: list[tuple[int, int]]) -> Scope:
    cut.sort()
    out: list[int] = []
    for start, end in cut:
        if out and start <= out[-1]:
            out[-1] = max(out[-1], end)
        else:
            out += (start, end)
    return tuple(out)


def pairs(scope: Scope) -> list[tuple[int, int]]:
    """The scope's spans as ``(start, end)`` pairs."""
    return list(zip(scope[::2], scope[1::2], strict=True))


def covers(scope: Scope, offset: int, nbytes: int) -> bool:
    """Whether ``[offset, offset + nbytes)`` lies inside one span of ``scope`` (an empty
    transfer anywhere up to a span's end)."""
    i = bisect.bisect_right(scope, offset)
    if i % 2:  # inside [scope[i-1], scope[i])
        return offset + nbytes <= scope[i]
    return nbytes == 0 and i > 0 and scope[i - 1] == offset  # empty, at a span's end


def bounds(scope: Scope) -> tuple[int, int]:
    """``(first byte, end)`` of the scope; ``(0, 0)`` when it is empty."""
    return (scope[0], scope[-1]) if scope else (0, 0)


def merge(scope: Scope, other: Scope) -> Scope:
    """The bytes of both scopes, as one."""
    return _merged(pairs(scope) + pairs(other))


def widen(scope: Scope, spans: Iterable[tuple[int, int]], length: int) -> Scope:
    """The bytes of ``spans`` (``(offset, nbytes)``) that ``scope`` does not cover yet, as a
    scope. Raises as :func:`flatten` does."""
    added = flatten(spans, length)
    new: list[tuple[int, int]] = []
    for start, end in pairs(added):
        at = start
        i = bisect.bisect_right(scope, at)
        while at < end:
            if i % 2:  # inside an old span: skip to its end
                at = min(end, scope[i])
            else:  # outside: new up to the next old span's start
                stop = min(end, scope[i]) if i < len(scope) else end
                if stop > at:
                    new.append((at, stop))
                at = stop
            i += 1
    return _merged(new)


def parse(data: Any, length: int) -> Scope:
    """A scope from its wire form (a flat list); raises :class:`DescriptorError` unless it is
    sorted, strictly increasing, of whole spans and inside ``length`` bytes."""
    if not isinstance(data, list | tuple) or len(data) % 2:
        raise DescriptorError(f"malformed buffer scope {data!r:.60}")
    scope = tuple(data)
    last = -1
    for v in scope:  # a plain loop: a handoff's scope has a span per layer plane
        if type(v) is not int or v <= last:
            raise DescriptorError(f"malformed buffer scope {data!r:.60}")
        last = v
    if last > length:
        raise DescriptorError(f"a buffer scope reaches past its {length}-byte buffer")
    return scope
