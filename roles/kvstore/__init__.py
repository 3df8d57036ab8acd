"""The KV store role: content-addressed KV blocks shared between generators.

:class:`BlockIndex` is its sans-IO core: blocks keyed by the generator's chained block hashes
under a :class:`Namespace`, two-phase puts, leases, pins, tiers (host memory, local disk) with
watermark eviction and demotion, and a numbered event stream.
"""

from ._index import BlockIndex
from ._types import (
    BlockLocation,
    Cleared,
    EventPage,
    KVStoreError,
    Lease,
    LeaseExpiredError,
    Match,
    Move,
    Namespace,
    Put,
    Removed,
    Stored,
    StoreEvent,
    Tier,
)

__all__ = [
    "BlockIndex",
    "BlockLocation",
    "Cleared",
    "EventPage",
    "KVStoreError",
    "Lease",
    "LeaseExpiredError",
    "Match",
    "Move",
    "Namespace",
    "Put",
    "Removed",
    "StoreEvent",
    "Stored",
    "Tier",
]
