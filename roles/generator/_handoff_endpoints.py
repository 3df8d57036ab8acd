"""The :class:`~orchestr.roles.Generator`'s endpoints of a KV handoff, on both sides: the
prefill side's :meth:`~HandoffEndpoints.prefill` (whole, or streamed layer by layer:
:mod:`._overlap`) and its leases, and the decode side's reads before requests are queued
(:mod:`._handoff`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orchestr as oc

from ._direct import Direct, copy_direct, end_direct, enter_direct
from ._handoff import (
    HANDOFF_POLICIES,
    TRANSFER_COUNTERS,
    Handoff,
    Holds,
    Received,
    adopt,
    fetch,
    prefill_request,
    refused,
)  # fmt: skip
from ._kvlink import fetch_stored
from ._types import Completion, Request, as_request

__all__ = ["KV_READS", "HandoffEndpoints"]

#: How a decode generator reads a handoff: ``"direct"``, copied in place from the prefill
#: generator's pool where it can be borrowed (on its host: :mod:`._direct`), else staged;
#: ``"staged"``, always read into a copy first (streamed layer by layer when the prefill
#: streams) and entered between steps.
KV_READS = ("direct", "staged")


class HandoffEndpoints:
    """The :class:`~orchestr.roles.Generator`'s endpoints of both sides of a handoff (a
    mixin over the generator's engine, lock and :meth:`generate`)."""

    _engine: Any
    _lock: asyncio.Lock
    _holds: Holds
    _expiring: asyncio.Task[None] | None
    _handoff_policy: str
    _kv_read: str
    _handoff_counts: dict[str, float]
    _claimed: dict[str, asyncio.Future[Completion]]
    _followers: set[asyncio.Task[None]]
    generate: Callable[[list[Any]], Awaitable[list[Completion]]]
    _ensure_running: Callable[[], None]
    _wake: asyncio.Event

    def _init_handoff(self, policy: str, kv_read: str) -> None:
        if policy not in HANDOFF_POLICIES:
            raise oc.ConfigError(
                f"on_handoff_failure is one of {', '.join(HANDOFF_POLICIES)}, got {policy!r}"
            )
        if kv_read not in KV_READS:
            raise oc.ConfigError(f"kv_read is one of {', '.join(KV_READS)}, got {kv_read!r}")
        self._kv_read = kv_read
        self._holds = Holds()
        self._expiring = None
        self._releasing: asyncio.Task[None] | None = None
        self._followers = set()
        self._handoff_policy = policy
        self._handoff_counts = dict.fromkeys(TRANSFER_COUNTERS, 0.0)

    @oc.endpoint(concurrent=True)
    async def prefill(self, request: Any, hold_s: float = 10.0, stream: bool = False) -> Handoff:
        """Compute ``request``'s prompt here and hold its KV blocks for ``hold_s`` seconds,
        for a decode generator to read: returns the :data:`Handoff` (add ``source``, this
        generator's one-actor mesh, and pass it to the decode generator's :meth:`submit` as
        ``kv_from={request.id: handoff}``). The prompt runs as one greedy token (the decode
        side samples the request's own). The lease ends when the reader ends it, or expires.
        With ``stream``, the handoff is returned as soon as the request is queued and the
        reader takes the blocks layer by layer as they are computed (:mod:`._overlap`); the
        lease's ``hold_s`` counts from the prompt's end.

        Blocks until the prompt is computed (with ``stream``, until it is queued); raises
        ``ValueError`` for a bad request and :class:`ConfigError` on an engine without a
        paged KV cache. Cancel-safe: cancelled, the request is cancelled, and a lease granted
        meanwhile expires."""
        if not hasattr(self._engine, "hold_prefix"):
            raise oc.ConfigError(
                f"prefill hands off KV blocks of the paged engine; this generator runs "
                f"{type(self._engine).__name__}"
            )
        r = prefill_request(as_request(request))
        if stream:
            return await self._prefill_streamed(r, float(hold_s))
        self._holds.want(r.id, float(hold_s))
        try:
            await self.generate([r])
        finally:
            handoff = self._holds.take(r.id)
            self._keep_expiring()
        if handoff is None:  # the generator was reset meanwhile
            raise RuntimeError(f"request {r.id!r} was dropped before its prefill finished")
        return handoff

    async def _prefill_streamed(self, r: Request, hold_s: float) -> Handoff:
        if not hold_s > 0:
            raise ValueError(f"hold_s must be positive, got {hold_s!r}")
        self._ensure_running()
        loop = asyncio.get_running_loop()
        async with self._entering([r], None):  # queued and streamed before any step
            handoff = self._holds.stream(self._engine, r, hold_s)
            future: asyncio.Future[Completion] = loop.create_future()
            self._claimed[r.id] = future
        self._wake.set()
        task = loop.create_task(self._follow(r.id, future))
        self._followers.add(task)
        task.add_done_callback(self._followers.discard)
        return handoff

    async def _follow(self, request_id: str, future: asyncio.Future[Completion]) -> None:
        """Wait for a streamed prefill; a request that fails ends its stream."""
        try:
            await future
        except asyncio.CancelledError:
            if not future.cancelled():
                raise  # this task was cancelled: the generator is closing
            return  # its reader let it go, which ended the stream
        except Exception as exc:
            async with self._lock:
                self._holds.streamed.fail(self._engine, request_id, f"the prefill failed: {exc!r}")
        self._keep_expiring()

    @oc.endpoint(concurrent=True)
    async def handoff_progress(
        self, lease: int, after: int = -1, until_done: bool = False
    ) -> dict[str, Any]:
        """How far the streamed handoff ``lease`` has come, once past cursor ``after`` (with
        ``until_done``, once it is done or failed):
        ``cursor``, ``state`` (``"running"``, ``"done"`` or ``"failed"``), ``blocks`` (its
        full prompt blocks so far), ``ready`` (of those, the ones done in every layer),
        ``written`` (layers done of the rest), ``layers``, ``keys`` (when done), ``error``
        and ``buffer`` (the handoff's buffer as it is now, reaching every block named; read
        through it, ``None`` once revoked). Blocks until there is news; raises
        :class:`LeaseExpiredError` for a stream not here; cancel-safe."""
        return await self._holds.streamed.wait(lease, after, until_done)

    @oc.endpoint(concurrent=True)
    async def end_handoff(self, lease: int) -> None:
        """Release a handoff's blocks after reading them; raises
        :class:`LeaseExpiredError` if it had expired first (what was read must not be
        used). Answers at once, a step running or not: the blocks return to the pool between
        steps. Cancel-safe."""
        self._holds.streamed.forget(lease)
        try:
            self._holds.end_now(lease)
        finally:
            if self._holds.ending and (self._releasing is None or self._releasing.done()):
                self._releasing = asyncio.get_running_loop().create_task(self._release_ended())

    async def _release_ended(self) -> None:
        async with self._lock:
            self._holds.release_ended(self._engine)

    @oc.endpoint(concurrent=True)
    async def release_handoff(self, lease: int) -> bool:
        """Release a handoff's blocks unread (idempotent); whether it was still held.
        Blocks on the step in progress; raises nothing; cancel-safe."""
        async with self._lock:
            running = self._holds.streamed.release(self._engine, lease)
            if running is None:
                return self._holds.end(self._engine, lease)
            with contextlib.suppress(KeyError):  # still computing its prompt: stop it
                self._engine.cancel(running)
            future = self._claimed.pop(running, None)
            if future is not None:
                future.cancel()
            return True

    @contextlib.asynccontextmanager
    async def _entering(
        self, requests: list[Request], kv_from: dict[str, Handoff] | None
    ) -> AsyncIterator[None]:
        """Read what ``kv_from`` hands over and what a KV store holds of ``requests``, then,
        under the lock, enter it and submit them; the body runs under the lock too."""
        received = await self._receive(requests, kv_from)
        direct = [d for d in received.values() if isinstance(d, Direct)]
        try:
            await fetch_stored(self._engine, requests)
            if direct:
                async with self._lock:
                    copy_direct(self._engine, direct)
                await end_direct(direct)
            async with self._lock:
                failed = enter_direct(self._engine, direct, self._handoff_counts)
                if failed and self._handoff_policy == "fail":
                    raise refused(failed[0].request.id, failed[0].error)
                adopt(self._engine, requests, received)
                self._engine.submit(requests)
                yield
        finally:
            await self._let_go(direct)

    async def _let_go(self, direct: list[Direct]) -> None:
        """Release what a cancelled or failed entry left of ``direct``: borrows, and blocks
        reserved (between steps, even when cancelled again)."""
        for d in direct:
            d.let_go()
        left = [d for d in direct if d.reserved is not None]
        if not left:
            return

        async def release() -> None:
            async with self._lock:
                for d in left:
                    if d.reserved is not None:
                        self._engine.enter_reserved(
                            d.request.prompt, d.keys, d.reserved, keep=False
                        )
                        d.reserved = None

        await asyncio.shield(asyncio.ensure_future(release()))

    async def _receive(
        self, requests: list[Request], kv_from: dict[str, Handoff] | None
    ) -> dict[str, Received | Direct]:
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
            counts=self._handoff_counts, direct=self._kv_read == "direct",
        )  # fmt: skip

    def _keep_expiring(self) -> None:
        """Run :meth:`_expire` while leases are held."""
        if self._holds.leases and (self._expiring is None or self._expiring.done()):
            self._expiring = asyncio.get_running_loop().create_task(self._expire())

    async def _expire(self) -> None:
        """Release leases as they expire, until none is held."""
        while (wait := self._holds.next_expiry()) is not None:
            await asyncio.sleep(wait)
            async with self._lock:
                self._holds.expire(self._engine)

    async def _stop_expiring(self) -> None:
        tasks = [t for t in (self._expiring, self._releasing, *self._followers) if t is not None]
        self._expiring = self._releasing = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
