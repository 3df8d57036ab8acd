"""orchestr.roles: role actors over sans-IO cores, and the GRPO job built from them.

- :class:`Generator` hosts a causal LM (:class:`TinyLM` or any ``nn.Module`` with
  ``forward(tokens) -> logits``) behind a continuous-batching engine (:class:`RecomputeEngine`, :class:`PagedEngine` or
  vLLM's, all keeping the :class:`Engine` contract); it streams
  completions with per-token behaviour log-probs and policy versions, and loads new weights
  from a trainer over the data plane (:meth:`Generator.sync_weights`).
- :class:`Trainer` holds the policy and its optimizer and takes GRPO steps
  (:func:`grpo_update`); members of a trainer mesh are data parallel after
  ``ctx.init_distributed``. It publishes versioned, bucketed, checksummed weights
  (:class:`WeightPublisher` / :class:`WeightLoader`) and checkpoints.
- :class:`KVStore` holds content-addressed KV blocks (host memory, then disk) that generators
  put and read one-sided over the data plane (``orchestr.roles.kvstore``).
- :class:`ExpertHost` holds routed experts of a MoE checkpoint apart from its generators
  (``Generator(experts=...)``); placement and rebalancing in ``orchestr.roles.experts``.
- :class:`AttentionServer` runs core-attention tasks (query shards over KV blocks read where
  they live) for other roles, rebatched; shards merge by log-sum-exp (``orchestr.roles.attention``).
- :class:`Reward` scores ``(prompt, completion)`` pairs with a scorer named by path.
- :func:`run_grpo` runs the three together in ``sync``, ``stream`` or ``stream+skew``
  mode; :func:`train` is the single-process reference the ``sync`` mode reproduces;
  :func:`run_rl` runs an :class:`RLConfig` (``orchestr rl train CONFIG.toml``): a user's
  checkpoint, data and reward functions (``orchestr.roles.rl``).
- Torch execution backends (device, dtype, eager or compiled) sit behind
  :func:`choose_backend` and :func:`register_backend`.
"""

from ._common._backend import (
    Backend,
    BackendError,
    BackendSpec,
    BackendUnavailableError,
    backend_report,
    choose_backend,
    register_backend,
)
from ._common._factory import build_model
from ._common._model import TinyLM, TinyLMConfig
from ._common._weightplan import (
    ChecksumMismatchError,
    ManifestMismatchError,
    StaleWeightsError,
    WeightSyncError,
)
from ._common._weights import ShardedWeightsRef, WeightLoader, WeightPublisher, WeightsRef
from .attention import AttentionServer
from .experts import ExpertHost, ExpertUnavailableError
from .generator import (
    AttentionOptions,
    Completion,
    Engine,
    EngineStats,
    ExpertOptions,
    Generator,
    Handoff,
    HandoffError,
    HandoffOptions,
    KVOptions,
    PagedEngine,
    PagedKV,
    RecomputeEngine,
    Request,
    TokenDelta,
    Updates,
    kv_block_bytes,
)
from .kvstore import KVNamespace, KVStore, KVStoreError, KVWriter, LeaseExpiredError
from .reward import Reward
from .rl import (
    DEMO_CONFIG,
    MODES,
    SMALL_CONFIG,
    GRPOConfig,
    GRPOResult,
    LengthRanker,
    RLConfig,
    StepRecord,
    TrainConfig,
    load_rl_config,
    reverse_task,
    run_grpo,
    run_rl,
    train,
)
from .trainer import Trainer, UpdateConfig, group_advantages, grpo_loss, grpo_update

__all__ = [
    "DEMO_CONFIG",
    "MODES",
    "SMALL_CONFIG",
    "AttentionOptions",
    "AttentionServer",
    "Backend",
    "BackendError",
    "BackendSpec",
    "BackendUnavailableError",
    "ChecksumMismatchError",
    "Completion",
    "Engine",
    "EngineStats",
    "ExpertHost",
    "ExpertOptions",
    "ExpertUnavailableError",
    "GRPOConfig",
    "GRPOResult",
    "Generator",
    "Handoff",
    "HandoffError",
    "HandoffOptions",
    "KVNamespace",
    "KVOptions",
    "KVStore",
    "KVStoreError",
    "KVWriter",
    "LeaseExpiredError",
    "LengthRanker",
    "ManifestMismatchError",
    "PagedEngine",
    "PagedKV",
    "RLConfig",
    "RecomputeEngine",
    "Request",
    "Reward",
    "ShardedWeightsRef",
    "StaleWeightsError",
    "StepRecord",
    "TinyLM",
    "TinyLMConfig",
    "TokenDelta",
    "TrainConfig",
    "Trainer",
    "UpdateConfig",
    "Updates",
    "WeightLoader",
    "WeightPublisher",
    "WeightSyncError",
    "WeightsRef",
    "backend_report",
    "build_model",
    "choose_backend",
    "group_advantages",
    "grpo_loss",
    "grpo_update",
    "kv_block_bytes",
    "load_rl_config",
    "register_backend",
    "reverse_task",
    "run_grpo",
    "run_rl",
    "train",
]
