"""The RL jobs built from the roles, and the task they learn.

- :func:`run_grpo` (``_grpo``): generators, a reward mesh and trainers on one of three
  schedules (``sync``, ``stream``, ``stream+skew``), surviving the loss of any member
  (``_faults``); the stream modes run on a graph (``_stream``), stream+skew's length ranker
  is in ``_streaming``;
- :func:`train` (``_reference``): the single-process reference loop ``sync`` reproduces;
- ``_task``: the digit tasks (reversal, and copy within a fixed-width field: :class:`Task`):
  tokens, prompts, the rewards, the evaluation.
"""

from . import _task as reverse_task
from ._config import MODES, GRPOConfig, GRPOResult, StepRecord
from ._grpo import LengthRanker, run_grpo
from ._reference import (
    DEMO_CONFIG,
    LLAMA_CONFIG,
    LLAMA_DEMO_CONFIG,
    SMALL_CONFIG,
    LlamaModel,
    TrainConfig,
    step_requests,
    train,
)
from ._task import Task

__all__ = [
    "DEMO_CONFIG",
    "LLAMA_CONFIG",
    "LLAMA_DEMO_CONFIG",
    "MODES",
    "SMALL_CONFIG",
    "GRPOConfig",
    "GRPOResult",
    "LengthRanker",
    "LlamaModel",
    "StepRecord",
    "Task",
    "TrainConfig",
    "reverse_task",
    "run_grpo",
    "step_requests",
    "train",
]
