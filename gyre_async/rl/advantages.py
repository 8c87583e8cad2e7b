"""Advantages for segment-level training: GAE per segment, group outcome advantage, fusion.

Why segments: a trajectory can run for hundreds of steps, so the learner trains on
segments as they close instead of waiting for the end. Each segment's GAE is bootstrapped
with the critic's value of the state right after its last step (the first state of the next
segment); a segment in which the trajectory ended is not bootstrapped. When the
trajectory's final outcome is known, a GRPO-style outcome advantage (normalised within the
group of trajectories on the same task) is fused in, per segment.

Every function here has a slow reference written as plain Python loops in
``tests/reference_advantages.py``; the tests check that they agree. All functions take and
return torch tensors and never mutate inputs.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


def _check_right_padded(mask: torch.Tensor) -> torch.Tensor:
    """Return ``mask`` as bool; raise unless every row is ones then zeros (right-padded)."""
    m = mask.bool()
    if m.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(m.shape)}")
    if m.shape[1] > 1 and bool((m[:, 1:] & ~m[:, :-1]).any()):
        raise ValueError("mask must be right-padded: a real step after a padded one")
    return m


def segment_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    bootstrap_values: torch.Tensor,
    terminal: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over a batch of right-padded segments; returns ``(advantages, returns)``, [B, T].

    ``rewards``, ``values``, ``mask``: [B, T], mask 1 on real steps (a prefix of each row).
    ``bootstrap_values``: [B], V of the state right after the segment's last real step.
    ``terminal``: [B] bool, the trajectory ended at that last step (then that V is 0).

    With ``V_next(t) = V[t+1]`` for inner steps and ``bootstrap * (1 - terminal)`` after the
    last real step::

        delta_t = r_t + gamma * V_next(t) - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}      (A after the last real step is 0)
        R_t     = A_t + V_t

    Padded positions get 0 in both outputs. One reverse pass over T of [B]-vector ops.
    """
    m = _check_right_padded(mask)
    batch, horizon = m.shape
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    if not dtype.is_floating_point:
        dtype = torch.float32
    r = rewards.to(dtype)
    v = values.to(dtype)
    tail = bootstrap_values.to(dtype) * (~terminal.bool()).to(dtype)
    # Value of the next state for every position: V[t+1] while t+1 is real, else the tail.
    next_is_real = torch.zeros_like(m)
    next_is_real[:, :-1] = m[:, 1:]
    v_shift = torch.zeros_like(v)
    v_shift[:, :-1] = v[:, 1:]
    v_next = torch.where(next_is_real, v_shift, tail.unsqueeze(1).expand(batch, horizon))
    fm = m.to(dtype)
    deltas = (r + gamma * v_next - v) * fm
    advantages = torch.zeros_like(deltas)
    running = torch.zeros(batch, dtype=dtype, device=deltas.device)
    for t in range(horizon - 1, -1, -1):
        running = deltas[:, t] + gamma * lam * running * next_is_real[:, t].to(dtype)
        advantages[:, t] = running
    advantages = advantages * fm
    return advantages, (advantages + v) * fm


def _group_index(group_ids: torch.Tensor | Sequence[Hashable]) -> torch.Tensor:
    """Dense int64 group index 0..G-1 from a tensor of ids or any sequence of hashables."""
    if isinstance(group_ids, torch.Tensor):
        return torch.unique(group_ids, return_inverse=True)[1].reshape(-1)
    dense: dict[Hashable, int] = {}
    return torch.tensor([dense.setdefault(g, len(dense)) for g in group_ids], dtype=torch.long)


def group_outcome_advantage(
    outcomes: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Hashable],
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO-style outcome advantage: ``(o_i - mean_g) / (std_g + eps)`` within each group.

    A group is the set of trajectories on the same task. ``std_g`` is the sample standard
    deviation (Bessel-corrected, as in TRL's GRPO). A group of size 1, or whose outcomes are
    all equal, carries no comparative signal and gets exactly 0 (not a noisy tiny number).
    """
    o = outcomes.reshape(-1)
    dtype = o.dtype if o.dtype.is_floating_point else torch.float32
    o = o.to(dtype)
    idx = _group_index(group_ids).to(o.device)
    if idx.numel() != o.numel():
        raise ValueError(f"{o.numel()} outcomes but {idx.numel()} group ids")
    if o.numel() == 0:
        return o.clone()
    n_groups = int(idx.max()) + 1
    count = torch.zeros(n_groups, dtype=dtype, device=o.device).index_add_(0, idx, torch.ones_like(o))
    mean = torch.zeros(n_groups, dtype=dtype, device=o.device).index_add_(0, idx, o) / count
    centred = o - mean[idx]
    sq = torch.zeros(n_groups, dtype=dtype, device=o.device).index_add_(0, idx, centred * centred)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    hi = torch.full((n_groups,), -torch.inf, dtype=dtype, device=o.device).scatter_reduce(
        0, idx, o, reduce="amax"
    )
    lo = torch.full((n_groups,), torch.inf, dtype=dtype, device=o.device).scatter_reduce(
        0, idx, o, reduce="amin"
    )
    informative = (count > 1) & (hi > lo)
    adv = centred / (std[idx] + eps)
    return torch.where(informative[idx], adv, torch.zeros_like(adv))


def fusion_weight(
    local: torch.Tensor,
    global_adv: torch.Tensor,
    mask: torch.Tensor,
    w_max: float = 0.5,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Per-segment weight of the global outcome advantage, in ``[0, w_max]``::

        w = w_max * |A_global| / (|A_global| + |mean_t A_local| + eps)

    where the mean runs over the segment's real steps. Why: when the outcome says nothing
    (``A_global = 0``) the segment keeps its own GAE (``w = 0``); when the local signal is
    flat (mean 0) the outcome decides as much as allowed (``w = w_max``); equal magnitudes
    share (``w = w_max / 2``). ``w_max < 1`` keeps some per-step credit assignment always.
    A NaN ``A_global`` (outcome not known yet) gives ``w = 0``.
    """
    if not 0.0 <= w_max <= 1.0:
        raise ValueError(f"w_max must be in [0, 1], got {w_max}")
    fm = mask.to(local.dtype)
    mean_local = (local * fm).sum(dim=1) / fm.sum(dim=1).clamp(min=1)
    g = torch.nan_to_num(global_adv.to(local.dtype), nan=0.0).abs()
    w = w_max * g / (g + mean_local.abs() + eps)
    return w.clamp(0.0, w_max)


def fuse_advantages(
    local: torch.Tensor,
    global_adv: torch.Tensor,
    weight: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``A = (1 - w) * A_local + w * A_global`` per step; ``w`` and ``A_global`` per segment.

    ``local`` [B, T], ``global_adv`` [B], ``weight`` [B] in [0, 1]. Padded steps (mask 0)
    stay 0. A NaN ``A_global`` must come with ``w = 0`` (see :func:`fusion_weight`).
    """
    w = weight.to(local.dtype).unsqueeze(1)
    if bool(((w < 0) | (w > 1)).any()):
        raise ValueError("fusion weights must lie in [0, 1]")
    g = torch.nan_to_num(global_adv.to(local.dtype), nan=0.0).unsqueeze(1)
    fused = (1.0 - w) * local + w * g
    return fused if mask is None else fused * mask.to(local.dtype)
