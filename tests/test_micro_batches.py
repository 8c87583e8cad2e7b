"""Gradient accumulation (``learner.micro_steps``): a minibatch trained in micro-batches
updates the weights as the same minibatch in one pass.

Plain SGD moves each weight by its gradient, so an error in the micro-batches' loss shares
(token means over the minibatch's tokens, step means over its steps) would show; the
critic refit is included. Readings (policy loss, entropy, clip fraction...) must add up too.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from test_critic import config, make_batch
from test_learner_dp import sgd_config, sgd_update, weights

from gyre_async.compose import build_policy
from gyre_async.core.learner import LearnerCore
from gyre_async.storage.segments import SegmentStore

replace = msgspec.structs.replace


def test_micro_batches_give_the_minibatchs_update(tmp_path):
    cfg = sgd_config(config(tmp_path))
    cfg = replace(cfg, learner=replace(cfg.learner, minibatch_steps=5))
    store = SegmentStore(f"{tmp_path}/segments.zarr", durable=False)
    batch = make_batch(cfg, build_policy(cfg), store, 1)
    results = {}
    for micro in (0, 2, 1):
        torch.manual_seed(cfg.run.seed)
        core = LearnerCore(replace(cfg, learner=replace(cfg.learner, micro_steps=micro)),
                           build_policy(cfg))
        results[micro] = (sgd_update(core, store, batch), core.last_metrics)
    (whole, whole_metrics), before = results[0], weights(LearnerCore(cfg, build_policy(cfg)))
    assert any(not torch.equal(whole[k], before[k]) for k in whole)  # the update moved them
    for micro in (2, 1):
        moved, metrics = results[micro]
        for name, expected in whole.items():
            assert torch.allclose(moved[name], expected, rtol=0, atol=1e-6), (micro, name)
        for key in ("losses/policy_loss", "losses/value_loss", "losses/entropy",
                    "losses/clip_fraction", "losses/grad_norm"):
            assert metrics[key] == pytest.approx(whole_metrics[key], rel=1e-4, abs=1e-6), key
