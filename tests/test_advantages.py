"""Fast advantage code against slow references, plus hand-worked extremes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_advantages import (
    slow_fuse_advantages,
    slow_fusion_weight,
    slow_group_outcome_advantage,
    slow_segment_gae,
)

from gyre_async.rl.advantages import (
    fuse_advantages,
    fusion_weight,
    group_outcome_advantage,
    segment_gae,
)

FLOATS = st.floats(min_value=-10.0, max_value=10.0, allow_nan=False, width=32)


@st.composite
def segment_batches(draw):
    """A batch of right-padded segments with random lengths (0..T), rewards, values, ends."""
    batch = draw(st.integers(1, 6))
    horizon = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(0, horizon), min_size=batch, max_size=batch))
    row = st.lists(FLOATS, min_size=horizon, max_size=horizon)
    grid = st.lists(row, min_size=batch, max_size=batch)
    rewards, values = draw(grid), draw(grid)
    mask = [[1.0 if t < n else 0.0 for t in range(horizon)] for n in lengths]
    boot = draw(st.lists(FLOATS, min_size=batch, max_size=batch))
    terminal = draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    gamma = draw(st.floats(0.0, 1.0))
    lam = draw(st.floats(0.0, 1.0))
    return rewards, values, mask, boot, terminal, gamma, lam


@settings(max_examples=150, deadline=None)
@given(segment_batches())
def test_segment_gae_matches_slow_reference(case):
    rewards, values, mask, boot, terminal, gamma, lam = case
    adv, ret = segment_gae(
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(values, dtype=torch.float64),
        torch.tensor(mask),
        torch.tensor(boot, dtype=torch.float64),
        torch.tensor(terminal),
        gamma,
        lam,
    )
    slow_adv, slow_ret = slow_segment_gae(rewards, values, mask, boot, terminal, gamma, lam)
    assert torch.allclose(adv, torch.tensor(slow_adv, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(ret, torch.tensor(slow_ret, dtype=torch.float64), atol=1e-5)


def test_segment_gae_hand_worked():
    # One segment, 2 real steps + 1 pad, gamma=0.5, lam=1 (lam=1: A_t = discounted return - V_t).
    # r = [1, 2], V = [3, 4], bootstrap 8, not terminal:
    #   delta_1 = 2 + 0.5*8 - 4 = 2          A_1 = 2
    #   delta_0 = 1 + 0.5*4 - 3 = 0          A_0 = 0 + 0.5*1*2 = 1
    #   returns = A + V = [4, 6]  (check: R_0 = 1 + 0.5*(2 + 0.5*8) = 4)
    # Same segment, terminal: delta_1 = 2 - 4 = -2, A_0 = 0 + 0.5*(-2) = -1, returns [2, 2].
    rewards = torch.tensor([[1.0, 2.0, 9.0]] * 2)
    values = torch.tensor([[3.0, 4.0, 9.0]] * 2)
    mask = torch.tensor([[1, 1, 0]] * 2)
    adv, ret = segment_gae(
        rewards, values, mask, torch.tensor([8.0, 8.0]), torch.tensor([False, True]), 0.5, 1.0
    )
    assert adv.tolist() == [[1.0, 2.0, 0.0], [-1.0, -2.0, 0.0]]
    assert ret.tolist() == [[4.0, 6.0, 0.0], [2.0, 2.0, 0.0]]


def test_segment_gae_rejects_holes_in_mask():
    with pytest.raises(ValueError, match="right-padded"):
        segment_gae(
            torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([[1, 0, 1]]),
            torch.zeros(1), torch.zeros(1, dtype=torch.bool), 0.9, 0.9,
        )


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), FLOATS), min_size=0, max_size=20),
    st.sampled_from([1e-6, 1e-3]),
)
def test_group_outcome_advantage_matches_slow_reference(pairs, eps):
    groups = [g for g, _ in pairs]
    outcomes = [o for _, o in pairs]
    values = torch.tensor(outcomes, dtype=torch.float64)
    fast = group_outcome_advantage(values, torch.tensor(groups, dtype=torch.long), eps)
    slow = slow_group_outcome_advantage(outcomes, groups, eps)
    assert torch.allclose(fast, torch.tensor(slow, dtype=torch.float64), atol=1e-5)
    # String task ids give the same answer as integer ids.
    by_name = group_outcome_advantage(values, [f"task-{g}" for g in groups], eps)
    assert torch.allclose(fast, by_name)


def test_group_outcome_advantage_hand_worked():
    # Group "a": outcomes [1, 0, 0, 1] -> mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735,
    #   so +-0.5 / 0.57735 = +-0.866025 (eps 0 here for exact numbers).
    # Group "b": single trajectory -> 0.  Group "c": [2, 2] -> zero std -> 0.
    out = group_outcome_advantage(
        torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 2.0, 2.0]),
        ["a", "a", "a", "a", "b", "c", "c"],
        eps=0.0,
    )
    expected = [0.866025, -0.866025, -0.866025, 0.866025, 0.0, 0.0, 0.0]
    assert out.tolist() == pytest.approx(expected, abs=1e-6)


def test_fusion_weight_extremes():
    # w = w_max * |g| / (|g| + |mean local| + eps), w_max = 0.5, eps = 1e-8, 2 real steps each.
    # row 0: g = 0, local mean (1 + 3)/2 = 2        -> w = 0.5 * 0 / 2 = 0 (keep local)
    # row 1: g = 4, local [1, -1] mean 0             -> w = 0.5 * 4 / (4 + 0) = 0.5 = w_max
    # row 2: g = -2, local [2, 2] mean 2             -> w = 0.5 * 2 / (2 + 2) = 0.25
    # row 3: g = NaN (outcome not known yet)         -> w = 0
    # row 4: g = 1, local mean over real steps only: [3, (pad 100)] -> mean 3
    #                                                -> w = 0.5 * 1 / (1 + 3) = 0.125
    local = torch.tensor([[1.0, 3.0], [1.0, -1.0], [2.0, 2.0], [1.0, 1.0], [3.0, 100.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 1], [1, 0]])
    g = torch.tensor([0.0, 4.0, -2.0, float("nan"), 1.0])
    w = fusion_weight(local, g, mask, w_max=0.5)
    assert w.tolist() == pytest.approx([0.0, 0.5, 0.25, 0.0, 0.125], abs=1e-7)
    slow_w = slow_fusion_weight(local.tolist(), g.tolist(), mask.tolist())
    assert w.tolist() == pytest.approx(slow_w, abs=1e-7)

    # Fusion: row 1, w = 0.5: A = 0.5 * [1, -1] + 0.5 * 4 = [2.5, 1.5]
    #         row 2, w = 0.25: A = 0.75 * [2, 2] + 0.25 * (-2) = [1.0, 1.0]
    #         row 4, padded step stays 0: A = 0.875 * 3 + 0.125 * 1 = 2.75
    fused = fuse_advantages(local, g, w, mask)
    assert fused[1].tolist() == pytest.approx([2.5, 1.5])
    assert fused[2].tolist() == pytest.approx([1.0, 1.0])
    assert fused[3].tolist() == pytest.approx([1.0, 1.0])  # w = 0: local unchanged
    assert fused[4].tolist() == pytest.approx([2.75, 0.0])


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_fusion_matches_slow_reference(data):
    batch = data.draw(st.integers(1, 5))
    horizon = data.draw(st.integers(1, 8))
    row = st.lists(FLOATS, min_size=horizon, max_size=horizon)
    local = data.draw(st.lists(row, min_size=batch, max_size=batch))
    lengths = data.draw(st.lists(st.integers(0, horizon), min_size=batch, max_size=batch))
    mask = [[1.0 if t < n else 0.0 for t in range(horizon)] for n in lengths]
    outcome = st.one_of(FLOATS, st.just(math.nan))  # NaN: outcome not known yet
    g = data.draw(st.lists(outcome, min_size=batch, max_size=batch))
    w_max = data.draw(st.floats(0.0, 1.0))
    lt = torch.tensor(local, dtype=torch.float64)
    gt = torch.tensor(g, dtype=torch.float64)
    mt = torch.tensor(mask)
    w = fusion_weight(lt, gt, mt, w_max=w_max)
    slow_w = slow_fusion_weight(local, g, mask, w_max=w_max)
    assert torch.allclose(w, torch.tensor(slow_w, dtype=torch.float64), atol=1e-5)
    assert bool(((w >= 0) & (w <= w_max)).all())
    fused = fuse_advantages(lt, gt, w, mt)
    slow = slow_fuse_advantages(local, g, slow_w, mask)
    assert torch.allclose(fused, torch.tensor(slow, dtype=torch.float64), atol=1e-5)
