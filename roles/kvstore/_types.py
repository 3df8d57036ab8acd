"""The KV store's vocabulary: namespaces, tiers, the handles its index hands out (puts, leases,
moves) and the events it emits. Plain data, no I/O."""

from __future__ import annotations

import dataclasses

from orchestr import register
from orchestr.errors import OrchestrError

__all__ = [
    "BlockLocation",
    "Cleared",
    "EventPage",
    "KVNamespace",
    "KVStoreError",
    "Lease",
    "LeaseExpiredError",
    "Match",
    "Move",
    "Put",
    "Removed",
    "StoreEvent",
    "Stored",
    "Tier",
]


class KVStoreError(OrchestrError):
    """A KV store request cannot be served; the message says why and what to do."""


class LeaseExpiredError(KVStoreError):
    """A lease ran out or was released before its reader finished: what was read may have been
    overwritten and must be discarded."""


@register
@dataclasses.dataclass(frozen=True)
class KVNamespace:
    """What a block's bytes depend on besides its tokens. Blocks of one namespace never answer
    for another's, even under an equal hash: another model, block size, weight version or
    cache salt computes other keys and values."""

    __module__ = "orchestr.roles"  # its name on the wire (pinned)

    model: str
    block_size: int
    weight_version: int = 0
    salt: str = ""
    # every block key hashes its namespace: computed once, not per lookup
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"a namespace names its model (a string), got {self.model!r:.40}")
        if not isinstance(self.salt, str):
            raise ValueError(f"salt must be a string, got {self.salt!r:.40}")
        for name in ("block_size", "weight_version"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r:.40}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1 token, got {self.block_size}")
        if self.weight_version < 0:
            raise ValueError(f"weight_version must be >= 0, got {self.weight_version}")
        fields = (self.model, self.block_size, self.weight_version, self.salt)
        object.__setattr__(self, "_hash", hash(fields))

    def __hash__(self) -> int:
        return self._hash


@dataclasses.dataclass(frozen=True)
class Tier:
    """A level of storage with room for ``blocks`` blocks (the store's first tier is the one
    readers read from: host memory; later ones are slower: local disk)."""

    name: str
    blocks: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tier has a name")
        if self.blocks < 1:
            raise ValueError(f"tier {self.name!r} needs room for at least one block")


@dataclasses.dataclass(frozen=True)
class BlockLocation:
    """Where one block's bytes are: ``slot`` of ``tier`` (the shell maps slots to memory or
    file offsets)."""

    block_hash: bytes
    tier: str
    slot: int


@dataclasses.dataclass(frozen=True)
class Put:
    """The first half of a two-phase put: write each block's bytes into its location, then
    :meth:`BlockIndex.end_put`. ``skipped`` blocks need no write (stored already, or being
    written by another put); ``dropped`` is how many of the tail found no room."""

    id: int
    namespace: KVNamespace
    writes: tuple[BlockLocation, ...]
    skipped: int
    dropped: int


@dataclasses.dataclass(frozen=True)
class Move:
    """A copy the shell makes between tiers (a demotion, or a promotion for a lease), then
    reports with :meth:`BlockIndex.moved`. Until then the source stays where it is."""

    id: int
    namespace: KVNamespace
    block_hash: bytes
    source: BlockLocation
    target: BlockLocation


@dataclasses.dataclass(frozen=True)
class Lease:
    """Blocks a reader may read until ``expires`` (the index's clock): the longest stored
    prefix of what was asked, each in the first tier. ``moves`` (promotions from a slower
    tier) must be done before those blocks are read."""

    id: int
    namespace: KVNamespace
    blocks: tuple[BlockLocation, ...]
    moves: tuple[Move, ...]
    expires: float

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.namespace.block_size


@dataclasses.dataclass(frozen=True)
class Match:
    """The longest stored prefix of a request's blocks: ``tokens`` in all, and per tier how
    many of those tokens have a copy there."""

    tokens: int
    by_tier: dict[str, int]


@dataclasses.dataclass(frozen=True)
class Stored:
    """Blocks got a copy in ``tier``."""

    namespace: KVNamespace
    block_hashes: tuple[bytes, ...]
    tier: str


@dataclasses.dataclass(frozen=True)
class Removed:
    """Blocks lost their copy in ``tier`` (evicted, demoted away or removed)."""

    namespace: KVNamespace
    block_hashes: tuple[bytes, ...]
    tier: str


@dataclasses.dataclass(frozen=True)
class Cleared:
    """Every block's copy in ``tier`` is gone at once."""

    tier: str


StoreEvent = Stored | Removed | Cleared


@dataclasses.dataclass(frozen=True)
class EventPage:
    """Events after a sequence number, oldest first, as ``(seq, event)``; ``last`` is the
    number to ask after next time. ``lost`` is true when some that were asked for are no
    longer kept: the consumer resynchronises from :meth:`BlockIndex.snapshot` and goes on
    from the sequence number it gives."""

    events: tuple[tuple[int, StoreEvent], ...]
    last: int
    lost: bool
