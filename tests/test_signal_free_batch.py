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
from gyre_async.core.learner_ppo import PpoEpochs, normalised_advantages, without_ranking
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


class Learner:
    """A tiny policy, its Adam optimizer, and its weights split into value head and the
    rest (the weights the critic shares with the policy)."""

    def __init__(self, tmp_path):
        self.cfg = config(tmp_path)
        torch.manual_seed(0)
        self.policy = build_policy(self.cfg)
        self.optimizer = torch.optim.Adam(self.policy.parameters(),
                                          lr=self.cfg.learner.learning_rate)
        self.head = list(value_head(self.policy).parameters())
        self.trunk = [p for p in self.policy.parameters()
                      if all(p is not h for h in self.head)]

    def update(self, advantages: list[float]) -> dict[str, float]:
        return PpoEpochs(self.policy, self.optimizer, self.cfg.learner,
                         batch(self.policy, advantages), ["s"]).run()


def moved(before: list[torch.Tensor], params) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(before, params))


def test_a_batch_without_advantage_steps_the_value_head_only(tmp_path):
    learner = Learner(tmp_path)
    learner.update([1.0, -1.0] * 4)  # a batch with signal first: Adam holds momentum
    before_trunk, before_head = snapshot(learner.trunk), snapshot(learner.head)
    readings = learner.update([0.0] * 8)
    assert readings["losses/policy_loss"] == 0.0
    assert readings["losses/policy_step_skipped"] == 1.0
    assert readings["losses/value_loss"] > 0.0
    assert not moved(before_trunk, learner.trunk)
    assert moved(before_head, learner.head)


def test_a_batch_of_equal_advantages_steps_the_value_head_only(tmp_path):
    """Fusion's seed-2 collapse on Simon Says: eight plays all lost at the first step, each
    from the same context, so segment GAE gave every step the same advantage (-0.3), which
    centring makes 0; the value loss (3.8) was then the whole step through the LoRA."""
    learner = Learner(tmp_path)
    learner.update([1.0, -1.0] * 4)
    before_trunk, before_head = snapshot(learner.trunk), snapshot(learner.head)
    readings = learner.update([-0.3] * 8)
    assert readings["losses/policy_step_skipped"] == 1.0
    assert readings["losses/policy_loss"] == 0.0
    assert not moved(before_trunk, learner.trunk)
    assert moved(before_head, learner.head)


def test_equal_advantages_normalise_to_exact_zeros():
    # 0.1 summed eight times is not 0.8 in floats: the mean leaves crumbs that a near-zero
    # spread would blow up to full size
    adv = torch.full((8,), 0.1)
    assert torch.equal(normalised_advantages(adv), torch.zeros(8))
    assert without_ranking(adv) and without_ranking(torch.zeros(3))
    assert not without_ranking(torch.tensor([0.1, 0.1 + 1e-3]))
    assert not without_ranking(torch.tensor([0.5]))  # one advantage is a signal on its own
    assert not without_ranking(torch.tensor([]))
    ranked = normalised_advantages(torch.tensor([1.0, 2.0, 3.0]))
    assert torch.allclose(ranked, torch.tensor([-1.0, 0.0, 1.0]))


def test_a_batch_with_advantage_still_steps_the_policy(tmp_path):
    learner = Learner(tmp_path)
    before = snapshot(learner.trunk)
    assert learner.update([1.0, 0.0] * 4)["losses/policy_step_skipped"] == 0.0
    assert moved(before, learner.trunk)


def test_the_critics_refit_after_such_a_batch_moves_the_value_head_only(tmp_path):
    learner = Learner(tmp_path)
    prep = batch(learner.policy, [0.0] * 8)
    guard = CriticGuard(learner.cfg.learner)
    trunk_moved = []
    for critic_only in (True, False):
        before = snapshot(learner.trunk)
        guard.refit(learner.policy, learner.optimizer, prep.contexts, prep.actions,
                    prep.returns + 1.0, learner.cfg.learner.max_grad_norm,
                    critic_only=critic_only)
        trunk_moved.append(moved(before, learner.trunk))
    assert trunk_moved == [False, True]  # the plain refit trains the shared weights too
