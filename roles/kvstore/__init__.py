"""The KV store role: content-addressed KV blocks shared between generators.

:class:`BlockIndex` is its sans-IO core: blocks keyed by the generator's chained block hashes
under a :class:`KVNamespace`, two-phase puts, leases, pins, tiers (host memory, local disk) with
watermark eviction and demotion, and a numbered event stream. :class:`KVStore` is the actor
around it, holding the blocks in host memory (and a disk file) that writers and readers reach
one-sided, each put and lease through a buffer over its own slots only: :func:`put_blocks`,
:func:`get_blocks`. A namespace belongs to its first writer: :class:`KVWriter` names one.
"""

from ._actor import KVStore
from ._client import KVWriter, get_blocks, put_blocks
from ._index import BlockIndex
from ._types import (
    BlockLocation,
    Cleared,
    EventPage,
    KVNamespace,
    KVStoreError,
    Lease,
    LeaseExpiredError,
    Match,
    Move,
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
    "KVNamespace",
    "KVStore",
    "KVStoreError",
    "KVWriter",
    "Lease",
    "LeaseExpiredError",
    "Match",
    "Move",
    "Put",
    "Removed",
    "StoreEvent",
    "Stored",
    "Tier",
    "get_blocks",
    "put_blocks",
]
