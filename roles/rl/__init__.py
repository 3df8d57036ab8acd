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
- :func:`run_sft` (``_sft``): supervised fine-tuning of a checkpoint on prompt and response
  rows (``_sft_data``) with the same trainer role, from an :class:`SFTConfig`
  (``_sftconfig``: a TOML file, :func:`load_sft_config`); its ``model/`` warm-starts RL;
- ``_task``: the digit tasks (reversal, and copy within a fixed-width field: :class:`Task`):
  tokens, prompts, the rewards, the evaluation.
"""

from . import _task as reverse_task
from ._config import MODES, GRPOConfig, GRPOResult, StepRecord
from ._data import DataSource, DataSpec, read_rows
from ._grpo import LengthRanker, run_grpo
from ._layout import LayoutChoice, LayoutCosts, LayoutView, choose_layout, expected_remaining
from ._llama import Checkpoint
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
from ._reshard import reshard_pool
from ._rlconfig import SECTIONS, RewardSection, RLConfig, load_rl_config, rl_config_from_dict
from ._run import DigitsData, Plan, plan_rl, run_rl
from ._sft import SFTPlan, SFTResult, SFTStep, plan_sft, run_sft
from ._sftconfig import SFT_SECTIONS, SFTConfig, load_sft_config, sft_config_from_dict
from ._source import DigitSource, Source
from ._task import Task

__all__ = [
    "DEMO_CONFIG",
    "LLAMA_CONFIG",
    "LLAMA_DEMO_CONFIG",
    "MODES",
    "SECTIONS",
    "SFT_SECTIONS",
    "SMALL_CONFIG",
    "Checkpoint",
    "DataSource",
    "DataSpec",
    "DigitSource",
    "DigitsData",
    "GRPOConfig",
    "GRPOResult",
    "LayoutChoice",
    "LayoutCosts",
    "LayoutView",
    "LengthRanker",
    "LlamaModel",
    "Plan",
    "RLConfig",
    "RewardSection",
    "SFTConfig",
    "SFTPlan",
    "SFTResult",
    "SFTStep",
    "Source",
    "StepRecord",
    "Task",
    "TrainConfig",
    "choose_layout",
    "expected_remaining",
    "load_rl_config",
    "load_sft_config",
    "plan_rl",
    "plan_sft",
    "read_rows",
    "reshard_pool",
    "reverse_task",
    "rl_config_from_dict",
    "run_grpo",
    "run_rl",
    "run_sft",
    "sft_config_from_dict",
    "step_requests",
    "train",
]
