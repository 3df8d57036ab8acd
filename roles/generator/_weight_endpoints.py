"""The :class:`~orchestr.roles.Generator`'s weights endpoints: loads from a state dict or
from a trainer's published version, and the digest that proves two copies equal (a mixin over
the generator's engine, weights, loader and lock)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog

import orchestr as oc
from orchestr.roles._common._backend import Backend
from orchestr.roles._common._weights import WeightLoader, WeightsRef

from ._build import in_thread, read_staged

__all__ = ["WeightEndpoints"]

log = structlog.get_logger("orchestr.roles.generator")


class WeightEndpoints:
    _engine: Any
    _weights: Any
    _loader: WeightLoader
    _lock: asyncio.Lock
    _threads: int
    _rewind: bool
    _backend: Backend

    _ensure_running: Callable[[], None]

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
        tensors = await read_staged(self._weights.shapes(), state)
        async with self._lock:
            await in_thread(self._engine.load_weights, tensors, version, threads=self._threads)
        log.info("weights loaded", version=version)

    @oc.endpoint(concurrent=True)
    async def sync_weights(self, ref: WeightsRef) -> dict[str, Any]:
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
        if not isinstance(ref, WeightsRef):
            raise TypeError(f"sync_weights takes a WeightsRef, got {type(ref).__name__}")
        asked = time.perf_counter()
        async with self._lock:
            t0 = time.perf_counter()
            loaded = await self._weights.sync(self._loader, ref)
            self._engine.set_version(ref.version, rewind=self._rewind)
            self._rewind = False
        seconds = time.perf_counter() - t0
        log.info("weights synced", version=ref.version, loaded=loaded, seconds=seconds)
        return {"version": ref.version, "loaded": loaded, "seconds": seconds, "wait_s": t0 - asked,
                "bytes": ref.nbytes, "transports": sorted(self._loader.transports)}  # fmt: skip

    @oc.endpoint(concurrent=True)
    async def digest(self) -> dict[str, Any]:
        """The weights' digest (equal to the trainer's when bitwise equal) and version.
        Blocks on hashing the weights (between steps); raises nothing; cancel-safe."""
        async with self._lock:
            digest, version = self._weights.digest(), self._engine.version
        return {"digest": digest, "version": version, "backend": self._backend.describe()}
