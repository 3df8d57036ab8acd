"""KV handed from a prefill generator to a decode generator (prefill/decode disaggregation).

The prefill side (:class:`Holds`, in the :class:`~orchestr.roles.Generator` that ran the
prompt): when a request sent through :meth:`Generator.prefill` finishes its one token, the
blocks of its prompt cached there are held under a lease in the same step (nothing can evict
them in between), and the caller gets a :data:`Handoff`: the pool's
:class:`~orchestr.Buffer`, the blocks' ids and keys, the pool's geometry and the lease's time
to live. A lease nobody ends expires and its blocks return to the pool.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import structlog
import torch

import orchestr as oc
from orchestr import clock as _clock
from orchestr.roles.kvstore import LeaseExpiredError

from ._kvlink import fetch_stored
from ._paged import block_spans
from ._types import Completion, Request, as_request

__all__ = [
    "HANDOFF_POLICIES", "HandoffEndpoints", "HandoffError", "Holds", "Received", "adopt", "fetch", "prefill_request",
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
        self.buffer: Any = None  # the pool's Buffer, registered at the first handoff
        self.counts = {
            "orchestr:kv_handoff_leases": 0,  # handoffs granted
            "orchestr:kv_handoff_expired": 0,  # of those, never ended by a reader
        }

    @property
    def leases(self) -> int:
        return len(self._leases)

    def want(self, request_id: str, hold_s: float) -> None:
        """Hold the prompt blocks of ``request_id`` for ``hold_s`` seconds when it finishes."""
        if not hold_s > 0:
            raise ValueError(f"hold_s must be positive, got {hold_s!r}")
        self._wanted[request_id] = hold_s

    def after_step(self, engine: Any, finished: Iterable[Completion]) -> None:
        """Hold the blocks of the wanted requests that just finished (in the step's lock)."""
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

    def end(self, engine: Any, lease: int, *, check: bool) -> bool:
        """Release ``lease``'s blocks. With ``check``, raise :class:`LeaseExpiredError`
        when it had expired (or was never granted) so what was read must not be used;
        otherwise return whether it was still held."""
        entry = self._leases.pop(lease, None)
        if entry is not None:
            engine.release_blocks(entry[0])
        held = entry is not None and entry[1] > self._clock()
        if check and not held:
            raise LeaseExpiredError(f"handoff lease {lease} had expired before its reader ended it")
        return held

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
            engine.release_blocks(self._leases.pop(lease)[0])
        self.counts["orchestr:kv_handoff_expired"] += len(gone)
        return len(gone)

    def _grant(self, engine: Any, c: Completion, hold_s: float) -> Handoff:
        keys, blocks = engine.hold_prefix(c.prompt)
        lease = next(self._ids)
        if blocks:
            self._leases[lease] = (blocks, self._clock() + hold_s)
        if self.buffer is None:
            self.buffer = oc.Buffer(engine.kv_memory)
        planes, plane_bytes, row_bytes = engine.kv_layout
        self.counts["orchestr:kv_handoff_leases"] += 1
        return {
            "lease": lease if blocks else 0,
            "buffer": self.buffer,
            "blocks": blocks,
            "keys": keys,
            "planes": planes,
            "plane_bytes": plane_bytes,
            "row_bytes": row_bytes,
            "tokens": len(blocks) * engine.cache_keys()[0],
            "ttl": hold_s,
            "version": c.version,
        }


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
) -> dict[str, Received]:
    """Read each request's handed-off blocks that ``engine``'s prefix cache lacks, and end
    the leases. Returns what was read, by request id. A failed read or an expired lease is
    counted (``counts``) and, under ``policy`` ``"fail"``, raised as :class:`HandoffError`
    (the leases of requests not read yet are left to expire); under ``"recompute"`` the
    request computes its prompt here. Blocks on the reads and the lease calls."""
    out: dict[str, Received] = {}
    for r in requests:
        h = kv_from.get(r.id)
        if h is None:
            continue
        try:
            got = await _read(engine, r, h)
        except Exception as exc:
            counts["orchestr:kv_transfer_failures"] += 1
            log.warning("reading a request's prefilled KV failed", request=r.id, error=repr(exc))
            if policy == "fail":
                raise HandoffError(
                    f"request {r.id}: its prefilled KV could not be read ({exc!r}); this "
                    f"generator does not recompute (on_handoff_failure='fail')"
                ) from exc
            continue
        if got is not None:
            counts["orchestr:kv_transfers"] += 1
            counts["orchestr:kv_transfer_bytes"] += got[1].data.numel()
            counts["orchestr:kv_transfer_seconds"] += got[0]
            out[r.id] = got[1]
    return out


async def _read(engine: Any, r: Request, h: Handoff) -> tuple[float, Received] | None:
    """Read what ``engine`` lacks of ``h`` for ``r``: (seconds, what was read), or ``None``
    when it lacks nothing (the lease is ended either way)."""
    source = h["source"]
    keys, local = engine.prefix_plan(r.prompt)
    theirs = h["keys"]
    same = 0
    while same < min(len(keys), len(theirs)) and keys[same] == theirs[same]:
        same += 1
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
    return seconds, Received(keys, local, data)


def adopt(engine: Any, requests: list[Request], received: dict[str, Received]) -> int:
    """Enter what :func:`fetch` read into ``engine``'s prefix cache (between steps);
    returns the tokens entered."""
    tokens = 0
    for r in requests:
        got = received.get(r.id)
        if got is not None:
            tokens += engine.adopt(r.prompt, got.keys, got.start, got.data)
    return tokens


class HandoffEndpoints:
    """The :class:`~orchestr.roles.Generator`'s endpoints of both sides of a handoff (a
    mixin over the generator's engine, lock and :meth:`generate`)."""

    _engine: Any
    _lock: asyncio.Lock
    _holds: Holds
    _expiring: asyncio.Task[None] | None
    _handoff_policy: str
    _handoff_counts: dict[str, float]
    generate: Callable[[list[Any]], Awaitable[list[Completion]]]

    def _init_handoff(self, policy: str) -> None:
        if policy not in HANDOFF_POLICIES:
            raise oc.ConfigError(
                f"on_handoff_failure is one of {', '.join(HANDOFF_POLICIES)}, got {policy!r}"
            )
        self._holds = Holds()
        self._expiring = None
        self._handoff_policy = policy
        self._handoff_counts = dict.fromkeys(TRANSFER_COUNTERS, 0.0)

    @oc.endpoint(concurrent=True)
    async def prefill(self, request: Any, hold_s: float = 10.0) -> Handoff:
        """Compute ``request``'s prompt here and hold its KV blocks for ``hold_s`` seconds,
        for a decode generator to read: returns the :data:`Handoff` (add ``source``, this
        generator's one-actor mesh, and pass it to the decode generator's :meth:`submit` as
        ``kv_from={request.id: handoff}``). The prompt runs as one greedy token (the decode
        side samples the request's own). The lease ends when the reader ends it, or expires.

        Blocks until the prompt is computed; raises ``ValueError`` for a bad request and
        :class:`ConfigError` on an engine without a paged KV cache. Cancel-safe: cancelled,
        the request is cancelled, and a lease granted meanwhile expires."""
        if not hasattr(self._engine, "hold_prefix"):
            raise oc.ConfigError(
                f"prefill hands off KV blocks of the paged engine; this generator runs "
                f"{type(self._engine).__name__}"
            )
        r = prefill_request(as_request(request))
        self._holds.want(r.id, float(hold_s))
        try:
            await self.generate([r])
        finally:
            handoff = self._holds.take(r.id)
            if self._holds.leases and (self._expiring is None or self._expiring.done()):
                self._expiring = asyncio.get_running_loop().create_task(self._expire())
        if handoff is None:  # the generator was reset meanwhile
            raise RuntimeError(f"request {r.id!r} was dropped before its prefill finished")
        return handoff

    @oc.endpoint(concurrent=True)
    async def end_handoff(self, lease: int) -> None:
        """Release a handoff's blocks after reading them; raises
        :class:`LeaseExpiredError` if it had expired first (what was read must not be
        used). Blocks on the step in progress; cancel-safe."""
        async with self._lock:
            self._holds.end(self._engine, lease, check=True)

    @oc.endpoint(concurrent=True)
    async def release_handoff(self, lease: int) -> bool:
        """Release a handoff's blocks unread (idempotent); whether it was still held.
        Blocks on the step in progress; raises nothing; cancel-safe."""
        async with self._lock:
            return self._holds.end(self._engine, lease, check=False)

    @contextlib.asynccontextmanager
    async def _entering(
        self, requests: list[Request], kv_from: dict[str, Handoff] | None
    ) -> AsyncIterator[None]:
        """Read what ``kv_from`` hands over and what a KV store holds of ``requests``, then,
        under the lock, enter it and submit them; the body runs under the lock too."""
        received = await self._receive(requests, kv_from)
        await fetch_stored(self._engine, requests)
        async with self._lock:
            adopt(self._engine, requests, received)
            self._engine.submit(requests)
            yield

    async def _receive(
        self, requests: list[Request], kv_from: dict[str, Handoff] | None
    ) -> dict[str, Received]:
        if not kv_from:
            return {}
        unknown = set(kv_from) - {r.id for r in requests}
        if unknown:
            raise ValueError(f"kv_from names requests not submitted: {sorted(unknown)[:3]}")
        if not hasattr(self._engine, "adopt"):
            raise oc.ConfigError(
                f"kv_from enters blocks into the paged engine's cache; this generator runs "
                f"{type(self._engine).__name__}"
            )
        return await fetch(
            self._engine, requests, kv_from, policy=self._handoff_policy,
            counts=self._handoff_counts,
        )  # fmt: skip

    async def _expire(self) -> None:
        """Release leases as they expire, until none is held."""
        while (wait := self._holds.next_expiry()) is not None:
            await asyncio.sleep(wait)
            async with self._lock:
                self._holds.expire(self._engine)

    async def _stop_expiring(self) -> None:
        task, self._expiring = self._expiring, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


#: The counters of both sides, as the generator's metrics name them.
TRANSFER_COUNTERS = (
    "orchestr:kv_transfers",  # handoffs read (decode side)
    "orchestr:kv_transfer_bytes",
    "orchestr:kv_transfer_seconds",  # reading them (each also ends its lease: one call)
    "orchestr:kv_transfer_failures",  # reads failed or leases expired: recomputed or refused
)
