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
from gyre_async.rl.critic import clip_gradients, value_head


def value_gradients(tmp_path, trunk_gradient: bool,
                    credit: str = "fusion") -> tuple[float, float]:
    """Gradient norms (shared weights, value head) of the values' sum, after the learner
    has taken the policy with ``learner.value_trunk_gradient = trunk_gradient`` and
    ``learner.credit = credit``."""
    cfg = config(tmp_path)
    cfg = msgspec.structs.replace(cfg, learner=msgspec.structs.replace(
        cfg.learner, value_trunk_gradient=trunk_gradient, credit=credit))
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


def test_credit_that_never_reads_the_values_keeps_the_critic_off_the_policy(tmp_path):
    """Outcome and anchored credit compute advantages without the critic, so its loss
    must not move the weights the policy acts with (the GRPO-style baseline has no
    critic); GAE and fusion credit keep the configured sharing."""
    for credit in ("outcome", "anchored"):
        shared, head = value_gradients(tmp_path / credit, True, credit)
        assert shared == 0 and head > 0, credit
    for credit in ("fusion", "gae"):
        shared, head = value_gradients(tmp_path / credit, True, credit)
        assert shared > 0 and head > 0, credit


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


def grads_after_clip(tmp_path, detached: bool,
                     apart: bool = True) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """A policy's gradients after ``clip_gradients``: its value head's set 100x too large,
    every other weight's set to a norm of 0.5 in all (below the clip of 1)."""
    torch.manual_seed(0)
    policy = build_policy(config(tmp_path))
    policy.critic_detached = detached
    head = {id(p) for p in value_head(policy).parameters()}
    params = list(policy.parameters())
    rest = [p for p in params if id(p) not in head]
    for p in params:
        p.grad = torch.ones_like(p)
    for p in rest:
        p.grad /= sum(q.numel() for q in rest) ** 0.5 / 0.5
    for p in value_head(policy).parameters():
        p.grad *= 100.0
    norms = clip_gradients(policy, params, 1.0, apart)
    flat = torch.cat([p.grad.flatten() for p in rest])
    head_flat = torch.cat([p.grad.flatten() for p in value_head(policy).parameters()])
    return flat, head_flat, norms


def test_detached_the_policy_and_value_head_are_clipped_apart(tmp_path):
    flat, head_flat, (policy_norm, value_norm) = grads_after_clip(tmp_path / "head", True)
    assert abs(policy_norm - 0.5) < 1e-4 and value_norm is not None and value_norm > 100
    assert abs(float(flat.norm()) - 0.5) < 1e-4  # the policy's step is left whole
    assert abs(float(head_flat.norm()) - 1.0) < 1e-4  # the critic's is clipped to 1
    # detached, clipped together (the default): both norms read, one clip over both, so the
    # critic's size shrinks the policy's step
    flat, head_flat, (policy_norm, value_norm) = grads_after_clip(tmp_path / "joint", True,
                                                                  apart=False)
    assert abs(policy_norm - 0.5) < 1e-4 and value_norm is not None and value_norm > 100
    assert float(flat.norm()) < 0.01
    assert abs(float(torch.cat([flat, head_flat]).norm()) - 1.0) < 1e-4
    # shared critic: one norm over all
    flat, head_flat, (joint_norm, value_norm) = grads_after_clip(tmp_path / "shared", False)
    assert value_norm is None and joint_norm > 100
    assert float(flat.norm()) < 0.01
    assert abs(float(torch.cat([flat, head_flat]).norm()) - 1.0) < 1e-4


def test_an_update_with_the_critic_detached_reports_both_norms(tmp_path):
    from test_signal_free_batch import Learner

    learner = Learner(tmp_path)
    shared = learner.update([1.0, -1.0] * 4)
    assert "losses/value_grad_norm" not in shared  # one norm over all, as before
    learner.policy.critic_detached = True
    apart = learner.update([1.0, -1.0] * 4)
    assert apart["losses/grad_norm"] > 0 and apart["losses/value_grad_norm"] > 0
