"""policy.device / policy.dtype: the model moves and casts, inputs and outputs stay on the
CPU in float32. Run here on the CPU with bfloat16 weights (no GPU on this machine: the
``cuda`` path is the same code with another device string, and is not claimed as tested)."""

from __future__ import annotations

import torch

from gyre_async.compose import build_policy
from gyre_async.policy.base import SamplingParams
from gyre_async.policy.context import ContextBuilder
from gyre_async.policy.factory import load_weights, save_weights
from gyre_async.storage.checkpoints import CheckpointStore


def test_bfloat16_policy_acts_evaluates_and_round_trips(tiny, tmp_path):
    cfg = tiny.config(policy={"dtype": "bfloat16"})
    policy = build_policy(cfg)
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}
    builder = ContextBuilder(policy.tokenizer, cfg.policy.context_tokens, 0)
    contexts = [builder.build("order: 2 planks"), builder.build("you hold an axe")]
    actions = policy.act_batch(contexts, SamplingParams(max_action_tokens=4), seed=3)
    assert all(a.tokens and len(a.logprobs) == len(a.tokens) for a in actions)
    out = policy.evaluate(contexts, [a.tokens for a in actions])
    assert out.logprobs.dtype == torch.float32 and out.logprobs.device.type == "cpu"
    assert out.values.dtype == torch.float32
    # the sampled log-probs are the evaluated ones (same weights, float32 log-softmax)
    for i, action in enumerate(actions):
        assert torch.allclose(out.logprobs[i, : len(action.tokens)],
                              torch.tensor(action.policy_logprobs), atol=1e-2)
    out.logprobs.sum().backward()  # gradients reach bfloat16 weights through the CPU copy
    assert any(p.grad is not None and p.grad.dtype == torch.bfloat16
               for p in policy.parameters())

    store = CheckpointStore(str(tmp_path / "checkpoints"))
    ref = save_weights(store, policy, 1)
    again = build_policy(cfg)
    load_weights(again, ref.address, ref.sha256)
    with torch.no_grad():
        assert torch.equal(again.evaluate(contexts, [a.tokens for a in actions]).logprobs,
                           policy.evaluate(contexts, [a.tokens for a in actions]).logprobs)
