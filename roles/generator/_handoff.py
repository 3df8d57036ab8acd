"""KV handed from a prefill generator to a decode generator (prefill/decode disaggregation).

The prefill side (:class:`Holds`, in the :class:`~orchestr.roles.Generator` that ran the
prompt): when a request sent through :meth:`Generator.prefill` finishes its one token, the
blocks of its prompt cached there are held under a lease in the same step (nothing can evict
them in between), and the caller gets a :data:`Handoff`: a :class:`~orchestr.Buffer` over
those blocks of the pool and nothing else (read-only, revoked when the lease ends or expires),
the blocks' ids and keys, the pool's geometry and the lease's time to live. A lease nobody
ends expires and its blocks return to the pool.

The decode side (:func:`fetch`, in the generator given the handoff with the request): it
reads only the blocks its own prefix cache lacks, one-sided from the prefill generator's
memory (:meth:`~orchestr.Buffer.read_spans`: one span per layer plane per run of
consecutive blocks, one hop on one host), ends the lease (the call that confirms it held
through the read), and enters the blocks into its prefix cache before the request is
submitted: the scheduler then finds them as a prefix hit and computes only the prompt's last
partial block and its first token, exactly as a co-located engine would have (the attention
kernels give a position the same bits whether its chunk was split or not). Blocks are keyed
under the weights' version on both sides, so a handoff made under other weights matches
nothing and the prompt is computed here. A failed read, an expired lease or a prefill
generator that died is counted and, by the generator's ``on_handoff_failure``, either
recomputed here (``"recompute"``, the default) or refused with :class:`HandoffError`.

That is the staged read (``kv_read="staged"``, and any handoff from another host). On the
prefill generator's host a decode generator reading ``"direct"`` (the default) copies the
blocks once, straight from the prefill generator's pool into its own (:mod:`._direct`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog
import torch

import orchestr as oc
from orchestr import clock as _clock
from orchestr.fabric import Buffer
from orchestr.roles.kvstore import LeaseExpiredError

from ._direct import Direct, plan_direct
from ._overlap import Streamed, read_streamed
from ._spans import block_spans, same_keys
from ._types import Completion, Request

__all__ = [
    "HANDOFF_POLICIES", "TRANSFER_COUNTERS", "Handoff", "HandoffError", "Holds", "Received", "adopt",
    "fetch", "prefill_request", "refused",
]  # fmt: skip

log = structlog.get_logger("orchestr.roles.generator")

HANDOFF_POLICIES = ("recompute", "fail")

#: What :meth:`Generator.prefill` returns: ``lease``, ``buffer``, ``blocks``, ``keys``,
#: ``planes``, ``plane_bytes``, ``row_bytes``, ``tokens``, ``ttl``, ``version``; the caller
#: adds ``source`` (the prefill generator's one-actor mesh) before handing it on.
Handoff = dict[str, Any]


class HandoffError(oc.OrchestrError):
    """A request's prefilled KV could not be read, and this generator does not recompute it."""

    __module__ = "orchestr.roles"


def prefill_request(request: Request) -> Request:
    """The request a prefill generator runs for ``request``: its prompt, one greedy token
    (which only ends it: the decode side samples the request's own first token)."""
    return dataclasses.replace(
        request, max_new_tokens=1, temperature=0.0, top_k=0, top_p=1.0, stop=[],
        top_logprobs=0, ignore_eos=True, seed=None,
    )  # fmt: skip


class Holds:
    """The prefill side's leases on held blocks. ``engine`` is a paged engine
    (:meth:`~._paged_engine.PagedEngine.hold_prefix`); every method is called between its
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

    def after_step(self, engine: Any, finished: Iterable[Completion]) -> None:
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

    def widen(self, engine: Any, lease: int, blocks: list[int]) -> None:
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

    def end(self, engine: Any, lease: int) -> bool:
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

    def release_ended(self, engine: Any) -> None:
        """Release the blocks of the leases :meth:`end_now` ended (between steps)."""
        ending, self._ending = self._ending, []
        for blocks in ending:
            engine.release_blocks(blocks)

    def next_expiry(self) -> float | None:
        """Seconds until the next lease expires (``None``: none held)."""
        if not self._leases:
            return None
        return max(0.0, min(e for _, e in self._leases.values()) - self._clock())

    def expire(self, engine: Any) -> int:
        """Release the leases past their time; returns how many."""
        now = self._clock()
        gone = [lease for lease, (_, expires) in self._leases.items() if expires <= now]
        for lease in gone:
            self.revoke(lease)
            engine.release_blocks(self._leases.pop(lease)[0])
        self.counts["orchestr:kv_handoff_expired"] += len(gone)
        self.streamed.prune()
        return len(gone)

    def stream(self, engine: Any, request: Request, hold_s: float) -> Handoff:
        """A handoff of ``request``'s blocks as they are computed (:mod:`._overlap`), to
        grant before it is queued."""
        if not hold_s > 0:
            raise ValueError(f"hold_s must be positive, got {hold_s!r}")
        s = self.streamed.open(engine, request, self.next_lease(), hold_s)
        size = engine.cache_keys()[0]
        return self._handoff(engine, s.lease, [], [], s.full * size, hold_s, s.version) | {
            "stream": True
        }

    def _grant(self, engine: Any, c: Completion, hold_s: float) -> Handoff:
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
        self, engine: Any, lease: int, blocks: list[int], keys: list[bytes], tokens: int,
        hold_s: float, version: int,
    ) -> Handoff:  # fmt: skip
        planes, plane_bytes, row_bytes = engine.kv_layout
        grant = None
        if lease:  # a buffer over this lease's blocks of the pool only (a stream's: none yet)
            spans = [(at, n) for at, n, _ in block_spans(blocks, planes, plane_bytes, row_bytes)]
            grant = self._grants[lease] = Buffer(engine.kv_memory, spans=spans, writable=False)
        self.counts["orchestr:kv_handoff_leases"] += 1
        return {
            "lease": lease, "buffer": grant, "blocks": blocks, "keys": keys,
            "planes": planes, "plane_bytes": plane_bytes, "row_bytes": row_bytes,
            "tokens": tokens, "ttl": hold_s, "version": version,
        }  # fmt: skip


@dataclasses.dataclass
class Received:
    """Blocks read for a request, to enter before it is submitted."""

    keys: list[bytes]
    start: int
    data: torch.Tensor


async def fetch(
    engine: Any,
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
                d.handoff["source"].release_handoff.broadcast(d.handoff["lease"])
        raise
    return out


async def _fetch_one(
    engine: Any, r: Request, h: Handoff, out: dict[str, Received | Direct], policy: str,
    counts: dict[str, float], direct: bool,
) -> None:  # fmt: skip
    try:
        borrowed = h["buffer"].borrow() if direct and h["buffer"] is not None else None
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
    """The error of a handoff not read under ``on_handoff_failure="fail"``."""
    return HandoffError(
        f"request {request_id}: its prefilled KV could not be read ({exc!r}); this "
        f"generator does not recompute (on_handoff_failure='fail')"
    )


async def _read(engine: Any, r: Request, h: Handoff) -> tuple[float, float, int, Received] | None:
    """Read what ``engine`` lacks of ``h`` for ``r``: (seconds reading, of those the
    seconds after the prefill had finished, the reads made, what was read), or ``None``
    when it lacks nothing (the lease is ended either way)."""
    if h.get("stream"):
        got = await read_streamed(engine, r, h)
        return None if got is None else (*got[:3], Received(*got[3:]))
    source = h["source"]
    keys, local = engine.prefix_plan(r.prompt)
    same = same_keys(keys, h["keys"])
    if same <= local or h["planes"] * h["row_bytes"] != engine.block_nbytes:
        if h["lease"]:  # nothing to read here: let it go at once
            source.release_handoff.broadcast(h["lease"])
        return None
    blocks = h["blocks"][local:same]
    data = torch.empty(len(blocks) * engine.block_nbytes, dtype=torch.uint8)
    spans = block_spans(blocks, h["planes"], h["plane_bytes"], h["row_bytes"])
    started = time.perf_counter()
    try:
        await h["buffer"].read_spans([(at, data[to : to + n]) for at, n, to in spans])
    except BaseException:
        source.release_handoff.broadcast(h["lease"])
        raise
    seconds = time.perf_counter() - started
    await source.end_handoff.call_one(h["lease"])  # raises if it had expired: unusable
    return seconds, seconds, 1, Received(keys, local, data)


def adopt(engine: Any, requests: list[Request], received: dict[str, Received | Direct]) -> int:
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
