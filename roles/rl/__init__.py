"""The RL jobs built from the roles, and the task they learn.

- :func:`run_grpo` (``_grpo``): generators, a reward mesh and trainers on one of three
  schedules (``sync``, ``stream``, ``stream+skew``), surviving the loss of any member
  (``_faults``); the stream modes run on a graph (``_stream``), stream+skew's length ranker
  is in ``_streaming``;
- :func:`train` (``_reference``): the single-process reference loop ``sync`` reproduces;
- ``_task``: digit reversal, the example task (tokens, prompts, the reward, the evaluation).
"""

from . import _task as reverse_task
from ._config import MODES, GRPOConfig, GRPOResult, StepRecord
from ._grpo import LengthRanker, run_grpo
from ._reference import DEMO_CONFIG, SMALL_CONFIG, TrainConfig, train

__all__ = [
    "DEMO_CONFIG",
    "MODES",
    "SMALL_CONFIG",
    "GRPOConfig",
    "GRPOResult",
    "LengthRanker",
    "StepRecord",
    "TrainConfig",
    "reverse_task",
    "run_grpo",
    "train",
]
