"""RL math for the learner: pure functions over tensors, each with a slow reference twin."""

from .advantages import (
    fuse_advantages,
    fusion_weight,
    group_outcome_advantage,
    segment_gae,
)
from .ppo import broadcast_step_advantages, entropy_bonus, ppo_policy_loss, value_loss
from .staleness import StalenessGate

__all__ = [
    "StalenessGate",
    "broadcast_step_advantages",
    "entropy_bonus",
    "fuse_advantages",
    "fusion_weight",
    "group_outcome_advantage",
    "ppo_policy_loss",
    "segment_gae",
    "value_loss",
]
