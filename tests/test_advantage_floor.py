"""``learner.advantage_std_floor``: advantages are divided by their spread, but by no less
than the floor, so a batch with nothing to learn from (a few hundredths of critic error)
moves the policy less than a batch with a real signal. Default 0: today's update exactly."""

from __future__ import annotations

import torch
from msgspec.structs import replace
from test_critic import config, make_batch
from test_learner_dp import sgd_config, sgd_update, weights

from gyre_async.compose import build_policy
from gyre_async.core.learner import LearnerCore
from gyre_async.core.learner_ppo import normalised_advantages
from gyre_async.storage.segments import SegmentStore


def test_the_floor_bounds_how_far_small_advantages_are_scaled_up():
    gen = torch.Generator().manual_seed(0)
    small = 0.01 * torch.randn(64, generator=gen)
    large = torch.randn(64, generator=gen)
    for adv in (small, large):  # no floor: the update as before, bit for bit
        assert torch.equal(normalised_advantages(adv), (adv - adv.mean()) / (adv.std() + 1e-8))
    unit = normalised_advantages(small)
    floored = normalised_advantages(small, std_floor=0.1)
    assert abs(float(unit.std()) - 1.0) < 1e-4
    assert torch.allclose(floored, (small - small.mean()) / 0.1, atol=1e-6)  # ~0.1 of unit
    assert float(floored.abs().max()) < 0.15 * float(unit.abs().max())
    # a spread above the floor is divided by itself, as without one
    assert torch.allclose(normalised_advantages(large, std_floor=0.1),
                          normalised_advantages(large), atol=1e-7)
    assert torch.equal(normalised_advantages(torch.tensor([0.3]), 0.1), torch.tensor([0.3]))


def test_the_learner_divides_by_the_floor_when_the_spread_is_below_it(tmp_path):
    """One SGD update on the same batch (policy loss only, no refit, no clipping): a floor
    below the advantages' spread changes nothing; a floor far above it (1,000) shrinks the
    step by about spread / floor."""
    def step(floor: float) -> dict[str, torch.Tensor]:
        cfg = sgd_config(config(tmp_path / str(floor)))
        cfg = replace(cfg, learner=replace(cfg.learner, advantage_std_floor=floor,
                                           value_coef=0.0, entropy_coef=0.0,
                                           value_refit_every=0, max_grad_norm=1e9))
        store = SegmentStore(f"{tmp_path}/{floor}/segments.zarr", durable=False)
        torch.manual_seed(5)
        policy = build_policy(cfg)
        batch = make_batch(cfg, policy, store, 1)
        core = LearnerCore(cfg, policy)
        before = weights(core)
        after = sgd_update(core, store, batch)
        # the policy's weights (the critic's head is set up by its own start, not the loss)
        return {k: (after[k] - before[k]).float() for k in before if "value_head" not in k}

    def size(delta: dict[str, torch.Tensor]) -> float:
        return sum(float(d.norm() ** 2) for d in delta.values()) ** 0.5

    plain, below, far_above = step(0.0), step(1e-6), step(1000.0)
    assert size(plain) > 0
    assert all(torch.allclose(plain[k], below[k], atol=1e-9) for k in plain)
    assert size(far_above) < 0.01 * size(plain)
