"""``learner.value_trunk_gradient = false``: the value loss trains the value head alone.

The critic shares its features with the policy (the tiny policy's trunk, an LLM's LoRA
adapters). With milestone pay, a batch of plays lost early gives the critic a large error
whose gradient, clipped together with the policy's, is nearly the whole step through the
shared weights (Simon Says: value losses 3.4-3.8, gradient norms 58-64, the entropy up 3-4x
after each). Detached, the value head reads the same features and the policy's weights see
only the policy loss.
"""

from __future__ import annotations

import msgspec
import torch
from test_critic import config

from gyre_async.compose import build_policy
from gyre_async.core.learner import LearnerCore
from gyre_async.rl.critic import value_head


def value_gradients(tmp_path, trunk_gradient: bool) -> tuple[float, float]:
    """Gradient norms (shared weights, value head) of the values' sum, after the learner
    has taken the policy with ``learner.value_trunk_gradient = trunk_gradient``."""
    cfg = config(tmp_path)
    cfg = msgspec.structs.replace(cfg, learner=msgspec.structs.replace(
        cfg.learner, value_trunk_gradient=trunk_gradient))
    torch.manual_seed(0)
    policy = build_policy(cfg)
    LearnerCore(cfg, policy)
    tok = policy.tokenizer
    contexts = [tok.encode(f"order 1 of 4 : axe x {i} . need wood {i} .") for i in range(4)]
    actions = [tok.encode("chop wood") for _ in contexts]
    out = policy.evaluate(contexts, actions)
    out.values.sum().backward()
    head = {id(p) for p in value_head(policy).parameters()}

    def norm(params) -> float:
        grads = [p.grad.norm() for p in params if p.grad is not None]
        return float(torch.stack(grads).norm()) if grads else 0.0

    params = list(policy.parameters())
    return (norm([p for p in params if id(p) not in head]),
            norm([p for p in params if id(p) in head]))


def test_detached_the_value_loss_reaches_the_value_head_only(tmp_path):
    shared, head = value_gradients(tmp_path / "shared", True)
    assert shared > 0 and head > 0  # the default: the critic trains the shared weights too
    shared, head = value_gradients(tmp_path / "head", False)
    assert shared == 0 and head > 0


def test_detached_values_are_the_same_values(tmp_path):
    cfg = config(tmp_path)
    torch.manual_seed(0)
    policy = build_policy(cfg)
    tok = policy.tokenizer
    contexts = [tok.encode("need wood 1 .")]
    actions = [tok.encode("chop wood")]
    before = policy.evaluate(contexts, actions).values.detach()
    policy.critic_detached = True
    assert torch.equal(policy.evaluate(contexts, actions).values.detach(), before)
