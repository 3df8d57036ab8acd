"""The trainer role: GRPO's math (``_grpo``, sans-IO), one update on a batch (``_update``) and
the actor (``_actor``) that holds the policy and its optimizer and publishes weights."""

from ._actor import Trainer
from ._grpo import group_advantages, grpo_loss
from ._update import LR_SCHEDULES, UpdateConfig, grpo_update, scheduled_lr

__all__ = [
    "LR_SCHEDULES",
    "Trainer",
    "UpdateConfig",
    "group_advantages",
    "grpo_loss",
    "grpo_update",
    "scheduled_lr",
]
