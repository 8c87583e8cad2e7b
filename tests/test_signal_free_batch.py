"""A batch whose advantages are all zero moves the critic and nothing of the policy.

With outcome credit (the GRPO-style baseline) a batch in which every group's episodes
ended alike has every advantage 0: the policy loss is exactly 0, yet the value loss's
gradient flows through the weights the policy shares with the critic (the trunk, or an
LLM's LoRA adapters), and Adam scales even a tiny gradient, or its old momentum, up to a
full-size step. On Simon Says that drift raised the policy's entropy 0.14 -> 1.30 in 21
versions with a policy loss of 0.0 in every update. The learner now steps only the value
head on such a batch.
"""

from __future__ import annotations

import torch
from test_critic import config

from gyre_async.compose import build_policy
from gyre_async.core.learner_batch import PreparedBatch
from gyre_async.core.learner_ppo import PpoEpochs
from gyre_async.policy.base import SamplingParams
from gyre_async.rl.critic import CriticGuard, value_head


def batch(policy, advantages: list[float]) -> PreparedBatch:
    tok = policy.tokenizer
    contexts = [tok.encode(f"order 1 of 4 : axe x {i % 2 + 1} . need wood {i % 4} .")
                for i in range(len(advantages))]
    acts = policy.act_batch(contexts, SamplingParams(max_action_tokens=4))
    with torch.no_grad():
        values = policy.values(contexts).float()
    adv = torch.tensor(advantages)
    return PreparedBatch(
        contexts=contexts, actions=[a.tokens for a in acts],
        behaviour_logprobs=[a.logprobs for a in acts], rewards=[1.0] * len(contexts),
        values=values, advantages=adv, returns=values + 1.0, local_advantages=adv,
        fusion_weights=[1.0])


def snapshot(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def test_a_batch_without_advantage_steps_the_value_head_only(tmp_path):
    cfg = config(tmp_path)
    torch.manual_seed(0)
    policy = build_policy(cfg)
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.learner.learning_rate)
    ids = ["s"]
    # A batch with signal first, so Adam holds momentum for every weight.
    PpoEpochs(policy, optimizer, cfg.learner, batch(policy, [1.0, -1.0] * 4), ids).run()

    head = set(value_head(policy).parameters())
    trunk = [p for p in policy.parameters() if p not in head]
    before_trunk, before_head = snapshot(trunk), snapshot(head)
    readings = PpoEpochs(policy, optimizer, cfg.learner, batch(policy, [0.0] * 8), ids).run()

    assert readings["losses/policy_loss"] == 0.0
    assert readings["losses/policy_step_skipped"] == 1.0
    assert readings["losses/value_loss"] > 0.0
    assert all(torch.equal(a, b) for a, b in zip(before_trunk, trunk))
    assert any(not torch.equal(a, b) for a, b in zip(before_head, head))


def test_a_batch_with_advantage_still_steps_the_policy(tmp_path):
    cfg = config(tmp_path)
    torch.manual_seed(0)
    policy = build_policy(cfg)
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.learner.learning_rate)
    head = set(value_head(policy).parameters())
    trunk = [p for p in policy.parameters() if p not in head]
    before = snapshot(trunk)
    readings = PpoEpochs(policy, optimizer, cfg.learner, batch(policy, [1.0, 0.0] * 4),
                         ["s"]).run()
    assert readings["losses/policy_step_skipped"] == 0.0
    assert any(not torch.equal(a, b) for a, b in zip(before, trunk))


def test_the_critics_refit_after_such_a_batch_moves_the_value_head_only(tmp_path):
    cfg = config(tmp_path)
    torch.manual_seed(0)
    policy = build_policy(cfg)
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.learner.learning_rate)
    prep = batch(policy, [0.0] * 8)
    head = set(value_head(policy).parameters())
    trunk = [p for p in policy.parameters() if p not in head]
    guard = CriticGuard(cfg.learner)
    moved = []
    for critic_only in (True, False):
        before = snapshot(trunk)
        guard.refit(policy, optimizer, prep.contexts, prep.actions, prep.returns + 1.0,
                    cfg.learner.max_grad_norm, critic_only=critic_only)
        moved.append(any(not torch.equal(a, b) for a, b in zip(before, trunk)))
    assert moved == [False, True]  # the plain refit trains the shared weights too
