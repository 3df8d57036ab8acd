"""A generator's link to a :class:`~orchestr.roles.KVStore`: the blocks that enter its prefix
cache are offloaded to the store, and a prompt's prefix that the store holds past what is
cached here is onboarded from it instead of being computed again.

:class:`StoreEngine` is the paged engine with the link attached; it keeps the engine's
contract, so the generator drives it as it drives any engine:

- **offload**: after each step (in the step's thread) the blocks that entered the prefix
  cache are copied out and queued; a task puts them into the store (one put per step:
  reserve, one-sided writes into the store's memory, publish; the steps queued while a put
  was in flight go as one). Past ``max_queued`` blocks
  waiting, new ones are dropped and counted: the store is a cache, never a brake on steps.
- **onboard**: :meth:`StoreEngine.fetch`, awaited before the requests are submitted, looks
  up each prompt's blocks past the local prefix in the store and reads the stored run (a
  lease, one-sided reads, the lease checked). :meth:`StoreEngine.submit` then enters them into
  the prefix cache, so the scheduler finds them as prefix hits and computes only the rest.
  A failed read costs nothing but the recompute (counted).

Blocks live in the store under the engine's block keys in the namespace ``(model, block
size, weights version)``: a block of other weights never answers.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import structlog
import torch

import orchestr as oc
from orchestr.roles._common._hf._config import read_config
from orchestr.roles.kvstore import KVNamespace, KVWriter, get_blocks, put_blocks
from orchestr.tasks import TaskOwner

from .._core._contract import Engine, PagedKV
from .._core._types import Completion, Request
from .._engines._forwarding import Forwarding

__all__ = ["StoreEngine", "close_store", "fetch_stored", "kv_block_bytes", "with_store"]

log = structlog.get_logger("orchestr.roles.generator")

#: Blocks fetched for a request: (prompt keys, index of the first fetched one, their data, when).
Fetched = tuple[list[bytes], int, list[torch.Tensor], float]
#: Seconds fetched blocks wait for their request's submit before they are dropped.
FETCHED_S = 30.0
#: At most this many blocks are joined into one put (more may come with the first step's).
MAX_PUT = 256


class StoreEngine(Forwarding):
    """``engine`` (a :class:`~.._core._contract.PagedKV`) whose prefix cache is backed by ``store`` (a
    one-actor mesh of :class:`~orchestr.roles.KVStore` with blocks of the engine's
    :attr:`~.._core._contract.PagedKV.block_nbytes`, or a :class:`~orchestr.roles.kvstore.KVWriter`
    to put and read as that writer). ``model`` names the weights in the store's namespace.
    It changes :meth:`submit`, :meth:`step` and :meth:`metrics`; the rest is forwarded."""

    def __init__(self, engine: PagedKV, store: Any, model: str, *, max_queued: int = 1024) -> None:
        super().__init__(engine)
        self.store = store
        self.model = model
        self.max_queued = max_queued
        engine.keep_offload(True)
        self._fetched: dict[str, Fetched] = {}
        self._queue: deque[tuple[KVNamespace, list[bytes], list[torch.Tensor]]] = deque()
        self._queued = 0
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None  # the offloading one, held by _tasks
        self._tasks = TaskOwner()
        self.counts = {
            "orchestr:kv_store_offloaded_blocks": 0,  # new in the store
            "orchestr:kv_store_puts": 0,  # puts made (one per step, or fewer when behind)
            "orchestr:kv_store_offload_dropped_blocks": 0,  # queue full, or the put failed
            "orchestr:kv_store_onboarded_tokens": 0,
            "orchestr:kv_store_onboard_failures": 0,
        }

    def _namespace(self, version: int) -> KVNamespace:
        return KVNamespace(self.model, self.inner.cache_keys()[0], version)

    # -- onboarding -------------------------------------------------------------------------
    async def fetch(self, requests: list[Request]) -> None:
        """Read from the store the blocks of each request's prompt that are past the prefix
        cached here, for :meth:`submit` to enter. Blocks on the store's calls and reads;
        raises nothing (a failure is counted and the blocks are computed); cancel-safe (a
        cancelled fetch leaves its lease to expire)."""
        self._loop = asyncio.get_running_loop()
        for r in requests:
            keys, local = self.inner.prefix_plan(r.prompt)  # a hint: checked again on entry
            if local >= len(keys):
                continue
            size = self.inner.block_nbytes
            out = [torch.empty(size, dtype=torch.uint8) for _ in keys[local:]]
            try:
                n = await get_blocks(
                    self.store, self._namespace(self.inner.version), keys[local:], out
                )
            except Exception as exc:
                self.counts["orchestr:kv_store_onboard_failures"] += 1
                log.warning("reading blocks from the KV store failed", error=str(exc))
                continue
            if n:
                self._fetched[r.id] = (keys, local, out[:n], time.monotonic())
        stale = time.monotonic() - FETCHED_S  # fetched for a call cancelled before its submit
        for rid in [rid for rid, f in self._fetched.items() if f[3] < stale]:
            del self._fetched[rid]

    def submit(self, requests: Iterable[Request]) -> None:
        """The engine's :meth:`~.._core._contract.Engine.submit`, after entering what :meth:`fetch`
        read for these requests into the prefix cache."""
        requests = list(requests)
        for r in requests:
            fetched = self._fetched.pop(r.id, None)
            if fetched is not None:
                keys, start, data, _ = fetched
                tokens = self.inner.adopt(r.prompt, keys, start, data)
                self.counts["orchestr:kv_store_onboarded_tokens"] += tokens
        self.inner.submit(requests)

    # -- offloading -------------------------------------------------------------------------
    def step(self) -> list[Completion]:
        """One engine step, then the copies of the blocks it cached handed to the offload
        task (this runs in the step's thread)."""
        done = self.inner.step()
        version, keys, copies = self.inner.take_offload()
        if keys and self._loop is not None:
            self._loop.call_soon_threadsafe(self._enqueue, self._namespace(version), keys, copies)
        return done

    def _enqueue(self, ns: KVNamespace, keys: list[bytes], copies: list[torch.Tensor]) -> None:
        if self._queued + len(keys) > self.max_queued or self._tasks.closed:
            self.counts["orchestr:kv_store_offload_dropped_blocks"] += len(keys)
            return
        self._queue.append((ns, keys, copies))
        self._queued += len(keys)
        self._wake.set()
        if self._task is None:
            self._task = self._tasks.start(self._offload(), name="KV store offload")

    async def _offload(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            ns, keys, copies = self._queue.popleft()
            # what several steps queued meanwhile goes as one put: the store answers fewer
            # calls when it falls behind
            while self._queue and self._queue[0][0] == ns and len(keys) < MAX_PUT:
                _, more, data = self._queue.popleft()
                keys, copies = keys + more, copies + data
            self.counts["orchestr:kv_store_puts"] += 1
            try:
                new = await put_blocks(self.store, ns, keys, copies)
                self.counts["orchestr:kv_store_offloaded_blocks"] += new
            except Exception as exc:
                self.counts["orchestr:kv_store_offload_dropped_blocks"] += len(keys)
                log.warning("offloading blocks to the KV store failed", error=str(exc))
            finally:
                self._queued -= len(keys)

    def metrics(self) -> dict[str, Any]:
        return {**self.inner.metrics(), **self.counts}

    async def aclose(self) -> None:
        """Stop offloading (what is queued is dropped). Idempotent; raises nothing."""
        self._task = None
        await self._tasks.aclose()


def with_store(engine: Engine, store: Any, model: str) -> Engine:
    """``engine`` backed by ``store`` (``None``: ``engine`` as it is; a
    :class:`~orchestr.roles.kvstore.KVWriter` to write with its key). Raises
    :class:`ConfigError` for an engine without a paged prefix cache or a store that is not a
    one-actor mesh."""
    if store is None:
        return engine
    if not isinstance(engine, PagedKV):
        raise oc.ConfigError(
            f"a KV store backs the paged engine's prefix cache; this generator runs "
            f"{type(engine).__name__}"
        )
    mesh = store.store if isinstance(store, KVWriter) else store
    if not isinstance(mesh, oc.Mesh) or len(mesh) != 1:
        raise oc.ConfigError(f"kv_store is a KVStore mesh of one actor, got {store!r}")
    return StoreEngine(engine, store, model)


async def fetch_stored(engine: Engine, requests: list[Request]) -> None:
    """:meth:`StoreEngine.fetch` when ``engine`` is backed by a store."""
    if isinstance(engine, StoreEngine):
        await engine.fetch(requests)


async def close_store(engine: Engine) -> None:
    """:meth:`StoreEngine.aclose` when ``engine`` is backed by a store."""
    if isinstance(engine, StoreEngine):
        await engine.aclose()


def kv_block_bytes(
    checkpoint: str,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    *,
    engine: str = "paged",
) -> int:
    """The bytes of one KV block of ``checkpoint``'s model in the paged engine (``block_size``
    tokens, every layer's keys and values in ``dtype``), or in the simulated one
    (``engine="sim"``, whose pool a stand-in model sizes): the ``block_bytes`` of a
    :class:`~orchestr.roles.KVStore` its generators share. Raises :class:`ConfigError` for a
    config orchestr cannot run."""
    cfg = read_config(checkpoint)
    if engine == "sim":
        from .._engines._sim import stand_in_config

        cfg = stand_in_config(cfg)
    per_token = cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    return 2 * cfg.num_hidden_layers * block_size * per_token
