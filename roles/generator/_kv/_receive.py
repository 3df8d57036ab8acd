"""The decode side of a KV handoff (prefill/decode disaggregation): :func:`fetch`, in the
generator given the handoff with the request, reads only the blocks its own prefix cache
lacks, one-sided from the prefill generator's memory (:meth:`~orchestr.Buffer.read_spans`: one
span per layer plane per run of consecutive blocks, one hop on one host), ends the lease (the
call that confirms it held through the read), and :func:`adopt` enters the blocks into its
prefix cache before the request is submitted: the scheduler then finds them as a prefix hit
and computes only the prompt's last partial block and its first token, exactly as a co-located
engine would have (the attention kernels give a position the same bits whether its chunk was
split or not). Blocks are keyed under the weights' version on both sides, so a handoff made
under other weights matches nothing and the prompt is computed here. A failed read, an expired
lease or a prefill generator that died is counted and, by the generator's
``on_handoff_failure``, either recomputed here (``"recompute"``, the default) or refused with
:class:`HandoffError`.

Three ways to read: staged (``handoff={"read": "staged"}``, and any handoff from another host: read
into a copy, entered between steps); streamed (:func:`read_streamed`, the prefill side
streaming layer by layer: only what it finished after the last read is left to read when it
ends, the transfer's exposed time, ``orchestr:kv_transfer_exposed_seconds``); and, on the
prefill generator's host, direct (the default): copied once, straight from the prefill
generator's pool into this one (:mod:`._direct`). The prefill side: :mod:`._leases`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import structlog
import torch

import orchestr as oc

from .._core._contract import PagedKV
from .._core._types import Handoff, Request
from .._runner._spans import block_spans, plane_spans, same_keys
from ._direct import Direct, plan_direct

__all__ = [
    "TRANSFER_COUNTERS",
    "HandoffError",
    "Received",
    "adopt",
    "fetch",
    "read_streamed",
    "refused",
]

log = structlog.get_logger("orchestr.roles.generator")


class HandoffError(oc.OrchestrError):
    """A request's prefilled KV could not be read, and this generator does not recompute it."""

    __module__ = "orchestr.roles"


@dataclasses.dataclass
class Received:
    """Blocks read for a request, to enter before it is submitted."""

    keys: list[bytes]
    start: int
    data: torch.Tensor


async def fetch(
    engine: PagedKV,
    requests: list[Request],
    kv_from: dict[str, Handoff],
    *,
    policy: str,
    counts: dict[str, float],
    direct: bool = False,
) -> dict[str, Received | Direct]:
    """Read each request's handed-off blocks that ``engine``'s prefix cache lacks, and end
    the leases. Returns what was read, by request id; with ``direct``, a handoff whose pool
    can be borrowed on this host is only planned (:mod:`._direct`: copied, its lease ended
    and entered later). A failed read or an expired lease is counted (``counts``) and,
    under ``policy`` ``"fail"``, raised as :class:`HandoffError` (the leases of requests
    not read yet are left to expire); under ``"recompute"`` the request computes its
    prompt here. Blocks on the reads and the lease calls."""
    out: dict[str, Received | Direct] = {}
    try:
        for r in requests:
            h = kv_from.get(r.id)
            if h is not None:
                await _fetch_one(engine, r, h, out, policy, counts, direct)
    except BaseException:
        for d in out.values():
            if isinstance(d, Direct):  # planned, not copied: let it go
                d.let_go()
                d.handoff.source.release_handoff.broadcast(d.handoff.lease)
        raise
    return out


async def _fetch_one(
    engine: PagedKV,
    r: Request,
    h: Handoff,
    out: dict[str, Received | Direct],
    policy: str,
    counts: dict[str, float],
    direct: bool,
) -> None:
    try:
        borrowed = h.buffer.borrow() if direct and h.buffer is not None else None
        if borrowed is not None:
            planned = await plan_direct(engine, r, h, borrowed)
            if planned is not None:
                out[r.id] = planned
            return
        got = await _read(engine, r, h)
    except Exception as exc:
        counts["orchestr:kv_transfer_failures"] += 1
        log.warning("reading a request's prefilled KV failed", request=r.id, error=repr(exc))
        if policy == "fail":
            raise refused(r.id, exc) from exc
        return
    if got is not None:
        counts["orchestr:kv_transfers"] += 1
        seconds, exposed, reads, received = got
        counts["orchestr:kv_transfer_bytes"] += received.data.numel()
        counts["orchestr:kv_transfer_seconds"] += seconds
        counts["orchestr:kv_transfer_exposed_seconds"] += exposed
        counts["orchestr:kv_transfer_reads"] += reads
        out[r.id] = received


def refused(request_id: str, exc: BaseException | None) -> HandoffError:
    """The error of a handoff not read under ``handoff`` ``on_failure="fail"``."""
    return HandoffError(
        f"request {request_id}: its prefilled KV could not be read ({exc!r}); this "
        f"generator does not recompute (handoff on_failure='fail')"
    )


async def _read(
    engine: PagedKV, r: Request, h: Handoff
) -> tuple[float, float, int, Received] | None:
    """Read what ``engine`` lacks of ``h`` for ``r``: (seconds reading, of those the
    seconds after the prefill had finished, the reads made, what was read), or ``None``
    when it lacks nothing (the lease is ended either way)."""
    if h.stream:
        got = await read_streamed(engine, r, h)
        return None if got is None else (*got[:3], Received(*got[3:]))
    source = h.source
    keys, local = engine.prefix_plan(r.prompt)
    same = same_keys(keys, h.keys)
    if same <= local or h.buffer is None or h.planes * h.row_bytes != engine.block_nbytes:
        if h.lease:  # nothing to read here: let it go at once
            source.release_handoff.broadcast(h.lease)
        return None
    blocks = h.blocks[local:same]
    data = torch.empty(len(blocks) * engine.block_nbytes, dtype=torch.uint8)
    spans = block_spans(blocks, h.planes, h.plane_bytes, h.row_bytes)
    started = time.perf_counter()
    try:
        await h.buffer.read_spans([(at, data[to : to + n]) for at, n, to in spans])
    except BaseException:
        source.release_handoff.broadcast(h.lease)
        raise
    seconds = time.perf_counter() - started
    await source.end_handoff.call_one(h.lease)  # raises if it had expired: unusable
    return seconds, seconds, 1, Received(keys, local, data)


def adopt(engine: PagedKV, requests: list[Request], received: dict[str, Received | Direct]) -> int:
    """Enter what :func:`fetch` read into ``engine``'s prefix cache (between steps);
    returns the tokens entered (not those copied in place: :func:`~._direct.enter_direct`)."""
    tokens = 0
    for r in requests:
        got = received.get(r.id)
        if isinstance(got, Received):
            tokens += engine.adopt(r.prompt, got.keys, got.start, got.data)
    return tokens


#: The counters of both sides, as the generator's metrics name them.
TRANSFER_COUNTERS = (
    "orchestr:kv_transfers",  # handoffs read (decode side)
    "orchestr:kv_transfer_bytes",
    "orchestr:kv_transfer_seconds",  # reading them (each also ends its lease: one call)
    "orchestr:kv_transfer_exposed_seconds",  # of those, after the prefill had finished
    "orchestr:kv_transfer_reads",  # one-sided reads: several for a handoff streamed
    "orchestr:kv_transfer_failures",  # reads failed or leases expired: recomputed or refused
)


async def read_streamed(
    engine: PagedKV, r: Request, h: Handoff
) -> tuple[float, float, int, list[bytes], int, torch.Tensor] | None:
    """Read what ``engine`` lacks of the streamed handoff ``h`` for ``r`` as the prefill
    side computes it: (seconds spent reading, seconds of reading left once the prefill had
    finished, the reads made, the keys, the first block read and the blocks read, as
    :meth:`~.._engines._paged.PagedEngine.adopt` takes them), or ``None`` when this engine
    lacks nothing of it. Raises ``RuntimeError`` when the prefill failed, and what the calls
    and reads raise; the lease is let go then."""
    source, lease = h.source, h.lease
    keys, local = engine.prefix_plan(r.prompt)
    planes, plane_bytes, row_bytes = h.planes, h.plane_bytes, h.row_bytes
    if len(keys) <= local or planes * row_bytes != engine.block_nbytes:
        source.release_handoff.broadcast(lease)
        return None
    count = len(keys) - local
    data = torch.empty(count * engine.block_nbytes, dtype=torch.uint8)
    have = [0] * count  # layers read of each block wanted
    cursor, busy, done_at, reads = -1, 0.0, 0.0, 0
    try:
        while True:
            p = await source.handoff_progress.call_one(lease, cursor)
            cursor = p["cursor"]
            if p["state"] == "failed":
                raise RuntimeError(f"the prefill generator's stream failed: {p['error']}")
            if p["state"] == "done":
                done_at = time.perf_counter()
            spans = _new_spans(p, have, local, count, plane_bytes, row_bytes)
            if spans:
                started = time.perf_counter()
                buffer = p.get("buffer") or h.buffer  # reaching the blocks named so far
                if buffer is None:
                    raise RuntimeError("the prefill generator's stream names blocks, no buffer")
                await buffer.read_spans([(at, data[to : to + n]) for at, n, to in spans])
                busy += time.perf_counter() - started
                reads += 1
            if p["state"] == "done":
                break
    except BaseException:
        source.release_handoff.broadcast(lease)
        raise
    exposed = time.perf_counter() - done_at
    await source.end_handoff.call_one(lease)  # raises if it had expired: unusable
    same = same_keys(keys, p["keys"], local)
    if same == local:
        return None
    if same < len(keys):  # blocks past the first that differs are not this prompt's
        data = data.view(planes, count, -1)[:, : same - local].contiguous().view(-1)
    return busy, exposed, reads, keys[:same], local, data


def _new_spans(
    p: dict[str, Any], have: list[int], local: int, count: int, plane_bytes: int, row_bytes: int
) -> list[tuple[int, int, int]]:
    """The spans of the planes progress ``p`` says are ready and ``have`` lacks (blocks from
    ``local`` on, each going to its place in a copy of ``count``); ``have`` is updated."""
    layers = p["layers"]
    wanted: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for i, block in enumerate(p["blocks"][local : local + count]):
        upto = layers if local + i < p["ready"] else p["written"]
        if upto > have[i]:
            ids, places = wanted.setdefault((have[i], upto), ([], []))
            ids.append(block)
            places.append(i)
            have[i] = upto
    spans: list[tuple[int, int, int]] = []
    for (lo, hi), (ids, places) in wanted.items():
        chosen = itertools.chain(range(lo, hi), range(layers + lo, layers + hi))
        spans += plane_spans(ids, places, chosen, plane_bytes, row_bytes, count)
    return spans
