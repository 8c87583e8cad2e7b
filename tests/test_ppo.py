"""PPO losses against slow references, hand-worked numbers, and gradient directions."""

from __future__ import annotations

import math

import pytest
import torch
from reference_ppo import slow_entropy_bonus, slow_ppo_policy_loss, slow_value_loss

from gyre_async.rl.ppo import (
    broadcast_step_advantages,
    entropy_bonus,
    ppo_policy_loss,
    value_loss,
)


def _random_case(seed: int, batch: int = 7, actions: int = 5):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(batch, actions, generator=g, dtype=torch.float64) * 3
    prox = behav + torch.randn(batch, actions, generator=g, dtype=torch.float64) * 0.8
    new = prox + torch.randn(batch, actions, generator=g, dtype=torch.float64) * 0.3
    step_adv = torch.randn(batch, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, actions + 1, (batch,), generator=g)
    mask = torch.arange(actions).unsqueeze(0) < lengths.unsqueeze(1)
    return new, prox, behav, broadcast_step_advantages(step_adv, mask), mask


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("clip_eps,is_cap", [(0.2, 5.0), (0.1, 1.5)])
def test_policy_loss_matches_slow_reference(seed, clip_eps, is_cap):
    new, prox, behav, adv, mask = _random_case(seed)
    loss, stats = ppo_policy_loss(new, prox, behav, adv, mask, clip_eps, is_cap)
    slow_loss, slow_stats = slow_ppo_policy_loss(
        new.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), mask.tolist(), clip_eps, is_cap
    )
    assert float(loss) == pytest.approx(slow_loss, abs=1e-9)
    assert stats == pytest.approx(slow_stats, abs=1e-9)


def test_policy_loss_hand_worked():
    # Token 0: A = 1, new - prox = log 1.5 -> r = 1.5, clipped to 1.2: -min(1.5, 1.2) = -1.2;
    #          prox - behav = log 2 -> w = 2 (under cap 5): contributes -2.4.  Clipped.
    # Token 1: A = -1, r = 1 (new = prox): -min(-1, -1) = 1; prox - behav = log 10 -> w = 5
    #          (capped): contributes 5.
    # Token 2: padded (mask 0), holds -inf log-probs that must not poison the loss.
    # loss = (-2.4 + 5) / 2 = 1.3; clip_fraction 1/2; importance mean (2 + 5) / 2 = 3.5;
    # capped 1/2; approx_kl = ((1.5 - 1 - log 1.5) + 0) / 2 = (0.5 - 0.405465) / 2 = 0.0472674.
    new = torch.tensor([[math.log(1.5), 0.0, -math.inf]])
    prox = torch.tensor([[0.0, 0.0, 0.0]])
    behav = torch.tensor([[-math.log(2.0), -math.log(10.0), 0.0]])
    adv = torch.tensor([[1.0, -1.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    loss, stats = ppo_policy_loss(new.requires_grad_(), prox, behav, adv, mask)
    assert loss.item() == pytest.approx(1.3, abs=1e-6)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    assert stats["importance_weight_mean"] == pytest.approx(3.5, abs=1e-6)
    assert stats["importance_weight_capped"] == pytest.approx(0.5)
    assert stats["approx_kl"] == pytest.approx(0.0472674, abs=1e-6)
    loss.backward()
    assert torch.isfinite(new.grad).all()
    # Clipped token and padded token give no gradient; token 1: d/dnew [5 * -(r * -1)] = 5.
    assert new.grad.tolist()[0] == pytest.approx([0.0, 2.5, 0.0])  # 5 / 2 tokens


def test_broadcast_step_advantages():
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert broadcast_step_advantages(adv, mask).tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]
    with pytest.raises(ValueError):
        broadcast_step_advantages(adv, mask[:1])


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_advantage_sign_moves_chosen_token_logprob(sign):
    """One SGD step on a toy softmax policy: A > 0 raises the chosen token's log-prob,
    A < 0 lowers it."""
    torch.manual_seed(0)
    policy = torch.nn.Linear(4, 6)
    obs = torch.randn(3, 4)
    chosen = torch.tensor([[1], [4], [2]])
    mask = torch.ones(3, 1, dtype=torch.bool)

    def chosen_logp() -> torch.Tensor:
        return torch.log_softmax(policy(obs), dim=-1).gather(1, chosen)

    before = chosen_logp().detach()
    adv = broadcast_step_advantages(torch.full((3,), sign), mask)
    loss, _ = ppo_policy_loss(chosen_logp(), before, before, adv, mask)
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    opt.zero_grad()
    loss.backward()
    opt.step()
    change = chosen_logp().detach() - before
    assert bool((sign * change > 0).all()), change


@pytest.mark.parametrize("clip", [None, 0.2, 1.0])
def test_value_loss_matches_slow_reference(clip):
    g = torch.Generator().manual_seed(3)
    new_v, old_v, ret = (torch.randn(20, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(20, generator=g) > 0.3
    fast = value_loss(new_v, old_v, ret, clip, mask)
    slow = slow_value_loss(new_v.tolist(), old_v.tolist(), ret.tolist(), clip, mask.tolist())
    assert float(fast) == pytest.approx(slow)


def test_value_loss_hand_worked():
    # new 3, old 1, return 4, clip 0.5: unclipped err (3-4)^2 = 1; v_clip = 1 + 0.5 = 1.5,
    # clipped err (1.5-4)^2 = 6.25; max = 6.25, loss = 0.5 * 6.25 = 3.125.  No clip: 0.5.
    args = torch.tensor([3.0]), torch.tensor([1.0]), torch.tensor([4.0])
    assert float(value_loss(*args, clip=0.5)) == pytest.approx(3.125)
    assert float(value_loss(*args, clip=None)) == pytest.approx(0.5)


def test_entropy_bonus():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 7, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    fast = entropy_bonus(logits, mask)
    assert float(fast) == pytest.approx(slow_entropy_bonus(logits.tolist(), mask.tolist()), abs=1e-6)
    # Uniform over 7 tokens: entropy log 7 = 1.945910.
    uniform = entropy_bonus(torch.zeros(1, 1, 7), torch.ones(1, 1))
    assert float(uniform) == pytest.approx(math.log(7), abs=1e-6)
