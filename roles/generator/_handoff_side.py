"""A :class:`~orchestr.roles.Generator`'s part in KV handoffs, on both sides: the prefill side's
leases on the blocks it hands over (:mod:`._kv._leases`, streamed layer by layer:
:mod:`._kv._streamed`) and the tasks that end them, and the decode side's reads before requests
are queued (:mod:`._kv._receive`, :mod:`._kv._direct`), with what a KV store holds
(:mod:`._kv._store_link`). The generator's endpoints delegate here."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orchestr as oc
from orchestr.tasks import TaskOwner

from ._core._contract import Engine, PagedKV
from ._core._options import HandoffOptions
from ._core._types import Completion, Handoff, Request, as_handoff
from ._kv._direct import Direct, copy_direct, end_direct, enter_direct
from ._kv._leases import Holds
from ._kv._receive import TRANSFER_COUNTERS, Received, adopt, fetch, refused
from ._kv._store_link import fetch_stored

__all__ = ["HandoffSide"]


class HandoffSide:
    """Both sides of a handoff for one generator's ``engine``, every engine call under
    ``lock`` (the generator's), as ``options`` say (:class:`~._options.HandoffOptions`)."""

    def __init__(self, engine: Engine, lock: asyncio.Lock, options: HandoffOptions) -> None:
        self.engine, self.lock, self.options = engine, lock, options
        self.holds = Holds()
        self.counts = dict.fromkeys(TRANSFER_COUNTERS, 0.0)  # the decode side's
        self._tasks = TaskOwner()  # followers of streamed prefills, and lease keepers
        self._expiring: asyncio.Task[None] | None = None
        self._releasing: asyncio.Task[None] | None = None

    def metrics(self) -> dict[str, float]:
        """Both sides' counters, by their exported names."""
        return {**self.holds.counts, **self.counts}

    def paged(self, what: str) -> PagedKV:
        """The engine, for what only a paged one does (``what``); :class:`ConfigError` on
        another."""
        if not isinstance(self.engine, PagedKV):
            raise oc.ConfigError(f"{what}; this generator runs {type(self.engine).__name__}")
        return self.engine

    # -- the prefill side ----------------------------------------------------------------------
    def after_step(self, finished: list[Completion]) -> None:
        """After a step, in its lock: hold the blocks the finished prefills hand off."""
        if isinstance(self.engine, PagedKV):  # leases are only ever held by one
            self.holds.after_step(self.engine, finished)

    async def prefill(
        self, r: Request, hold_s: float, generate: Callable[[list[Any]], Awaitable[Any]]
    ) -> Handoff:
        """Run ``r`` (through ``generate``) and return the handoff of its prompt's blocks."""
        self.holds.want(r.id, hold_s)
        try:
            await generate([r])
        finally:
            handoff = self.holds.take(r.id)
            self.keep_expiring()
        if handoff is None:  # the generator was reset meanwhile
            raise RuntimeError(f"request {r.id!r} was dropped before its prefill finished")
        return handoff

    def follow(self, engine: PagedKV, request_id: str, future: asyncio.Future[Completion]) -> None:
        """Watch the streamed prefill ``request_id`` (its completion: ``future``)."""
        self._tasks.start(self._follow(engine, request_id, future), name=f"follow {request_id}")

    async def _follow(
        self, engine: PagedKV, request_id: str, future: asyncio.Future[Completion]
    ) -> None:
        """Wait for a streamed prefill; a request that fails ends its stream."""
        try:
            await future
        except asyncio.CancelledError:
            if not future.cancelled():
                raise  # this task was cancelled: the generator is closing
            return  # its reader let it go, which ended the stream
        except Exception as exc:
            async with self.lock:
                self.holds.streamed.fail(engine, request_id, f"the prefill failed: {exc!r}")
        self.keep_expiring()

    def end(self, lease: int) -> None:
        """End ``lease`` at once (its reader read it); the blocks go back between steps.
        Raises :class:`LeaseExpiredError` when it had expired first."""
        self.holds.streamed.forget(lease)
        try:
            self.holds.end_now(lease)
        finally:
            if self.holds.ending and (self._releasing is None or self._releasing.done()):
                self._releasing = self._tasks.start(self._release_ended())

    async def _release_ended(self) -> None:
        async with self.lock:
            if isinstance(self.engine, PagedKV):
                self.holds.release_ended(self.engine)

    def release(self, lease: int) -> tuple[bool, str | None]:
        """Let ``lease`` go unread (under the lock): whether it was still held, and the id of
        the request still computing its prompt, cancelled here (its caller's to drop)."""
        engine = self.engine
        if not isinstance(engine, PagedKV):  # it holds no leases
            return False, None
        running = self.holds.streamed.release(engine, lease)
        if running is None:
            return self.holds.end(engine, lease), None
        with contextlib.suppress(KeyError):  # still computing its prompt: stop it
            engine.cancel(running)
        return True, running

    def keep_expiring(self) -> None:
        """Run :meth:`_expire` while leases are held."""
        if self.holds.leases and (self._expiring is None or self._expiring.done()):
            self._expiring = self._tasks.start(self._expire())

    async def _expire(self) -> None:
        """Release leases as they expire, until none is held."""
        while (wait := self.holds.next_expiry()) is not None:
            await asyncio.sleep(wait)
            async with self.lock:
                if isinstance(self.engine, PagedKV):
                    self.holds.expire(self.engine)

    # -- the decode side -----------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def entering(
        self, requests: list[Request], kv_from: dict[str, Any] | None
    ) -> AsyncIterator[None]:
        """Read what ``kv_from`` hands over and what a KV store holds of ``requests``, then,
        under the lock, enter it and submit them; the body runs under the lock too."""
        engine = self.engine
        received = await self._receive(requests, kv_from)
        direct = [d for d in received.values() if isinstance(d, Direct)]
        try:
            await fetch_stored(engine, requests)
            if direct and isinstance(engine, PagedKV):  # received: the engine is paged
                async with self.lock:
                    copy_direct(engine, direct)
                await end_direct(direct)
            async with self.lock:
                if received and isinstance(engine, PagedKV):
                    failed = enter_direct(engine, direct, self.counts)
                    if failed and self.options.on_failure == "fail":
                        raise refused(failed[0].request.id, failed[0].error)
                    adopt(engine, requests, received)
                engine.submit(requests)
                yield
        finally:
            await self._let_go(direct)

    async def _let_go(self, direct: list[Direct]) -> None:
        """Release what a cancelled or failed entry left of ``direct``: borrows, and blocks
        reserved (between steps, even when cancelled again)."""
        for d in direct:
            d.let_go()
        left = [d for d in direct if d.reserved is not None]
        engine = self.engine
        if not left or not isinstance(engine, PagedKV):
            return

        async def release() -> None:
            async with self.lock:
                for d in left:
                    if d.reserved is not None:
                        engine.enter_reserved(d.request.prompt, d.keys, d.reserved, keep=False)
                        d.reserved = None

        if not self._tasks.closed:  # closed: the engine is gone with them
            await asyncio.shield(self._tasks.start(release()))

    async def _receive(
        self, requests: list[Request], kv_from: dict[str, Any] | None
    ) -> dict[str, Received | Direct]:
        if not kv_from:
            return {}
        unknown = set(kv_from) - {r.id for r in requests}
        if unknown:
            raise ValueError(f"kv_from names requests not submitted: {sorted(unknown)[:3]}")
        handoffs = {rid: as_handoff(h) for rid, h in kv_from.items()}
        engine = self.paged("kv_from enters blocks into the paged engine's cache")
        return await fetch(
            engine,
            requests,
            handoffs,
            policy=self.options.on_failure,
            counts=self.counts,
            direct=self.options.read == "direct",
        )

    async def aclose(self) -> None:
        """Cancel the followers and lease keepers and wait for them. Idempotent."""
        await self._tasks.aclose()
