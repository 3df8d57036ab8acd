"""The prefill side of a KV handoff: the leases a prefill generator holds on the blocks it
hands to decode generators (:class:`Holds`), and the request it runs for one
(:func:`prefill_request`).

When a request sent through ``Generator.prefill`` finishes its one token, the blocks of its
prompt cached there are held under a lease in the same step (nothing can evict them in
between), and the caller gets a :class:`~.._core._types.Handoff`: a :class:`~orchestr.Buffer`
over those blocks of the pool and nothing else (read-only, revoked when the lease ends or
expires), the blocks' ids and keys, the pool's geometry and the lease's time to live. A lease
nobody ends expires and its blocks return to the pool. A handoff streamed layer by layer is
granted before the prompt runs (:mod:`._streamed`) and becomes an ordinary lease here once its
prompt is done. The decode side reads it: :mod:`._receive`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable

import structlog

import orchestr as oc
from orchestr import clock as _clock
from orchestr.fabric import Buffer
from orchestr.roles.kvstore import LeaseExpiredError

from .._core._contract import PagedKV
from .._core._types import Completion, Handoff, Request
from .._runner._spans import block_spans
from ._streamed import Streamed

__all__ = ["Holds", "prefill_request"]

log = structlog.get_logger("orchestr.roles.generator")


def prefill_request(request: Request) -> Request:
    """The request a prefill generator runs for ``request``: its prompt, one greedy token
    (which only ends it: the decode side samples the request's own first token)."""
    return dataclasses.replace(
        request,
        max_new_tokens=1,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        stop=[],
        top_logprobs=0,
        ignore_eos=True,
        seed=None,
    )


class Holds:
    """The prefill side's leases on held blocks. ``engine`` is a paged engine
    (:meth:`~.._engines._paged.PagedEngine.hold_prefix`); every method is called between its
    steps (under the generator's lock). ``clock`` is monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = _clock.monotonic) -> None:
        self._clock = clock
        self._ids = itertools.count(1)
        self._wanted: dict[str, float] = {}  # request id -> seconds to hold its blocks
        self._granted: dict[str, Handoff] = {}  # request id -> its handoff, until taken
        self._leases: dict[int, tuple[list[int], float]] = {}  # lease -> (blocks, expires)
        self._ending: list[list[int]] = []  # blocks of leases ended, to release between steps
        self._grants: dict[int, Buffer] = {}  # lease -> the buffer over its blocks
        self.streamed = Streamed(self, clock)  # handoffs granted before their prefill
        self.counts = {
            "orchestr:kv_handoff_leases": 0,  # handoffs granted
            "orchestr:kv_handoff_expired": 0,  # of those, never ended by a reader
        }

    @property
    def leases(self) -> int:
        """Leases held, streams still computing included."""
        return len(self._leases) + self.streamed.running

    def next_lease(self) -> int:
        return next(self._ids)

    def adopt_lease(self, lease: int, blocks: list[int], expires: float) -> None:
        """Hold ``blocks`` (already held) under ``lease`` until it ends or ``expires``."""
        if blocks:
            self._leases[lease] = (blocks, expires)

    def want(self, request_id: str, hold_s: float) -> None:
        """Hold the prompt blocks of ``request_id`` for ``hold_s`` seconds when it finishes."""
        if not hold_s > 0:
            raise ValueError(f"hold_s must be positive, got {hold_s!r}")
        self._wanted[request_id] = hold_s

    def after_step(self, engine: PagedKV, finished: Iterable[Completion]) -> None:
        """Hold the blocks of the wanted requests that just finished, bring the streams up
        to date, and release the blocks of leases ended meanwhile (in the step's lock)."""
        self.release_ended(engine)
        self.streamed.after_step(engine, finished)
        if not self._wanted:
            return
        for c in finished:
            hold_s = self._wanted.pop(c.id, None)
            if hold_s is not None:
                self._granted[c.id] = self._grant(engine, c, hold_s)

    def take(self, request_id: str) -> Handoff | None:
        """The handoff of a wanted request that finished, else ``None``; either way
        ``request_id`` is wanted no more (a lease granted and not taken expires)."""
        self._wanted.pop(request_id, None)
        return self._granted.pop(request_id, None)

    def grant(self, lease: int) -> Buffer | None:
        """The buffer over ``lease``'s blocks, while it is held."""
        return self._grants.get(lease)

    def widen(self, engine: PagedKV, lease: int, blocks: list[int]) -> None:
        """Let ``lease``'s buffer reach ``blocks`` too (a stream's blocks as they are held;
        any thread). Raises nothing: a buffer revoked meanwhile stays so, and one that
        cannot widen leaves its reader refused those blocks (logged), not the step failed."""
        grant = self._grants.get(lease)
        if grant is None or not blocks:
            return
        try:
            grant.allow([(at, n) for at, n, _ in block_spans(blocks, *engine.kv_layout)])
        except oc.OrchestrError as exc:
            if self._grants.get(lease) is grant:  # not revoked: it could not widen
                log.warning("a streamed handoff's buffer could not widen", error=str(exc))

    def revoke(self, lease: int) -> None:
        """Release ``lease``'s buffer: its reader reaches nothing more. Idempotent."""
        grant = self._grants.pop(lease, None)
        if grant is not None:
            grant.release()

    def end(self, engine: PagedKV, lease: int) -> bool:
        """Release ``lease``'s blocks now (between steps); whether it was still held."""
        self.revoke(lease)
        entry = self._leases.pop(lease, None)
        if entry is not None:
            engine.release_blocks(entry[0])
        return entry is not None and entry[1] > self._clock()

    def end_now(self, lease: int) -> None:
        """End ``lease`` at once, while a step may be running: its blocks stay held until
        :meth:`release_ended` (between steps). Raises :class:`LeaseExpiredError` when it had
        expired (or was never granted), so what was read must not be used."""
        self.revoke(lease)
        entry = self._leases.pop(lease, None)
        if entry is not None:
            self._ending.append(entry[0])
        if entry is None or entry[1] <= self._clock():
            raise LeaseExpiredError(f"handoff lease {lease} had expired before its reader ended it")

    @property
    def ending(self) -> bool:
        """Whether blocks of ended leases wait for :meth:`release_ended`."""
        return bool(self._ending)

    def release_ended(self, engine: PagedKV) -> None:
        """Release the blocks of the leases :meth:`end_now` ended (between steps)."""
        ending, self._ending = self._ending, []
        for blocks in ending:
            engine.release_blocks(blocks)

    def next_expiry(self) -> float | None:
        """Seconds until the next lease expires (``None``: none held)."""
        if not self._leases:
            return None
        return max(0.0, min(e for _, e in self._leases.values()) - self._clock())

    def expire(self, engine: PagedKV) -> int:
        """Release the leases past their time; returns how many."""
        now = self._clock()
        gone = [lease for lease, (_, expires) in self._leases.items() if expires <= now]
        for lease in gone:
            self.revoke(lease)
            engine.release_blocks(self._leases.pop(lease)[0])
        self.counts["orchestr:kv_handoff_expired"] += len(gone)
        self.streamed.prune()
        return len(gone)

    def stream(self, engine: PagedKV, request: Request, hold_s: float) -> Handoff:
        """A handoff of ``request``'s blocks as they are computed (:mod:`._streamed`), to
        grant before it is queued."""
        if not hold_s > 0:
            raise ValueError(f"hold_s must be positive, got {hold_s!r}")
        s = self.streamed.open(engine, request, self.next_lease(), hold_s)
        size = engine.cache_keys()[0]
        handoff = self._handoff(engine, s.lease, [], [], s.full * size, hold_s, s.version)
        return dataclasses.replace(handoff, stream=True)

    def _grant(self, engine: PagedKV, c: Completion, hold_s: float) -> Handoff:
        keys, blocks = engine.hold_prefix(c.prompt)
        lease = self.next_lease()
        if blocks:
            self._leases[lease] = (blocks, self._clock() + hold_s)
        size = engine.cache_keys()[0]
        try:
            return self._handoff(
                engine, lease if blocks else 0, blocks, keys, len(blocks) * size, hold_s, c.version
            )
        except (oc.OrchestrError, OSError) as exc:  # no buffer (a table full, memory locked)
            log.warning(
                "a handoff's buffer could not be made; its reader recomputes", error=str(exc)
            )
            self.end(engine, lease)  # in the step's lock: its blocks go back now
            return self._handoff(engine, 0, [], [], 0, hold_s, c.version)

    def _handoff(
        self,
        engine: PagedKV,
        lease: int,
        blocks: list[int],
        keys: list[bytes],
        tokens: int,
        hold_s: float,
        version: int,
    ) -> Handoff:
        planes, plane_bytes, row_bytes = engine.kv_layout
        grant = None
        if lease:  # a buffer over this lease's blocks of the pool only (a stream's: none yet)
            memory, blocks, (planes, plane_bytes, row_bytes) = engine.lend(blocks)
            spans = [(at, n) for at, n, _ in block_spans(blocks, planes, plane_bytes, row_bytes)]
            grant = self._grants[lease] = Buffer(memory, spans=spans, writable=False)
        self.counts["orchestr:kv_handoff_leases"] += 1
        return Handoff(
            lease=lease,
            buffer=grant,
            blocks=blocks,
            keys=keys,
            planes=planes,
            plane_bytes=plane_bytes,
            row_bytes=row_bytes,
            tokens=tokens,
            ttl=hold_s,
            version=version,
        )
