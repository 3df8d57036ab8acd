"""The trainer role: the advantage estimators (``_advantages``) and GRPO's loss (``_grpo``),
sans-IO; one update on a batch (``_update``, micro-batched by ``_micro``); supervised
fine-tuning's loss and step (``_sft``); learning-rate schedules (``_schedule``); reward
shaping for the controller (``_shaping``); and the actor (``_actor``) that holds the policy
and its optimizer and publishes weights."""

from ._actor import Trainer
from ._advantages import ADVANTAGE_ESTIMATORS, group_advantages
from ._grpo import KL_ESTIMATORS, LOSS_AGGREGATIONS, grpo_loss, kl_penalty
from ._schedule import LR_SCHEDULES, scheduled_lr
from ._sft import sft_loss, sft_update
from ._shaping import overlong_penalty
from ._sharding import LOAD_MODEL, SHARDING, call_trainer, publish_weights
from ._update import UpdateConfig, grpo_update

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOAD_MODEL",
    "LOSS_AGGREGATIONS",
    "LR_SCHEDULES",
    "SHARDING",
    "Trainer",
    "UpdateConfig",
    "call_trainer",
    "group_advantages",
    "grpo_loss",
    "grpo_update",
    "kl_penalty",
    "overlong_penalty",
    "publish_weights",
    "scheduled_lr",
    "sft_loss",
    "sft_update",
]
