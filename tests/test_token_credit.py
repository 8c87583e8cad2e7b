"""Turn-level vs token-level accounting: the policy loss reaches action tokens only.

A step's context (observation, milestone summary, earlier turns, the agent's own earlier
actions among them) is conditioning, not something the policy is trained to produce. The
test follows the learner's exact path (``evaluate`` -> ``broadcast_step_advantages`` ->
``ppo_policy_loss``) and checks where gradient enters the model's output layer: only at the
positions that predict a real action token of the current step.
"""

from __future__ import annotations

import torch

from gyre_async.compose import build_policy
from gyre_async.policy.base import SamplingParams
from gyre_async.rl.ppo import broadcast_step_advantages, ppo_policy_loss
from schemas.config import Config, PolicySection

CONTEXTS = [  # previous turns included: "chop tree", "mine rock" are earlier actions
    "order 1 of 3 : axe x 2 . need wood 3 ore 1 . chop tree . chop ok . wind blows",
    "order 2 of 3 : lamp x 1 . need stone 1 ingot 2 . mine rock . mine ok",
    "order 3 of 3 : saw x 1 . need wood 1 . ready no",
]


def test_policy_gradient_reaches_action_tokens_only():
    cfg = Config(policy=PolicySection(d_model=32, n_layers=1, n_heads=2, context_tokens=48,
                                      history_turns=1))
    policy = build_policy(cfg)
    contexts = [policy.tokenizer.encode(c) for c in CONTEXTS]
    actions = [a.tokens for a in policy.act_batch(contexts, SamplingParams(max_action_tokens=4))]
    actions[1] = actions[1][:1]  # ragged: padded action slots must get nothing either
    captured = {}

    def keep_hidden(_module, _inputs, output):
        output.retain_grad()
        captured["h"] = output

    hook = policy.model.ln_f.register_forward_hook(keep_hidden)
    try:
        out = policy.evaluate(contexts, actions)
    finally:
        hook.remove()
    mask = out.mask.bool()
    step_adv = torch.tensor([1.0, -2.0, 0.5])
    logp = out.logprobs
    loss, _ = ppo_policy_loss(logp, logp.detach(), logp.detach(),
                              broadcast_step_advantages(step_adv, mask), mask)
    loss.backward()

    h = captured["h"]
    width = max(len(c) for c in contexts)  # contexts are left-padded to this width
    grad = h.grad.norm(dim=-1)  # [B, width + actions]
    for i, action in enumerate(actions):
        # Position width - 1 + j predicts action token j (the last context position
        # predicts the first action token).
        trained = {width - 1 + j for j in range(len(action))}
        for pos in range(h.shape[1]):
            if pos in trained:
                assert grad[i, pos] > 0, f"action token {pos - width + 1} of step {i} untrained"
            else:
                assert grad[i, pos] == 0, f"step {i}: non-action position {pos} got gradient"
