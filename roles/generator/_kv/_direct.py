"""A handoff copied in place (the decode side's ``handoff`` ``read="direct"``, the default): on the
prefill generator's host, the decode generator copies the blocks it lacks straight from the
prefill generator's block pool into blocks of its own pool. The pool is borrowed where it
lies (:meth:`~orchestr.Buffer.borrow`: the prefill generator's shared memory, mapped
read-only), so the bytes are copied once, by the decode generator between its steps, where a
staged read (:mod:`._receive`) copies them twice: into a staging copy off
the event loop, then into the pool between steps. Elsewhere (another host, or memory that
cannot be borrowed) the handoff is read staged.

Three phases keep the blocks safe:

1. :func:`plan_direct` (no lock): a streamed handoff is followed until its prompt is done
   (one progress call, ``until_done``); the blocks this cache lacks are planned.
2. :func:`copy_direct` (under the generator's lock, between steps): blocks are reserved
   here (held, in no cache) and the bytes copied into them, each checked first to lie in
   the spans the handoff granted; the borrow ends.

The borrowed view spans the prefill generator's whole pool: mapping only the granted spans
anew for each handoff costs 2-10 times the copy (decision 0015), so the spans are kept to
by the check above, and on one host the operating system's user is the boundary.
3. :func:`end_direct` (no lock: a call to the prefill generator, answered at once) ends each
   lease, which confirms it held through the copy; then :func:`enter_direct` (under the
   lock) enters the blocks into the prefix cache, or lets them go when the lease had expired
   first (its blocks may have been rewritten), which the generator's ``on_handoff_failure``
   then recomputes or refuses.

The copy's seconds are the transfer's (``orchestr:kv_transfer_seconds``); all of them come
after the prefill has ended (``orchestr:kv_transfer_exposed_seconds``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import warnings
from typing import Any

import structlog
import torch

import orchestr as oc

from .._core._contract import PagedKV
from .._core._types import Handoff, Request
from .._runner._spans import block_spans, same_keys

__all__ = ["Direct", "copy_direct", "end_direct", "enter_direct", "plan_direct"]

log = structlog.get_logger("orchestr.roles.generator")


@dataclasses.dataclass(eq=False)
class Direct:
    """A request's handed-off blocks to copy in place: ``keys`` are its prompt's that the
    handoff covers, the first ``local`` cached here when planned, and ``theirs`` the prefill
    pool's blocks of the rest."""

    request: Request
    handoff: Handoff
    keys: list[bytes]
    local: int
    theirs: list[int]
    borrowed: Any  # the prefill pool's memory (an orchestr Borrowed), until copied
    reserved: tuple[int, list[int], list[int]] | None = None
    seconds: float = 0.0
    error: BaseException | None = None

    def let_go(self) -> None:
        """End the borrow (idempotent)."""
        self.borrowed.release()


async def plan_direct(engine: PagedKV, r: Request, h: Handoff, borrowed: Any) -> Direct | None:
    """What ``engine`` lacks of handoff ``h`` for ``r``, to copy from ``borrowed`` (its
    pool's memory), or ``None`` when it lacks nothing or the layouts differ (the lease and
    the borrow are let go then). Raises ``RuntimeError`` for a streamed prefill that failed,
    and what the progress call raises; the lease and the borrow are let go then too."""
    source, lease = h.source, h.lease
    try:
        if h.stream:
            p = await source.handoff_progress.call_one(lease, -1, True)
            if p["state"] == "failed":
                raise RuntimeError(f"the prefill generator's stream failed: {p['error']}")
            their_keys, their_blocks = p["keys"], p["blocks"]
            wider = p["buffer"].borrow() if p.get("buffer") is not None else None
            if wider is not None:  # the grant as it is now, reaching every block named
                borrowed.release()
                borrowed = wider
        else:
            their_keys, their_blocks = h.keys, h.blocks
        keys, local = engine.prefix_plan(r.prompt)
        same = same_keys(keys, their_keys)
        planes, _, row_bytes = engine.kv_layout
        fits = (h.planes, h.row_bytes) == (
            planes,
            row_bytes,
        ) and borrowed.view.nbytes == h.planes * h.plane_bytes
        if same <= local or not fits:
            borrowed.release()
            if lease:
                source.release_handoff.broadcast(lease)
            return None
    except BaseException:
        borrowed.release()
        source.release_handoff.broadcast(lease)
        raise
    return Direct(r, h, keys[:same], local, their_blocks[local:same], borrowed)


def copy_direct(engine: PagedKV, directs: list[Direct]) -> None:
    """Reserve blocks for each of ``directs`` and copy theirs into them; every borrow ends.
    A copy that fails is recorded in its ``error`` (its blocks let go). Call between
    steps."""
    for d in directs:
        started = time.perf_counter()
        try:
            d.reserved = engine.reserve(d.keys, d.local, len(d.keys) - d.local)
            first, _, blocks = d.reserved
            if blocks:
                at = first - d.local
                theirs = d.theirs[at : at + len(blocks)]
                _check_granted(d, theirs)
                with warnings.catch_warnings():  # a read-only view, only read from
                    warnings.simplefilter("ignore", UserWarning)
                    source = torch.frombuffer(d.borrowed.view, dtype=torch.uint8)
                engine.copy_blocks_in(blocks, source, theirs, d.handoff.plane_bytes)
        except Exception as exc:
            d.error = exc
            if d.reserved is not None:
                engine.enter_reserved(d.request.prompt, d.keys, d.reserved, keep=False)
                d.reserved = None
        finally:
            d.let_go()
        d.seconds = time.perf_counter() - started


def _check_granted(d: Direct, theirs: list[int]) -> None:
    """Raise :class:`~orchestr.DescriptorError` unless every byte of blocks ``theirs`` lies in the spans
    the handoff granted: the borrowed view spans the whole pool, the grant its blocks only."""
    h = d.handoff
    for at, n, _ in block_spans(theirs, h.planes, h.plane_bytes, h.row_bytes):
        if not d.borrowed.reaches(at, n):
            raise oc.DescriptorError(
                f"block bytes [{at}, +{n}) of the prefill generator's pool lie outside what "
                f"the handoff of request {d.request.id} granted"
            )


async def end_direct(directs: list[Direct]) -> None:
    """End each lease copied from (a failed copy's is let go): an expired one is recorded
    in ``error``. Blocks on the calls; raises nothing."""

    async def end(d: Direct) -> None:
        source, lease = d.handoff.source, d.handoff.lease
        if d.error is not None:
            source.release_handoff.broadcast(lease)
            return
        try:
            await source.end_handoff.call_one(lease)
        except Exception as exc:
            d.error = exc

    await asyncio.gather(*(end(d) for d in directs))


def enter_direct(engine: PagedKV, directs: list[Direct], counts: dict[str, float]) -> list[Direct]:
    """Enter the blocks copied under a lease that held into ``engine``'s prefix cache and
    let go of the rest; counts the transfers and the failures; returns those that failed.
    Call between steps."""
    failed = []
    for d in directs:
        keep = d.error is None
        if d.reserved is not None:
            blocks = d.reserved[2]
            engine.enter_reserved(d.request.prompt, d.keys, d.reserved, keep=keep)
            d.reserved = None
            if keep and blocks:
                counts["orchestr:kv_transfers"] += 1
                counts["orchestr:kv_transfer_bytes"] += len(blocks) * engine.block_nbytes
                counts["orchestr:kv_transfer_seconds"] += d.seconds
                counts["orchestr:kv_transfer_exposed_seconds"] += d.seconds
                counts["orchestr:kv_transfer_reads"] += 1
        if not keep:
            counts["orchestr:kv_transfer_failures"] += 1
            log.warning(
                "copying a request's prefilled KV failed", request=d.request.id, error=repr(d.error)
            )
            failed.append(d)
    return failed
