"""The RL jobs built from the roles, and the task they learn.

- :func:`run_grpo` (``_grpo``): generators, a reward mesh and trainers on one of three
  schedules (``sync``, ``stream``, ``stream+skew``), surviving the loss of any member
  (``_faults``); the stream modes run on a graph (``_stream``), stream+skew's length ranker
  is in ``_streaming``;
- :func:`train` (``_reference``): the single-process reference loop ``sync`` reproduces;
- :func:`run_rl` (``_run``): a run from an :class:`RLConfig` (``_rlconfig``: a TOML file,
  :func:`load_rl_config`), on a user's checkpoint, data (``_data``: :class:`DataSpec`) and
  reward functions, or on the built-in digit task (:class:`DigitsData`); what a job trains
  on is a source (``_source``);
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
from ._data import DataSource, DataSpec, read_rows
from ._llama import Checkpoint
from ._rlconfig import SECTIONS, RewardSection, RLConfig, load_rl_config, rl_config_from_dict
from ._run import DigitsData, Plan, plan_rl, run_rl
from ._source import DigitSource, Source
from ._task import Task

__all__ = [
    "SECTIONS",
    "Checkpoint",
    "DataSource",
    "DataSpec",
    "DigitSource",
    "DigitsData",
    "Plan",
    "RLConfig",
    "RewardSection",
    "Source",
    "load_rl_config",
    "plan_rl",
    "read_rows",
    "rl_config_from_dict",
    "run_rl",
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
