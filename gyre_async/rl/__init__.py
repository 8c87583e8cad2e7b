"""RL math for the learner: pure functions over tensors, each checked by the tests against a
slow reference (advantages and fusion: ``tests/reference_advantages.py``)."""

from gyre_async.rl.advantages import (
    fuse_advantages,
    fusion_weight,
    group_outcome_advantage,
    segment_gae,
)
from gyre_async.rl.ppo import broadcast_step_advantages, entropy_bonus, ppo_policy_loss, value_loss
from gyre_async.rl.staleness import StalenessGate

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
