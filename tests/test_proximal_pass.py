"""The learner reads the proximal policy's log-probs off the values' forward pass.

Decoupled PPO needs the actions' log-probs under the weights before the update, and GAE
needs the values under the same weights: one forward pass without grad gives both
(``prepare_batch(..., with_logprobs=True)``). The update must be the one a separate
proximal pass gives, and the batch must be run through the model without grad once.
"""

from __future__ import annotations

import torch
from test_critic import config, make_batch
from test_learner_dp import sgd_config, sgd_update

import gyre_async.core.learner as learner_module
from gyre_async.compose import build_policy
from gyre_async.core.learner import LearnerCore
from gyre_async.core.learner_batch import prepare_batch, values_and_logprobs
from gyre_async.storage.segments import SegmentStore


def test_one_pass_gives_the_values_and_the_log_probs(tmp_path):
    cfg = config(tmp_path)
    policy = build_policy(cfg)
    contexts = [policy.tokenizer.encode(t) for t in ("order 1 of 4 : axe", "need wood 2 .")]
    actions = [policy.tokenizer.encode("chop"), policy.tokenizer.encode("mine ore x")]
    values, logprobs = values_and_logprobs(policy, contexts, actions)
    with torch.no_grad():
        out = policy.evaluate(contexts, actions)
        assert torch.allclose(values, policy.values(contexts).float(), atol=1e-5)
    assert torch.allclose(logprobs[:, : out.logprobs.shape[1]], out.logprobs.float(), atol=1e-6)
    assert logprobs[0, len(actions[0]):].abs().sum() == 0  # padding stays zero


def test_the_update_equals_one_with_its_own_proximal_pass(tmp_path, monkeypatch):
    cfg = sgd_config(config(tmp_path))
    store = SegmentStore(f"{tmp_path}/segments.zarr", durable=False)
    batch = make_batch(cfg, build_policy(cfg), store, 1)

    passes: list[int] = []

    def counting(core: LearnerCore) -> None:  # rows run through the model without grad
        for name in ("evaluate", "values"):
            inner = getattr(core.policy, name)

            def wrapped(contexts, *rest, _inner=inner):
                if not torch.is_grad_enabled():
                    passes.append(len(contexts))
                return _inner(contexts, *rest)
            setattr(core.policy, name, wrapped)

    torch.manual_seed(cfg.run.seed)
    merged = LearnerCore(cfg, build_policy(cfg))
    counting(merged)
    moved_merged = sgd_update(merged, store, batch)
    merged_passes, passes[:] = sum(passes), []

    def separate(*args, **kwargs):  # the values alone, the proximal pass in PpoEpochs
        return prepare_batch(*args, **{**kwargs, "with_logprobs": False})
    monkeypatch.setattr(learner_module, "prepare_batch", separate)
    torch.manual_seed(cfg.run.seed)
    apart = LearnerCore(cfg, build_policy(cfg))
    counting(apart)
    moved_apart = sgd_update(apart, store, batch)
    apart_passes = sum(passes)

    for name, expected in moved_apart.items():
        assert torch.allclose(moved_merged[name], expected, rtol=0, atol=1e-6), name
    steps = sum(s.step_end - s.step_start for s in batch)
    assert apart_passes - merged_passes == steps  # one whole pass over the batch saved
