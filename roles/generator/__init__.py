"""The generator role: continuous-batching engines and the actor around them
(:class:`Generator`), which streams completions and loads new weights from a trainer.
:class:`Engine` and :class:`PagedKV` name the contract every engine keeps
(:class:`RecomputeEngine`, :class:`PagedEngine`, vLLM's) and what a paged one lends to the code
that moves KV blocks between engines.
:class:`Scheduler` (over a :class:`BlockPool`) is the paged engine's sans-IO scheduler, public
so the simulator (``orchestr.sim``) runs it on virtual time; :class:`StepTimeModel` prices its
steps, for the simulator and for the simulated engine (``Generator(engine="sim")``)."""

from ._actor import Generator
from ._core._blocks import BlockPool
from ._core._contract import Engine, PagedKV
from ._core._options import AttentionOptions, ExpertOptions, HandoffOptions, KVOptions
from ._core._scheduler import Scheduler, Seq, Step
from ._core._steptime import TERMS as STEP_TERMS
from ._core._steptime import StepTimeModel, attention_pairs, step_features
from ._core._types import Completion, EngineStats, Handoff, Request, TokenDelta, Updates
from ._engines._paged import PagedEngine
from ._engines._recompute import RecomputeEngine
from ._kv._receive import HandoffError
from ._kv._store_link import kv_block_bytes

__all__ = [
    "STEP_TERMS",
    "AttentionOptions",
    "BlockPool",
    "Completion",
    "Engine",
    "EngineStats",
    "ExpertOptions",
    "Generator",
    "Handoff",
    "HandoffError",
    "HandoffOptions",
    "KVOptions",
    "PagedEngine",
    "PagedKV",
    "RecomputeEngine",
    "Request",
    "Scheduler",
    "Seq",
    "Step",
    "StepTimeModel",
    "TokenDelta",
    "Updates",
    "attention_pairs",
    "kv_block_bytes",
    "step_features",
]
