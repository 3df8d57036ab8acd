"""What the router is fed: a generator's block events as its
:class:`~orchestr.roles.Updates` carry them, and a KV store's event feed, followed by a task
of the front door's (:func:`follow_store`)."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from ..generator._core._blocks import AllBlocksCleared, BlockRemoved, BlockStored
from ..kvstore._types import Cleared, Removed, Stored, StoreEvent
from ._router import Router

__all__ = ["follow_store", "store_event", "worker_event"]

log = structlog.get_logger("orchestr.roles.serving")


def worker_event(kind: str, hashes: list[bytes]) -> Any:
    """A generator's block event as :class:`~orchestr.roles.Updates` carries it."""
    if kind == "stored":
        return BlockStored(hashes, None, [], 0)
    if kind == "removed":
        return BlockRemoved(hashes)
    return AllBlocksCleared()


def store_event(row: list[Any]) -> StoreEvent:
    """A KV store's event as its ``events`` endpoint gives it."""
    _, kind, namespace, hashes, tier = row
    if kind == "stored":
        return Stored(namespace, tuple(hashes), tier)
    if kind == "removed":
        return Removed(namespace, tuple(hashes), tier)
    return Cleared(tier)


#: Seconds between reads of the KV store's events.
STORE_POLL_S = 0.1
#: Seconds before a store that could not be read is asked again.
STORE_RETRY_S = 1.0


async def follow_store(store: Any, router: Router) -> None:
    """Read ``store``'s events (a :class:`~orchestr.roles.KVStore` mesh) into ``router``
    every :data:`STORE_POLL_S`, until cancelled. Events it no longer has, or a store that
    cannot be reached, make the router forget the store (no hit is counted that may not be
    there) and read it again from its start. Blocks forever; raises nothing but
    cancellation."""
    after = 0
    while True:
        try:
            page = await store.events.call_one(after)
        except Exception as exc:
            log.warning("the KV store's events cannot be read", error=repr(exc)[:200])
            router.forget_store()
            after = 0
            await asyncio.sleep(STORE_RETRY_S)
            continue
        if page["lost"]:
            router.forget_store()
        router.apply_store([store_event(row) for row in page["events"]])
        after = page["last"]
        await asyncio.sleep(STORE_POLL_S)
