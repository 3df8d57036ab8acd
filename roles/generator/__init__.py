"""The generator role: a continuous-batching engine (``_engine``, sans-IO) and the actor around
it (``_actor``), which streams completions and loads new weights from a trainer.
:class:`Scheduler` (over a :class:`BlockPool`) is the paged engine's sans-IO scheduler, public
so the simulator (``orchestr.sim``) runs it on virtual time."""

from ._actor import Generator
from ._blocks import BlockPool
from ._engine import Engine
from ._handoff import HandoffError
from ._kvlink import kv_block_bytes
from ._paged_engine import PagedEngine
from ._scheduler import Scheduler, Seq, Step
from ._types import Completion, EngineStats, Request, TokenDelta, Updates

__all__ = [
    "BlockPool",
    "Completion",
    "Engine",
    "EngineStats",
    "Generator",
    "HandoffError",
    "PagedEngine",
    "Request",
    "Scheduler",
    "Seq",
    "Step",
    "TokenDelta",
    "Updates",
    "kv_block_bytes",
]
