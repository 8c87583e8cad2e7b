"""Segment/global fusion against its slow reference, hand-worked extremes, the outcome book."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_advantages import slow_fuse_segments, slow_segment_gae

from gyre_async.rl.advantages import segment_gae
from gyre_async.rl.fusion import OutcomeBook, fuse_segments, unit_rms

FLOATS = st.floats(min_value=-10.0, max_value=10.0, allow_nan=False, width=32)


@st.composite
def fusion_cases(draw):
    """Random segmentation (lengths 0..T), rewards, values, dones, bootstraps and outcomes."""
    batch = draw(st.integers(1, 6))
    horizon = draw(st.integers(1, 10))
    lengths = draw(st.lists(st.integers(0, horizon), min_size=batch, max_size=batch))
    grid = st.lists(st.lists(FLOATS, min_size=horizon, max_size=horizon),
                    min_size=batch, max_size=batch)
    rewards, values = draw(grid), draw(grid)
    boot = draw(st.lists(FLOATS, min_size=batch, max_size=batch))
    done = draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    # NaN: the trajectory has not ended; 0: its group's returns were all equal (silent)
    outcome = st.one_of(FLOATS, st.just(math.nan), st.just(0.0))
    g = draw(st.lists(outcome, min_size=batch, max_size=batch))
    mask = [[1.0 if t < n else 0.0 for t in range(horizon)] for n in lengths]
    mode = draw(st.sampled_from(["fusion", "gae", "outcome"]))
    w_max = draw(st.floats(0.0, 1.0))
    silent = draw(st.sampled_from(["local", "skip"]))
    return rewards, values, mask, boot, done, g, mode, w_max, silent


@settings(max_examples=150, deadline=None)
@given(fusion_cases())
def test_fused_advantages_match_slow_reference(case):
    rewards, values, mask, boot, done, g, mode, w_max, silent = case
    f64 = torch.float64
    local, _ = segment_gae(torch.tensor(rewards, dtype=f64), torch.tensor(values, dtype=f64),
                           torch.tensor(mask), torch.tensor(boot, dtype=f64),
                           torch.tensor(done), 0.97, 0.9)
    fused, w = fuse_segments(local, torch.tensor(mask), torch.tensor(g, dtype=f64), mode, w_max,
                             silent=silent)
    slow_local, _ = slow_segment_gae(rewards, values, mask, boot, done, 0.97, 0.9)
    slow, slow_w = slow_fuse_segments(slow_local, mask, g, mode, w_max, silent=silent)
    assert torch.allclose(fused, torch.tensor(slow, dtype=f64), atol=1e-6)
    assert torch.allclose(w, torch.tensor(slow_w, dtype=f64), atol=1e-9)
    assert bool((w >= 0).all()) and bool((w <= (1.0 if mode == "outcome" else w_max)).all())
    assert bool((fused[torch.tensor(mask) == 0] == 0).all())  # padding stays 0


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_segmented_gae_is_whole_trajectory_gae_cut_at_each_boundary(data):
    """Random segmentations of one trajectory, each boundary bootstrapped with V there.

    The deltas are the same as in whole-trajectory GAE, so a segment's advantage is the
    whole-trajectory one with the tail beyond the boundary b removed:
    A_seg[t] = A_whole[t] - (gamma * lam)^(b - t) * A_whole[b].
    """
    n = data.draw(st.integers(1, 14))
    rewards = data.draw(st.lists(FLOATS, min_size=n, max_size=n))
    values = data.draw(st.lists(FLOATS, min_size=n + 1, max_size=n + 1))  # V after the end too
    done = data.draw(st.booleans())
    gamma, lam = data.draw(st.floats(0.0, 1.0)), data.draw(st.floats(0.0, 1.0))
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=n - 1)) if n > 1 else [])
    bounds = [0, *cuts, n]
    whole, _ = slow_segment_gae([rewards], [values[:n]], [[1.0] * n], [values[n]], [done],
                                gamma, lam)
    width = max(b - a for a, b in zip(bounds, bounds[1:]))
    rows = [(a, b) for a, b in zip(bounds, bounds[1:])]
    pad = [0.0] * width
    seg_adv, _ = segment_gae(
        torch.tensor([(rewards[a:b] + pad)[:width] for a, b in rows], dtype=torch.float64),
        torch.tensor([(values[a:b] + pad)[:width] for a, b in rows], dtype=torch.float64),
        torch.tensor([[1.0 if t < b - a else 0.0 for t in range(width)] for a, b in rows]),
        torch.tensor([values[b] for _, b in rows], dtype=torch.float64),
        torch.tensor([done and b == n for _, b in rows]), gamma, lam)
    for k, (a, b) in enumerate(rows):
        for t in range(a, b):
            tail = (gamma * lam) ** (b - t) * whole[0][b] if b < n else 0.0
            assert float(seg_adv[k, t - a]) == pytest.approx(whole[0][t] - tail, abs=1e-6)


def test_fusion_hand_worked_extremes():
    # Three segments of 2 real steps, w_max = 0.8, eps negligible.
    # Raw local GAE:  seg0 [3, -3]   seg1 [3, 3]   seg2 [-3, 3]
    # RMS over the 6 real steps = sqrt(6 * 9 / 6) = 3  -> unit local:
    #                 seg0 [1, -1]   seg1 [1, 1]   seg2 [-1, 1]
    # Segment means m: seg0 0, seg1 1, seg2 0.
    # Global g:       seg0 2 (outcome clearly separates, local verdict 0)
    #                 seg1 1 (equal strength: |g| = |m| = 1)
    #                 seg2 0 (whole group had the same outcome)
    # w = 0.8 |g| / (|g| + |m|):  seg0 0.8 (= w_max), seg1 0.4 (= w_max / 2), seg2 0.
    # A = (1 - w) L + w g:
    #   seg0: 0.2 * [1, -1] + 0.8 * 2 = [1.8, 1.4]
    #   seg1: 0.6 * [1, 1] + 0.4 * 1  = [1.0, 1.0]
    #   seg2: [-1, 1] (local only)
    local = torch.tensor([[3.0, -3.0], [3.0, 3.0], [-3.0, 3.0]], dtype=torch.float64)
    mask = torch.ones(3, 2)
    g = torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64)
    fused, w = fuse_segments(local, mask, g, "fusion", w_max=0.8)
    assert w.tolist() == pytest.approx([0.8, 0.4, 0.0], abs=1e-7)  # eps = 1e-8
    assert torch.allclose(fused, torch.tensor([[1.8, 1.4], [1.0, 1.0], [-1.0, 1.0]],
                                              dtype=torch.float64), atol=1e-7)

    # Outcome unknown (NaN): w = 0 whatever g would be; the local part is still rescaled.
    fused, w = fuse_segments(local, mask, torch.tensor([math.nan] * 3, dtype=torch.float64))
    assert w.tolist() == [0.0, 0.0, 0.0]
    assert torch.allclose(fused, torch.tensor([[1.0, -1], [1, 1], [-1, 1]], dtype=torch.float64))

    # gae mode ignores g entirely; outcome mode is g on every real step (0 where unknown).
    fused, w = fuse_segments(local, mask, g, "gae")
    assert fused.tolist() == local.tolist() and w.tolist() == [0.0, 0.0, 0.0]
    g_partial = torch.tensor([2.0, math.nan, -1.0], dtype=torch.float64)
    fused, w = fuse_segments(local, mask, g_partial, "outcome")
    assert fused.tolist() == [[2.0, 2.0], [0.0, 0.0], [-1.0, -1.0]]
    assert w.tolist() == [1.0, 0.0, 1.0]


def test_silent_groups_skip_trains_nothing_where_the_group_is_silent():
    # The hand-worked segments above, plus seg3 [-3, 3] whose outcome is not known yet.
    # skip: seg2 (g = 0 known: its group's returns were all equal) gets no advantage and
    # leaves the scale; the RMS over seg0, seg1 and seg3's real steps is still 3, so seg0 and
    # seg1 are as before, and seg3, unknown, keeps its local signal ([-1, 1], w = 0).
    local = torch.tensor([[3.0, -3.0], [3.0, 3.0], [-3.0, 3.0], [-3.0, 3.0]],
                         dtype=torch.float64)
    mask = torch.ones(4, 2, dtype=torch.bool)
    g = torch.tensor([2.0, 1.0, 0.0, math.nan], dtype=torch.float64)
    fused, w = fuse_segments(local, mask, g, "fusion", w_max=0.8, silent="skip")
    assert w.tolist() == pytest.approx([0.8, 0.4, 0.0, 0.0], abs=1e-7)
    assert torch.allclose(fused, torch.tensor([[1.8, 1.4], [1.0, 1.0], [0.0, 0.0], [-1.0, 1.0]],
                                              dtype=torch.float64), atol=1e-7)
    # local (the default): the silent segment keeps its local signal alone
    fused, _ = fuse_segments(local, mask, g, "fusion", w_max=0.8)
    assert fused[2].tolist() == pytest.approx([-1.0, 1.0])
    # a batch that is one silent group: nothing to train, exactly
    fused, _ = fuse_segments(local[2:3], mask[2:3], g[2:3], "fusion", silent="skip")
    assert fused.tolist() == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="silent"):
        fuse_segments(local, mask, g, "fusion", silent="drop")  # type: ignore[arg-type]


def test_unit_rms_ignores_padding():
    # Real entries [3, 4] (RMS sqrt(12.5) = 3.5355); the pad 100 counts for nothing.
    x = unit_rms(torch.tensor([[3.0, 100.0], [4.0, 100.0]], dtype=torch.float64),
                 torch.tensor([[1, 0], [1, 0]]))
    assert x[:, 0].tolist() == pytest.approx([3 / 12.5 ** 0.5, 4 / 12.5 ** 0.5])
    assert x[:, 1].tolist() == [0.0, 0.0]


def test_outcome_book_groups_by_task_and_knows_only_trained_finals():
    book = OutcomeBook(group_size=3)
    # task "a": trajectories x (return 0.1 + 1.0), y (0.0), z (0.2); task "b": solo u.
    for traj, seg, total in [("x", "x0", 0.1), ("x", "x1", 1.0), ("y", "y0", 0.0),
                             ("z", "z0", 0.2), ("u", "u0", 5.0)]:
        book.record(traj, seg, total)
    book.record("x", "x1", 1.0)  # redelivered: counted once
    # Update 1 trains x's final segment and y's non-final one: only x is known -> group "a"
    # has one known member -> no comparison yet -> 0; y unknown -> NaN.
    adv = book.global_advantages([("x", "a", True), ("y", "a", False)])
    assert adv[0] == 0.0 and math.isnan(adv[1])
    # Update 2: y and u end. Group "a" known = {x: 1.1, y: 0.0}: mean 0.55, sample std
    # sqrt(2 * 0.55^2 / 1) = 0.7778 -> y: -0.55 / 0.7778 = -0.7071. Group "b": solo -> 0.
    adv = book.global_advantages([("y", "a", True), ("u", "b", True)])
    assert adv == pytest.approx([-0.70710678, 0.0], abs=1e-6)
    # Update 3: z ends. Known {1.1, 0.0, 0.2}: mean 0.4333, std sqrt((0.4444 + 0.1878 +
    # 0.0544) / 2) = 0.5859 -> z: (0.2 - 0.4333) / 0.5859 = -0.3982. The group is then full
    # (3 = group_size) and forgotten.
    adv = book.global_advantages([("z", "a", True)])
    assert adv == pytest.approx([-0.39824], abs=1e-4)
    assert "a" not in book.groups and not book.totals
