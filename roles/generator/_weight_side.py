"""A :class:`~orchestr.roles.Generator`'s weights: loads from a state dict or from a trainer's
published version, and the digest that proves two copies equal. The generator's weight
endpoints delegate here."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from orchestr.roles._common._backend import Backend
from orchestr.roles._common._weightref import AnyWeightsRef, ShardedWeightsRef, WeightsRef
from orchestr.roles._common._weights import WeightLoader

from ._core._contract import Engine
from ._engines._build import Weights, in_thread, read_staged

__all__ = ["WeightSide"]

log = structlog.get_logger("orchestr.roles.generator")


class WeightSide:
    """Loads into ``weights`` (where ``engine``'s model lives) under ``lock``, copies in a
    thread of ``threads`` torch threads; ``backend`` is what the digest reports."""

    def __init__(
        self, engine: Engine, weights: Weights, lock: asyncio.Lock, threads: int, backend: Backend
    ) -> None:
        self.engine, self.weights, self.lock = engine, weights, lock
        self.threads, self.backend = threads, backend
        self.loader = WeightLoader(double_buffer=not backend.compiled)
        self.rewind = False  # reset: the next weights may be older than the current ones

    async def load(self, state: dict[str, Any], version: int) -> None:
        """``Generator.load_weights``: read, then copy under the lock."""
        tensors = await read_staged(self.weights.shapes(), state)
        async with self.lock:
            await in_thread(self.engine.load_weights, tensors, version, threads=self.threads)
        log.info("weights loaded", version=version)

    async def sync(self, ref: AnyWeightsRef) -> dict[str, Any]:
        """``Generator.sync_weights``: load ``ref`` under the lock and make it current."""
        if not isinstance(ref, WeightsRef | ShardedWeightsRef):
            raise TypeError(
                f"sync_weights takes a WeightsRef or ShardedWeightsRef, got {type(ref).__name__}"
            )
        asked = time.perf_counter()
        async with self.lock:
            t0 = time.perf_counter()
            loaded = await self.weights.sync(self.loader, ref)
            self.engine.set_version(ref.version, rewind=self.rewind)
            self.rewind = False
        seconds = time.perf_counter() - t0
        log.info("weights synced", version=ref.version, loaded=loaded, seconds=seconds)
        return {
            "version": ref.version,
            "loaded": loaded,
            "seconds": seconds,
            "wait_s": t0 - asked,
            "bytes": ref.nbytes,
            "transports": sorted(self.loader.transports),
        }

    async def digest(self) -> dict[str, Any]:
        """``Generator.digest``: hashed between steps."""
        async with self.lock:
            digest, version = self.weights.digest(), self.engine.version
        return {"digest": digest, "version": version, "backend": self.backend.describe()}

    async def forget(self) -> None:
        """A reset: forget which version is loaded, so the next may be older."""
        await self.loader.forget()
        self.rewind = True
