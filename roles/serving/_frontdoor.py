"""The front door's core: requests in, token deltas out, over a mesh of generators.

:class:`FrontDoor` owns one reader task per generator, which long-polls that generator's
:meth:`~orchestr.roles.Generator.updates` as one named reader: each answer carries the new
tokens of the requests this front door streams there, the generator's block events (for the
:class:`~._router.Router`) and its load. :meth:`FrontDoor.stream` routes one request, submits
it with ``stream=`` this reader, and yields its :class:`~orchestr.roles.TokenDelta` as they
arrive; leaving the iteration early (the client went away) cancels the request on its
generator, which frees its KV blocks at the end of the step in progress.

Admission is bounded: at most ``max_pending`` requests in flight; one more is refused with
:class:`OverloadedError` (the HTTP layer answers 429 with ``Retry-After``), so memory never
grows with the offered load. A generator whose calls fail (it died, or its engine failed
and its worker exits) is out of rotation at once; its requests end with
:class:`GeneratorLostError` (or go to another from their start: ``resend``, before any token
was delivered), and its reader puts it back when it answers again, restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any

import structlog

import orchestr as oc
from orchestr import clock
from orchestr.tasks import TaskOwner

from ..generator._core._types import Request, TokenDelta, Updates
from ._disagg import MIN_TOKENS, Prefill
from ._events import follow_store, worker_event
from ._router import GeneratorLostError, Load, OverloadedError, Router, prompt_hashes

__all__ = ["FrontDoor", "GeneratorLostError", "OverloadedError", "RequestStream"]

log = structlog.get_logger("orchestr.roles.serving")

#: Seconds a reader's ``updates`` call waits for news before it asks again.
POLL_S = 5.0
#: Seconds between tries of a generator that is out of rotation.
RETRY_S = 1.0


class _Pending:
    __slots__ = ("delivered", "door", "id", "queue", "request", "worker")

    def __init__(self, request: Request, worker: str, door: FrontDoor) -> None:
        self.id = request.id
        self.door = door  # whose reader delivers its deltas: this one, or its prefill pool's
        self.request = request
        self.worker = worker
        self.queue: asyncio.Queue[TokenDelta | BaseException] = asyncio.Queue()
        self.delivered = 0  # tokens given to the caller


class FrontDoor:
    """Serves requests on the generators of ``generators`` (a mesh of
    :class:`~orchestr.roles.Generator`), routed by ``router`` (a policy name of
    :data:`~._router.POLICIES` or a :class:`Router`). Use as an async context manager (it
    starts and stops the readers), from the job or program that owns the mesh. With
    ``store`` (the :class:`~orchestr.roles.KVStore` mesh the generators offload to) the
    router follows the store's events too, and counts its blocks at their onboarding cost.
    With ``prefill`` (a second mesh of generators) prompts of ``prefill_min_tokens`` or more
    are prefilled there and handed to ``generators`` to decode (:mod:`._disagg`; each
    handoff's lease lasts ``hold_s``; ``prefill_overlap`` streams it layer by layer as the
    prompt is computed; ``spill_at``: requests per decode generator beyond which they are
    served whole on the prefill pool).

    Raises ``ValueError`` for a bad ``max_pending``, policy, threshold, ``hold_s`` or
    ``spill_at`` (or one without ``prefill``)."""

    def __init__(
        self,
        generators: oc.Mesh,
        *,
        router: str | Router = "kv",
        max_pending: int = 256,
        resend: bool = False,
        name: str | None = None,
        store: oc.Mesh | None = None,
        prefill: oc.Mesh | None = None,
        prefill_min_tokens: int = MIN_TOKENS,
        hold_s: float = 10.0,
        prefill_overlap: bool = True,
        spill_at: int | None = None,
    ) -> None:
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
        if spill_at is not None and prefill is None:
            raise ValueError("spill_at spills to a prefill pool: give prefill too")
        self.router = router if isinstance(router, Router) else Router(router)
        self.max_pending = max_pending
        self.resend = resend
        self.name = name or f"frontdoor-{secrets.token_hex(4)}"
        self._store = store
        self._members: dict[str, oc.Mesh] = {
            generators.label(m): generators[i] for i, m in enumerate(generators.members)
        }
        self._pending: dict[str, _Pending] = {}
        self._loads: dict[str, Load] = {}
        self._unreported: dict[str, int] = dict.fromkeys(self._members, 0)
        self._requests: dict[str, int] = {}  # running and waiting, as last reported
        self._sent: dict[str, int] = dict.fromkeys(self._members, 0)  # requests since
        self._metrics: dict[str, dict[str, float]] = {}
        self._hash: tuple[int, list[Any]] = (0, [])
        self._tasks = TaskOwner()  # the readers (and the store's follower)
        self._cancels = TaskOwner()  # cancels of abandoned requests, awaited by aclose()
        self._ids = itertools.count()
        self._started = False
        self.counts = {"requests": 0, "finished": 0, "rejected": 0, "lost": 0, "resent": 0}
        self.prefill: Prefill | None = None
        if prefill is not None:
            door = FrontDoor(prefill, name=f"{self.name}-prefill", store=store)
            self.prefill = Prefill(
                door,
                min_tokens=prefill_min_tokens,
                hold_s=hold_s,
                overlap=prefill_overlap,
                spill_at=spill_at,
            )

    # -- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> FrontDoor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Put every generator in rotation and start reading their updates.

        Blocks on nothing; raises nothing. Idempotent."""
        if self._started:
            return
        self._started = True
        for worker in self._members:
            self.router.add(worker)
            self._tasks.start(self._read(worker), name=f"{self.name}:{worker}")
        if self._store is not None:
            self._tasks.start(follow_store(self._store, self.router), name=f"{self.name}:store")
        if self.prefill is not None:
            await self.prefill.door.start()

    async def aclose(self) -> None:
        """Stop the readers, end every request in flight with :class:`ClosedResourceError`
        and tell each generator to forget this reader (cancelling its requests there).

        Blocks on those calls (a dead generator's fails at once); raises nothing."""
        readers, self._tasks = self._tasks, TaskOwner()  # a new one for start() again
        await readers.aclose()
        for p in list(self._pending.values()):
            p.queue.put_nowait(oc.ClosedResourceError("the front door was closed"))
        if self._started:
            await asyncio.gather(
                *(m.unsubscribe.call_one(self.name) for m in self._members.values()),
                return_exceptions=True,
            )
        await asyncio.gather(*self._cancels, return_exceptions=True)
        if self.prefill is not None:
            await self.prefill.door.aclose()
        self._started = False

    # -- state -------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Requests in flight (those spilled to the prefill pool too)."""
        return len(self._pending) + (len(self.prefill.door._pending) if self.prefill else 0)

    @property
    def workers(self) -> list[str]:
        """The generators in rotation."""
        return self.router.workers

    def fewest_requests(self) -> int:
        """The requests running or waiting on the least-busy generator in rotation (as last
        reported, plus those routed there since); a large number when none is."""
        held = (self._requests.get(w, 0) + self._sent.get(w, 0) for w in self.router.workers)
        return min(held, default=1 << 30)

    def engine_metrics(self) -> dict[str, float]:
        """The generators' engine counters (vLLM's names), summed, as of their last updates."""
        total: dict[str, float] = {}
        for values in self._metrics.values():
            for k, v in values.items():
                total[k] = total.get(k, 0.0) + v
        return total

    def block_hashes(self, prompt: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The chained hashes of ``prompt``'s full blocks, as the generators' engines key
        them (empty until a generator has said how, or when it has no prefix cache)."""
        return prompt_hashes(prompt, *self._hash, cache_salt)

    # -- requests ----------------------------------------------------------------------------
    async def open(self, prompt: list[int], **params: Any) -> RequestStream:
        """Route and submit one request (``params``: :class:`~orchestr.roles.Request`'s
        fields but ``id`` and ``prompt``); iterate the stream returned for its deltas, the
        last one with a ``finish_reason``, and :meth:`RequestStream.close` it if you stop
        before that.

        Blocks on the submission. Raises :class:`OverloadedError` when ``max_pending``
        requests are in flight, :class:`NoWorkerError` when no generator is in rotation,
        ``ValueError`` for a request the engine refuses and :class:`GeneratorLostError` when
        the generator chosen fails. Cancel-safe: a cancelled call leaves no request behind."""
        if not self._started:
            raise oc.ClosedResourceError("the front door is not started (use `async with`)")
        if self.pending >= self.max_pending:
            self.counts["rejected"] += 1
            raise OverloadedError(
                f"{self.pending} requests are in flight, the most this front door takes "
                f"(max_pending); retry later"
            )
        request = Request(id=f"{self.name}-{next(self._ids)}", prompt=list(prompt), **params)
        pending = await self._submit(request, None)
        self.counts["requests"] += 1
        return RequestStream(self, pending)

    async def stream(self, prompt: list[int], **params: Any) -> AsyncIterator[TokenDelta]:
        """:meth:`open`, then its deltas; leaving the iteration early cancels the request.

        Blocks and raises as :meth:`open` and :class:`RequestStream` do; cancel-safe."""
        s = await self.open(prompt, **params)
        try:
            async for delta in s:
                yield delta
        finally:
            s.close()

    def route(self, request: Request) -> str:
        """Choose the generator for ``request`` by the router's policy, and count its blocks
        there until the generator's next report. Raises :class:`NoWorkerError`."""
        kv = self.router.policy == "kv"
        hashes = self.block_hashes(request.prompt, request.cache_salt) if kv else []
        loads = {}
        for w in self.router.workers:  # the last report, and what was sent since
            load = self._loads.get(w, Load())
            loads[w] = Load(load.prefill_blocks + self._unreported.get(w, 0), load.decode_blocks)
        now = clock.monotonic()
        choice = self.router.choose(hashes, loads, now)
        self.router.expect(choice.worker, hashes, now)
        self._sent[choice.worker] = self._sent.get(choice.worker, 0) + 1
        size = self._hash[0] or 16
        self._unreported[choice.worker] = self._unreported.get(choice.worker, 0) + max(
            1, (len(request.prompt) - choice.cached_blocks * size) // size
        )
        return choice.worker

    def member(self, worker: str) -> oc.Mesh:
        """The one-actor mesh of generator ``worker``."""
        return self._members[worker]

    async def _submit(self, request: Request, lost: str | None) -> _Pending:
        if lost is not None:
            self.counts["resent"] += 1
        if self.prefill is not None and self.prefill.spills(request, self.fewest_requests()):
            spilled: _Pending = await self.prefill.door._submit(request, None)
            return spilled
        kv_from = None if self.prefill is None else await self.prefill.handoff(request)
        try:
            worker = self.route(request)
        except BaseException:
            Prefill.release(kv_from)
            raise
        pending = _Pending(request, worker, self)
        self._pending[request.id] = pending
        try:
            await self._members[worker].submit.call_one(
                [request], stream=self.name, kv_from=kv_from
            )
        except oc.ActorError as exc:
            self._pending.pop(request.id, None)
            Prefill.release(kv_from)
            if exc.remote_type in ("ValueError", "TypeError"):
                raise ValueError(exc.remote_message) from None
            raise GeneratorLostError(f"generator {worker}: {exc.remote_message}") from exc
        except (oc.ActorDiedError, oc.CallError) as exc:
            self._pending.pop(request.id, None)
            Prefill.release(kv_from)
            self.lose(worker, exc)
            raise GeneratorLostError(f"generator {worker} failed: {exc}") from exc
        except BaseException:  # cancelled: the request may have reached the generator
            self._pending.pop(request.id, None)
            self._cancel_later(pending)
            raise
        return pending

    def _may_resend(self, pending: _Pending) -> bool:
        return self.resend and pending.delivered == 0 and bool(self.router.workers)

    def _cancel_later(self, pending: _Pending) -> None:
        """Cancel an abandoned request on its generator (in a task: the caller may be
        cancelled itself)."""

        async def cancel() -> None:
            with contextlib.suppress(oc.CallError):  # finished meanwhile, or the generator died
                await self._members[pending.worker].cancel.call_one(pending.id)

        self._cancels.start(cancel())

    # -- readers -----------------------------------------------------------------------------
    async def _read(self, worker: str) -> None:
        member = self._members[worker]
        while True:
            try:
                updates: Updates = await member.updates.call_one(self.name, timeout_s=POLL_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.lose(worker, exc)
                await asyncio.sleep(RETRY_S)
                continue
            if worker not in self.router.workers:
                log.info("generator back in rotation", generator=worker)
                self.router.add(worker)
            self._apply(worker, updates)

    def _apply(self, worker: str, u: Updates) -> None:
        self._loads[worker] = Load(u.prefill_blocks, u.decode_blocks)
        self._unreported[worker] = 0
        self._requests[worker], self._sent[worker] = u.running + u.waiting, 0
        self._metrics[worker] = u.metrics
        if u.block_size:
            self._hash = (u.block_size, list(u.extra_keys))
        if u.events:
            self.router.apply(worker, [worker_event(kind, hashes) for kind, hashes in u.events])
        for delta in u.deltas:
            pending = self._pending.get(delta.id)
            if pending is not None:
                pending.queue.put_nowait(delta)

    def lose(self, worker: str, exc: BaseException) -> None:
        """Take ``worker`` out of rotation; its requests end with :class:`GeneratorLostError`."""
        if not self.router.remove(worker):
            return  # out of rotation already: its requests were told
        log.warning("generator out of rotation", generator=worker, error=repr(exc)[:200])
        self._loads.pop(worker, None)
        self._requests.pop(worker, None)
        self._metrics.pop(worker, None)
        for p in self._pending.values():
            if p.worker == worker:
                self.counts["lost"] += 1
                p.queue.put_nowait(GeneratorLostError(f"generator {worker} failed: {exc}"))


class RequestStream:
    """One request's deltas (async iteration), from :meth:`FrontDoor.open`. Iteration raises
    :class:`GeneratorLostError` when its generator dies (unless the front door resends it)
    and :class:`ClosedResourceError` when the front door closes."""

    def __init__(self, front: FrontDoor, pending: _Pending) -> None:
        self._front, self._pending = front, pending
        self.stops = list(pending.request.stop)
        self.finished = False
        self._closed = False

    @property
    def id(self) -> str:
        return self._pending.id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self.finished or self._closed:
            raise StopAsyncIteration
        front = self._front
        while True:
            item = await self._pending.queue.get()
            if not isinstance(item, BaseException):
                break
            if isinstance(item, GeneratorLostError) and front._may_resend(self._pending):
                request, lost = self._pending.request, self._pending.worker
                self._pending = await front._submit(request, lost)
                continue
            self.close()
            raise item
        self._pending.delivered += len(item.tokens)
        if item.finish_reason is not None:
            self.finished = True
            front.counts["finished"] += 1
            self._pending.door._pending.pop(self._pending.id, None)
        return item

    def close(self) -> None:
        """Stop: a request not finished is cancelled on its generator (in a task, so this
        is safe to call from a cancelled task). Idempotent."""
        if self._closed:
            return
        self._closed = True
        door, pending = self._pending.door, self._pending
        if door._pending.pop(pending.id, None) is not None and not self.finished:
            if pending.worker in door.router.workers:
                door._cancel_later(pending)
