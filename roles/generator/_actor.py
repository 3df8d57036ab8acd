"""The generator role: an actor around an engine (:class:`~._core._contract.Engine`).

The actor owns its engine (:mod:`._engines`) and three parts the endpoints delegate to: the
weights (:class:`~._weight_side.WeightSide`), both sides of KV handoffs
(:class:`~._handoff_side.HandoffSide`) and experts and attention on other actors
(:class:`~._remote_parts.RemoteParts`); its options come in groups (:mod:`._options`).

The engine loop is one background task owned by the actor: started on the first endpoint
call, it steps while there is work (each step runs in a thread, so the actor keeps answering
calls) and sleeps when idle or paused; :meth:`Generator.aclose` cancels it (the worker's loop
cancels it too when the worker stops). Every engine access holds one ``asyncio.Lock``, so an
endpoint that changes the engine waits for the step in progress, at most one step.

A finished completion goes to the :meth:`Generator.generate` call that submitted it, else to
the stream read by :meth:`Generator.next_completed`, in finishing order; one submitted with
``stream=READER`` reaches that reader token by token through :meth:`Generator.updates`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import traceback
from collections import deque
from typing import Any

import structlog
import torch

import orchestr as oc
from orchestr.roles._common._backend import BackendSpec, choose_backend
from orchestr.roles._common._factory import DEFAULT_MODEL
from orchestr.roles._common._weightref import AnyWeightsRef
from orchestr.tasks import TaskOwner

from ._core._options import (
    AttentionOptions,
    ExpertOptions,
    HandoffOptions,
    KVOptions,
    as_options,
    legacy_options,
)
from ._core._types import Completion, Handoff, Request, Updates, as_request
from ._engines._build import build_engine, in_thread
from ._handoff_side import HandoffSide
from ._kv._leases import prefill_request
from ._kv._store_link import close_store, with_store
from ._metrics import EngineMetrics
from ._remote_parts import RemoteParts
from ._streams import Streams
from ._weight_side import WeightSide

__all__ = ["Completion", "Generator", "Request"]

log = structlog.get_logger("orchestr.roles.generator")


class Generator(oc.Actor):
    """Hosts a causal LM built by ``model_factory`` (``"module:callable"``, called with
    ``model_kwargs`` after ``torch.manual_seed(seed)``; default :class:`~orchestr.roles.TinyLM`)
    and serves requests with continuous batching of up to ``max_batch``. ``version`` is the
    initial weights' policy version; the other keywords go to :class:`RecomputeEngine` (a
    TinyLM's ``pad_id`` and ``vocab_size`` are its own unless given). ``nice`` raises the
    worker process's niceness by that much (``os.nice``), to yield shared cores to other roles.
    ``backend`` (a :class:`~orchestr.roles.BackendSpec` or a name, default the best this node
    has) says where and how the model runs.

    With ``checkpoint`` (a Hugging Face format folder; ``model`` is vLLM's name for it) the
    model is loaded from it and runs on ``engine`` ``"paged"`` (the default: orchestr's paged
    engine, its cache as ``kv`` says, a :class:`~orchestr.roles.KVOptions`) or ``"vllm"``
    (vLLM's engine in this process, with the ``vllm`` extra; ``vllm`` gives ``EngineArgs``
    options). On the paged engine: ``kv_store`` (a :class:`~orchestr.roles.KVStore` mesh) backs
    the prefix cache; prompts' KV is handed to others (:meth:`prefill` there, ``kv_from``
    here) as ``handoff`` says (a :class:`~orchestr.roles.HandoffOptions`: what a failed read
    does, how it reads); ``experts`` (an :class:`~orchestr.roles.ExpertOptions`) runs the routed
    experts of every sparse layer on expert hosts; ``attention`` (an
    :class:`~orchestr.roles.AttentionOptions`; paged kernel) sends the core attention of long
    decodes to attention servers. ``tp`` > 1 splits the checkpoint's model over that many
    ranks (tensor parallelism: this process, which schedules, and ``tp - 1`` processes it
    starts on this host, each with its share of the weights and of the KV pool; without
    ``torch_threads`` each takes its share of this process's threads). ``engine="sim"`` with
    ``profile`` (a step-time model's JSON file, from ``orchestr sim calibrate``) runs the
    paged engine's scheduler and KV pool with no model, each step lasting what the profile
    says (:mod:`._engines._sim`: for tests at a size the real engine cannot reach). Each option
    group may be given as a dict of its fields.
    ``on_handoff_failure``, ``kv_read``, ``expert_hosts``, ``expert_options``,
    ``attention_servers`` and ``attention_options``, the keywords those groups replace, are
    still read for this release, with a ``DeprecationWarning``."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    def __init__(
        self,
        model_factory: str = DEFAULT_MODEL,
        seed: int = 0,
        max_batch: int = 32,
        *,
        model_kwargs: dict[str, Any] | None = None,
        version: int = 0,
        eos_id: int | None = None,
        pad_id: int | None = None,
        max_seq_len: int | None = None,
        vocab_size: int | None = None,
        torch_threads: int | None = None,
        nice: int = 0,
        backend: BackendSpec | dict[str, Any] | str | None = None,
        checkpoint: str | None = None,
        engine: str | None = None,
        model: str | None = None,
        kv: KVOptions | dict[str, Any] | None = None,
        vllm: dict[str, Any] | None = None,
        kv_store: Any = None,
        handoff: HandoffOptions | dict[str, Any] | None = None,
        experts: ExpertOptions | dict[str, Any] | None = None,
        attention: AttentionOptions | dict[str, Any] | None = None,
        tp: int = 1,
        profile: str | None = None,
        **deprecated: Any,
    ) -> None:
        if model is not None and checkpoint not in (None, model):
            raise oc.ConfigError("give the checkpoint once: model= or checkpoint=")
        handoff, experts, attention = legacy_options(deprecated, handoff, experts, attention)
        if torch_threads is None and isinstance(tp, int) and tp > 1:
            torch_threads = max(1, torch.get_num_threads() // tp)
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self._threads = torch.get_num_threads()  # also where steps run (in_thread's threads)
        if nice:
            os.nice(nice)
        backend_ = choose_backend(backend)
        checkpoint = checkpoint or model
        # the engine, and the weights that syncs write into
        weights, engine_ = build_engine(
            backend_,
            model_factory,
            seed,
            max_batch,
            engine=engine,
            checkpoint=checkpoint,
            kv=as_options(KVOptions, kv, "kv"),
            vllm=vllm,
            model_kwargs=model_kwargs,
            version=version,
            eos_id=eos_id,
            pad_id=pad_id,
            max_seq_len=max_seq_len,
            vocab_size=vocab_size,
            tp=tp,
            profile=profile,
        )
        remote = [k for k, v in (("experts", experts), ("attention", attention)) if v is not None]
        if remote and (tp > 1 or engine == "sim"):
            engine_.close()
            raise oc.ConfigError(
                f"{', '.join(remote)} cannot be used with tp={tp} yet: they run whole "
                "layers or read the KV pool in place, and each rank holds a share"
                if tp > 1
                else f"{', '.join(remote)} run a model's layers: the simulated engine has none"
            )
        name = f"{self.mesh_name}[{self.rank}]"
        self._remote = RemoteParts(
            engine_,
            name,
            as_options(ExpertOptions, experts, "expert"),
            as_options(AttentionOptions, attention, "attention"),
        )
        self._engine = with_store(engine_, kv_store, checkpoint or model_factory)
        self._lock = asyncio.Lock()
        self._handoff = HandoffSide(
            self._engine,
            self._lock,
            as_options(HandoffOptions, handoff, "handoff") or HandoffOptions(),
        )
        self._weights = WeightSide(self._engine, weights, self._lock, self._threads, backend_)
        self._metrics = EngineMetrics(
            self._engine,
            extra=(self._handoff.holds.counts, self._handoff.counts),
            model_name=checkpoint or model_factory,
            engine_name=name,
        )
        self._wake = asyncio.Event()  # work may have appeared
        self._ready: deque[Completion] = deque()  # finished, for next_completed
        self._has_ready = asyncio.Event()
        self._claimed: dict[str, asyncio.Future[Completion]] = {}  # id -> generate() waiting
        self._abandoned: set[str] = set()  # ids of a cancelled generate() call
        self._task: asyncio.Task[None] | None = None  # the engine loop, held by _tasks
        self._tasks = TaskOwner()
        self._failure: BaseException | None = None
        self._closed = False
        self._token = secrets.token_hex(8)  # this incarnation, until the next reset
        self._streams = Streams()  # streamed requests, by reader

    # -- endpoints ---------------------------------------------------------------------------
    @oc.endpoint(concurrent=True)
    async def submit(
        self, requests: list[Any], stream: str | None = None, kv_from: dict[str, Any] | None = None
    ) -> None:
        """Queue requests (``Request`` or dicts of its fields); their completions arrive
        through :meth:`next_completed`, or, with ``stream`` (a reader's name), token by token
        through that reader's :meth:`updates`. ``kv_from`` maps request ids to handoffs of
        their prompts' KV from prefill generators (:meth:`prefill`), read before they are
        queued. Blocks on those reads and at most the step in progress. Raises
        ``ValueError`` for a bad request, and then queues none of them, and
        :class:`~orchestr.roles.HandoffError` for a handoff not read under ``handoff``'s
        ``on_failure="fail"``.

        Cancel-safe: the requests are queued, all of them, or none."""
        reqs = [as_request(r) for r in requests]
        if stream is not None:
            self._streams.reader(stream)
        self._ensure_running()
        async with self._handoff.entering(reqs, kv_from):
            if stream is not None:
                self._streams.add(stream, [r.id for r in reqs])
        self._wake.set()

    @oc.endpoint(concurrent=True)
    async def updates(self, stream: str, timeout_s: float | None = None) -> Updates:
        """What reader ``stream`` is owed (:class:`~orchestr.roles.Updates`): its requests'
        new tokens, the block events since its last call and the load now; as soon as there
        is news, else after ``timeout_s`` (``None``: no limit). The first call makes
        ``stream`` a reader. Blocks until news or ``timeout_s``; raises
        :class:`ClosedResourceError` when the generator closes and ``RuntimeError`` when its
        engine failed. Cancel-safe: a cancelled call takes nothing."""
        self._ensure_running()
        await self._streams.wait(stream, timeout_s, self._check_alive)
        u = self._streams.take(stream, self._engine)
        u.metrics.update(self._handoff.metrics())
        return u

    @oc.endpoint(concurrent=True)
    async def unsubscribe(self, stream: str) -> int:
        """Forget reader ``stream``: its requests still waiting or running are cancelled
        (their blocks freed); returns how many. Blocks at most for the step in progress;
        raises nothing; cancel-safe (a repeated call finishes the job)."""
        async with self._lock:
            return self._streams.remove(stream, self._engine)

    @oc.endpoint(concurrent=True)
    async def next_completed(
        self, max_n: int = 64, timeout_s: float | None = None, since: str | None = None
    ) -> list[Completion]:
        """Up to ``max_n`` completions in finishing order, as soon as at least one exists;
        ``[]`` after ``timeout_s`` (``None``: wait forever). With ``since`` (what
        :meth:`reset` last returned), ``[]`` at once when this generator is not that one
        any more (it was reset again, or restarted): a reader left over from before cannot
        take completions meant for the work given since. Cancel-safe: a cancelled call
        takes nothing.

        Blocks until a completion exists or ``timeout_s`` passes; raises
        :class:`ClosedResourceError` when the generator closes."""
        if max_n < 1:
            raise ValueError(f"max_n must be at least 1, got {max_n}")
        self._ensure_running()
        try:
            async with asyncio.timeout(timeout_s):
                while not self._ready or (since is not None and since != self._token):
                    if since is not None and since != self._token:
                        return []
                    self._has_ready.clear()
                    await self._has_ready.wait()
                    self._check_alive()
        except TimeoutError:
            return []
        out = [self._ready.popleft() for _ in range(min(max_n, len(self._ready)))]
        if self._ready:
            self._has_ready.set()  # leave the rest to other readers
        return out

    @oc.endpoint(concurrent=True)
    async def generate(
        self, requests: list[Any], kv_from: dict[str, Any] | None = None
    ) -> list[Completion]:
        """Submit ``requests`` and return their completions in request order, when all are
        done. They do not appear in :meth:`next_completed`. Cancelling the call cancels the
        requests still running. ``kv_from``: as :meth:`submit` takes it.

        Blocks until the last request has finished; raises ``ValueError`` for a bad request
        (none is queued), :class:`HandoffError` as :meth:`submit` does, :class:`ClosedResourceError` when the generator closes meanwhile and
        ``RuntimeError`` when it is reset."""
        reqs = [as_request(r) for r in requests]
        futures = await self._claim(reqs, kv_from)
        try:
            return [await f for f in futures.values()]
        finally:
            for rid in futures:
                # still claimed: not delivered (this call was cancelled, or another one failed)
                if self._claimed.pop(rid, None) is not None and self._failure is None:
                    self._abandoned.add(rid)
            self._wake.set()

    async def _claim(
        self, reqs: list[Request], kv_from: dict[str, Any] | None
    ) -> dict[str, asyncio.Future[Completion]]:
        """Queue ``reqs`` with a future each for its completion (not for next_completed)."""
        self._ensure_running()
        loop = asyncio.get_running_loop()
        async with self._handoff.entering(reqs, kv_from):
            futures = {r.id: loop.create_future() for r in reqs}
            self._claimed.update(futures)
        self._wake.set()
        return futures

    @oc.endpoint(concurrent=True)
    async def cancel(self, request_id: str) -> Completion:
        """Stop a waiting or running request; returns what it generated so far. Raises
        ``KeyError`` for an id that is neither.

        Blocks at most for the step in progress. Cancel-safe: the request is cancelled or not,
        and a repeated call says which."""
        self._ensure_running()
        async with self._lock:
            completion: Completion = self._engine.cancel(request_id)
            self._streams.drop(request_id)
            return completion

    @oc.endpoint(concurrent=True)
    async def reset(self) -> dict[str, Any]:
        """Drop every request (waiting, running, or finished and not yet read by
        :meth:`next_completed`) and forget which weights version is loaded, so the next
        :meth:`sync_weights` loads the version it is given, an older one included. A
        controller calls it on a generator that restarted, or on all of them when the trainer
        went back to a checkpoint. :meth:`generate` calls still waiting fail. Returns how many
        requests were dropped, and a new token for :meth:`next_completed`'s ``since``.

        Blocks on the step in progress; raises nothing. Cancel-safe only before it starts: once
        it runs, the requests are dropped."""
        self._ensure_running()
        async with self._lock:
            self._token = secrets.token_hex(8)
            self._has_ready.set()  # waiting readers look at the token again
            self._streams.dropping(self._engine.request_ids())
            dropped = self._engine.drop_all() + len(self._ready)
            self._ready.clear()
            self._abandoned.clear()
            await self._weights.forget()
            claimed, self._claimed = self._claimed, {}
        for future in claimed.values():
            if not future.done():
                future.set_exception(RuntimeError("the generator was reset: request dropped"))
        log.info("reset", dropped=dropped)
        return {"dropped": dropped, "token": self._token}

    @oc.endpoint(concurrent=True)
    async def pause(self) -> None:
        """Stop stepping after the step in progress (returns when it has ended). Running
        requests keep their tokens and continue after :meth:`resume`. Idempotent.

        Blocks on the step in progress; raises nothing; cancel-safe (the pause holds either way)."""
        self._ensure_running()
        async with self._lock:
            self._engine.pause()

    @oc.endpoint(concurrent=True)
    async def resume(self) -> None:
        """Continue stepping under the current weights. Idempotent. Blocks on nothing;
        raises nothing; cancel-safe."""
        self._ensure_running()
        async with self._lock:
            self._engine.resume()
        self._wake.set()

    @oc.endpoint(concurrent=True)
    async def stats(self) -> dict[str, Any]:
        """The engine's counters plus ``ready`` (completions waiting for next_completed),
        the KV handoffs' counters and ``held`` (their leases held here now). Blocks on
        nothing; raises nothing; cancel-safe."""
        async with self._lock:
            handoffs = {**self._handoff.metrics(), "held": self._handoff.holds.leases}
            out = {
                **dataclasses.asdict(self._engine.stats()),
                "ready": len(self._ready),
                **handoffs,
            }
            out |= self._remote.stats()
            return out

    @oc.endpoint(concurrent=True)
    async def aclose(self) -> None:
        """Cancel the engine loop (after its step in progress) and fail waiting calls with
        ``ClosedResourceError``. Idempotent. Blocks on the step in progress; raises nothing."""
        self._closed = True
        self._task = None
        await self._tasks.aclose()
        await close_store(self._engine)
        await self._handoff.aclose()
        self._engine.close()
        self._fail_waiters(oc.ClosedResourceError("the generator was closed"))

    # -- weights (WeightSide) -----------------------------------------------------------------
    @oc.endpoint(concurrent=True)
    async def load_weights(self, state: dict[str, Any], version: int) -> None:
        """Load a state dict whose values are tensors or :class:`orchestr.Buffer` handles
        (read into staging tensors shaped like the model's, before anything is copied) and
        make ``version`` current. Tokens of the next step carry it; pause first for a clean
        cut. Raises ``ValueError`` if the state does not fit (weights unchanged).

        Blocks on the reads and the step in progress. A cancellation during the reads applies
        nothing; once the copy runs (in a worker thread) it finishes, and ``version`` becomes
        current although the call was cancelled."""
        self._ensure_running()
        await self._weights.load(state, version)

    @oc.endpoint(concurrent=True)
    async def sync_weights(self, ref: AnyWeightsRef) -> dict[str, Any]:
        """Load the version ``ref`` names straight from its publisher's buffers (bucketed
        reads over the data plane, each bucket's checksum verified before anything is copied)
        and make it current. Blocks on the step in progress (waits for it to end); requests
        in flight keep going under the new weights, their next tokens carrying the new version.

        Returns ``version``, ``loaded`` (False when that version was already current),
        ``seconds`` (the load itself), ``wait_s`` (for the step in progress before it),
        ``bytes`` and the ``transports`` the reads used. Raises the loader's errors
        (:class:`StaleWeightsError`, :class:`ChecksumMismatchError`...), weights unchanged.

        Cancel-safe: the reads are checked before the copy, and the copy runs without a pause,
        so a cancelled call loaded all of the version or none of it."""
        self._ensure_running()
        return await self._weights.sync(ref)

    @oc.endpoint(concurrent=True)
    async def digest(self) -> dict[str, Any]:
        """The weights' digest (equal to the trainer's when bitwise equal) and version.
        Blocks on hashing the weights (between steps); raises nothing; cancel-safe."""
        return await self._weights.digest()

    # -- KV handoffs (HandoffSide) -------------------------------------------------------------
    @oc.endpoint(concurrent=True)
    async def prefill(self, request: Any, hold_s: float = 10.0, stream: bool = False) -> Handoff:
        """Compute ``request``'s prompt here and hold its KV blocks for ``hold_s`` seconds,
        for a decode generator to read: returns the :class:`~orchestr.roles.Handoff` (name
        this generator's one-actor mesh with ``handoff.sent_from(mesh)`` and pass it to the
        decode generator's :meth:`submit` as ``kv_from={request.id: handoff}``). The prompt
        runs as one greedy token (the decode side samples the request's own). The lease ends
        when the reader ends it, or expires. With ``stream``, the handoff is returned as soon
        as the request is queued and the reader takes the blocks layer by layer as they are
        computed (:mod:`._kv._streamed`); the lease's ``hold_s`` counts from the prompt's end.

        Blocks until the prompt is computed (with ``stream``, until it is queued); raises
        ``ValueError`` for a bad request and :class:`ConfigError` on an engine without a
        paged KV cache. Cancel-safe: cancelled, the request is cancelled, and a lease granted
        meanwhile expires."""
        engine = self._handoff.paged("prefill hands off KV blocks of the paged engine")
        r = prefill_request(as_request(request))
        if not stream:
            return await self._handoff.prefill(r, float(hold_s), self.generate)
        if (tp := self._weights.weights.tp) > 1:
            raise oc.ConfigError(
                "a streamed handoff is read from the pool as it is written; a split model's "
                f"pool is in {tp} processes: hand off without stream"
            )
        if not hold_s > 0:
            raise ValueError(f"hold_s must be positive, got {hold_s!r}")
        self._ensure_running()
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        async with self._handoff.entering([r], None):  # queued and streamed before any step
            handoff = self._handoff.holds.stream(engine, r, float(hold_s))
            self._claimed[r.id] = future
        self._wake.set()
        self._handoff.follow(engine, r.id, future)
        return handoff

    @oc.endpoint(concurrent=True)
    async def handoff_progress(
        self, lease: int, after: int = -1, until_done: bool = False
    ) -> dict[str, Any]:
        """How far the streamed handoff ``lease`` has come, once past cursor ``after`` (with
        ``until_done``, once it is done or failed): ``cursor``, ``state`` (``"running"``,
        ``"done"`` or ``"failed"``), ``blocks`` (its full prompt blocks so far), ``ready``
        (of those, the ones done in every layer), ``written`` (layers done of the rest),
        ``layers``, ``keys`` (when done), ``error`` and ``buffer`` (the handoff's buffer as it
        is now, reaching every block named; read through it, ``None`` once revoked). Blocks
        until there is news; raises :class:`LeaseExpiredError` for a stream not here;
        cancel-safe."""
        return await self._handoff.holds.streamed.wait(lease, after, until_done)

    @oc.endpoint(concurrent=True)
    async def end_handoff(self, lease: int) -> None:
        """Release a handoff's blocks after reading them; raises
        :class:`LeaseExpiredError` if it had expired first (what was read must not be
        used). Answers at once, a step running or not: the blocks return to the pool between
        steps. Cancel-safe."""
        self._handoff.end(lease)

    @oc.endpoint(concurrent=True)
    async def release_handoff(self, lease: int) -> bool:
        """Release a handoff's blocks unread (idempotent); whether it was still held.
        Blocks on the step in progress; raises nothing; cancel-safe."""
        async with self._lock:
            held, running = self._handoff.release(lease)
            future = None if running is None else self._claimed.pop(running, None)
            if future is not None:
                future.cancel()
            return held

    # -- experts on other actors (RemoteParts) ---------------------------------------------------
    @oc.endpoint(concurrent=True)
    async def route_experts(self, holders: dict[int, list[list[int]]] | None = None) -> None:
        """Route the sparse layers' experts by ``holders`` (``[layer][expert]``: host ranks;
        ``None``: ask the hosts) from the next engine step on: a rebalance's switch. Blocks on
        the step in progress. Raises :class:`~orchestr.ConfigError` without expert hosts and
        :class:`~orchestr.roles.ExpertUnavailableError` for a map that leaves an expert
        without a host (the old one stays). Cancel-safe: the switch is made or not."""
        if self._remote.experts is None:
            raise oc.ConfigError("this generator has no expert hosts (experts=)")
        async with self._lock:
            await self._remote.route(holders)

    # -- the engine loop ---------------------------------------------------------------------
    def _ensure_running(self) -> None:
        self._check_alive()
        if self._task is None:
            self._task = self._tasks.start(self._serve(), name="generator engine loop")

    def _check_alive(self) -> None:
        if self._closed:
            raise oc.ClosedResourceError("the generator was closed (aclose); spawn a new one")
        if self._failure is not None:
            raise self._failed()

    def _failed(self) -> RuntimeError:
        failure = f"the generator's engine failed in a step: {self._failure!r:.300}"
        err = RuntimeError(f"{failure}; its worker exits to be restarted (in-process: spawn anew)")
        err.__cause__ = self._failure
        return err

    async def _serve(self) -> None:
        try:
            while True:
                if not self._engine.has_work() and not self._abandoned:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                async with self._lock:
                    for rid in self._abandoned:
                        with contextlib.suppress(KeyError):  # it may have finished meanwhile
                            self._engine.cancel(rid)
                    self._abandoned.clear()
                    finished = await in_thread(self._engine.step, threads=self._threads)
                    self._metrics.publish()
                    self._handoff.after_step(finished)
                    finished = self._streams.after_step(self._engine, finished)
                for c in finished:
                    future = self._claimed.pop(c.id, None)
                    if future is not None and not future.done():
                        future.set_result(c)
                    elif future is None and c.id in self._abandoned:  # its call went meanwhile
                        self._abandoned.discard(c.id)
                    elif future is None:
                        self._ready.append(c)
                        self._has_ready.set()
        except Exception as exc:  # a model error: nothing can continue; say so to every caller
            tb = traceback.format_exc()  # as text: a renderer of locals would print prompts
            log.error("generator engine failed in a step; its requests end", traceback=tb)
            self._failure = exc
            self._fail_waiters(self._failed())
            with contextlib.suppress(RuntimeError):  # in this process: it stays failed
                # a fresh worker, by the restart policy: the pool may be inconsistent (0016)
                self.crash_worker(f"the engine failed in a step: {type(exc).__name__}")

    def _fail_waiters(self, exc: BaseException) -> None:
        for future in self._claimed.values():
            if not future.done():
                future.set_exception(exc)
        self._claimed.clear()
        self._has_ready.set()  # next_completed() callers wake and raise
        self._streams.wake_all()  # updates() callers wake and raise
