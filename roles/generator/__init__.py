"""The generator role: a continuous-batching engine (``_engine``, sans-IO) and the actor around
it (``_actor``), which streams completions and loads new weights from a trainer."""

from ._actor import Generator
from ._engine import Engine
from ._handoff import HandoffError
from ._kvlink import kv_block_bytes
from ._paged_engine import PagedEngine
from ._types import Completion, EngineStats, Request, TokenDelta, Updates

__all__ = [
    "Completion",
    "Engine",
    "EngineStats",
    "Generator",
    "HandoffError",
    "PagedEngine",
    "Request",
    "TokenDelta",
    "Updates",
    "kv_block_bytes",
]
