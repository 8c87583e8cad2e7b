"""Credit assignment across a long trajectory: local segment GAE fused with the global outcome.

Two signals reach a segment:

* **local**: GAE inside the segment from its per-step rewards (milestones, process
  rewards), the value bootstrapped at the segment boundary (:func:`segment_gae`). Known
  as soon as the segment is scored; as good as the critic.
* **global**: the trajectory's outcome — its undiscounted arbitrated return — normalised
  within its group of trajectories on the same task (GRPO, :func:`group_outcome_advantage`).
  Unbiased, critic-free, but known only when the trajectory ends and constant over it.
  An episode ended by a failure (env error, timeout, abandonment) has no outcome: it is
  left out of its group and gets none (:class:`OutcomeBook`, ``learner.mask_failed``).

Fusion, per segment ``i`` of a batch (``t`` runs over its real steps)::

    s       = sqrt(mean_{all real steps of the batch} A_local^2)      scale of the local signal
    L[i,t]  = A_local[i,t] / (s + eps)                                 local, in unit RMS
    g_i     = global advantage of i's trajectory (NaN while its outcome is unknown)
    m_i     = mean_t L[i,t]                                            the local verdict on i
    w_i     = w_max * |g_i| / (|g_i| + |m_i| + eps)                    0 when g_i is unknown
    A[i,t]  = (1 - w_i) * L[i,t] + w_i * g_i

Why this shape: ``g`` is in units of the group's outcome spread, ``A_local`` in reward
units; ``L`` puts both on a unit scale before they are compared or mixed. The outcome can
only judge the segment as a whole (it is constant over the segment), so it is weighed
against the local signal's verdict on the whole segment, ``m_i``: where the outcome clearly
separates this trajectory from its group and the critic has no strong opinion on the
segment, the outcome leads (``w -> w_max``); where the group's outcomes are all equal
(``g = 0``, nothing to learn from the comparison) the local process signal decides alone
(``w = 0``). The within-segment ranking of steps always comes from ``L`` (scaled by
``1 - w >= 1 - w_max``).

Silent groups (``silent="skip"``, ``learner.fusion_silent_groups``): where a trajectory's
outcome is known and ``g = 0`` exactly, every member of its group had the same return
(milestone pay included), so nothing ranks its plays; what ``L`` says there is the critic's
error, and unit scaling makes that error as large as a real signal. On Simon Says a group of
8 plays that all won every milestone trained on that alone, with approx KLs of 0.02-0.1 an
update. ``"skip"`` gives such segments no advantage (as GRPO gives them) and leaves them out
of ``s``; ``"local"`` (the default) keeps the local signal alone there, as above. A segment
whose outcome is not known yet keeps its local signal in both.

Timing (the learner trains on segments as they arrive): a segment trained before its
trajectory ended gets ``w = 0`` (local only); the global part reaches the segments that are
still unused when the outcome becomes known, i.e. those in the batch that holds the
trajectory's final segment. Which outcomes are "known" at an update is a function of the
event log (the final segments in this and earlier updates' ``trained_segments``), so
``gyre replay learner`` re-derives the same groups with :class:`OutcomeBook`.

Anchored credit (``mode="anchored"``, :func:`anchored_credit`), critic-free: a group's
members play the same task, and where two of them reach exactly the same context (the same
task, the same observations and actions so far: an *anchor*), their returns from there on
compare the actions they took there (GiGPO's anchor-state groups, Feng et al. 2025)::

    R[i,t]  = return from step t to the segment's end (milestone pay included), bootstrapped
              with the critic's value at a segment boundary that is not the episode's end
    a[i,t]  = (R[i,t] - mean_anchor R) / (std_anchor R + eps)     0 in a group of one, or
                                                                   of equal returns
    A[i,t]  = g_i + a[i,t]                                         g_i 0 where unknown

Why: where the members' histories are still identical they took (mostly) the same action,
and the advantages of one (context, action) pair across its anchor group sum to zero, so
their gradients cancel exactly; what remains is the step where their actions differ, the
one step a long game's outcome really depends on. Segment GAE cannot do that: the same
noisy critic value gives every copy of a shared step the same sign, and unit scaling makes
that noise as large as a real signal. Anchors form among the segments of one batch; with
``run.mode = "sync"`` and ``sampler.group_size = sampler.num_envs`` a batch holds whole
groups.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from gyre_async.rl.advantages import fuse_advantages, fusion_weight, group_outcome_advantage

CreditMode = Literal["fusion", "gae", "outcome", "anchored"]
SilentGroups = Literal["local", "skip"]

#: credit modes whose advantages never read the critic's values: their value head still
#: learns (its readings stay comparable), but on the policy's features detached, since a
#: value loss through the shared weights would move the policy for nothing
CRITIC_FREE_CREDIT: frozenset[str] = frozenset({"outcome", "anchored"})


def unit_rms(local: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``local / (sqrt(mean over masked entries of local^2) + eps)``; padded entries 0."""
    fm = mask.to(local.dtype)
    ms = (local * local * fm).sum() / fm.sum().clamp(min=1.0)
    return local * fm / (torch.sqrt(ms) + eps)


def fuse_segments(
    local: torch.Tensor,
    mask: torch.Tensor,
    global_adv: torch.Tensor,
    mode: CreditMode = "fusion",
    w_max: float = 0.8,
    eps: float = 1e-8,
    silent: SilentGroups = "local",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step advantages [S, T] and per-segment fusion weights [S] (see module docstring).

    ``local`` [S, T] raw segment GAE; ``mask`` [S, T]; ``global_adv`` [S], NaN where the
    trajectory's outcome is not known. ``mode="gae"`` returns ``local`` unchanged with
    ``w = 0``; ``mode="outcome"`` returns ``g`` on every real step (0 where unknown) with
    ``w = 1`` where known. ``silent`` (fusion only): ``"skip"`` gives the segments of silent
    groups (outcome known, ``g = 0``) no advantage.
    """
    fm = mask.to(local.dtype)
    g = global_adv.to(local.dtype)
    known = ~torch.isnan(g)
    if mode == "gae":
        return local * fm, torch.zeros_like(g)
    if mode == "outcome":
        g0 = torch.where(known, g, torch.zeros_like(g))
        return g0.unsqueeze(1) * fm, known.to(local.dtype)
    if mode != "fusion":  # "anchored" needs the steps' anchors: anchored_credit
        raise ValueError(f"credit mode must be fusion, gae or outcome, got {mode!r}")
    if silent == "skip":
        mask = mask.bool() & ~(known & (g == 0)).unsqueeze(1)
    elif silent != "local":
        raise ValueError(f"silent groups must be 'local' or 'skip', got {silent!r}")
    scaled = unit_rms(local, mask, eps)
    w = fusion_weight(scaled, g, mask, w_max=w_max, eps=eps)
    return fuse_advantages(scaled, g, w, mask), w


def anchored_credit(
    returns: torch.Tensor,
    mask: torch.Tensor,
    anchors: Sequence[Sequence[Hashable]],
    global_adv: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``mode="anchored"`` (see module docstring): per-step advantages [S, T], per-segment
    weights of the outcome (1 where known, else 0), and how many steps had a comparison.

    ``returns`` [S, T] returns-to-go; ``mask`` [S, T] right-padded; ``anchors[i][t]`` the
    anchor key of segment ``i``'s step ``t`` (one per real step; equal keys: the same
    context); ``global_adv`` [S], NaN where unknown.
    """
    m = mask.bool()
    keys = [key for row in anchors for key in row]
    if len(keys) != int(m.sum()):
        raise ValueError(f"{int(m.sum())} real steps but {len(keys)} anchor keys")
    step = torch.zeros_like(returns)
    if keys:
        step[m] = group_outcome_advantage(returns[m], keys, eps)  # row-major, as ``keys``
    g = global_adv.to(returns.dtype)
    known = ~torch.isnan(g)
    g0 = torch.where(known, g, torch.zeros_like(g))
    adv = (g0.unsqueeze(1) + step) * m.to(returns.dtype)
    return adv, known.to(returns.dtype), int((step[m] != 0).sum())


@dataclass
class OutcomeBook:
    """Trajectory outcomes and their GRPO groups, as the learner has seen them.

    ``record`` every scored segment on arrival (trained or dropped: the outcome is the
    trajectory's whole return). ``global_advantages`` at each update: the trajectories whose
    final segment is in the batch become *known* in their group (task id), then every
    segment of a known trajectory gets its group-relative advantage over the group's known
    members; others get NaN. Idempotent per segment id, so redelivered events change nothing.
    A group is forgotten once ``group_size`` of its members have ended (no member can follow).

    Failed episodes (``record(..., failed=True)``: ended by an env error, a timeout or
    abandonment) have no outcome. With ``mask_failed`` they end without joining their group:
    the baseline and spread are those of the properly ended members only, and the failed
    trajectory's segments get NaN (no outcome advantage; their per-segment credit, GAE
    bootstrapped from the critic, is all they get). A zero return would both pull the
    group's baseline down (every finished member then looks better than it is) and push
    the failed trajectory's own actions down for a crash they did not cause. Without
    ``mask_failed`` they join the group with the return they had (the old behaviour).
    """

    group_size: int = 1
    mask_failed: bool = True
    totals: dict[str, dict[str, float]] = field(default_factory=dict)  # traj -> seg -> total
    groups: dict[str, dict[str, float]] = field(default_factory=dict)  # task -> traj -> outcome
    failed: set[str] = field(default_factory=set)  # trajectories recorded as failed, not ended
    failed_members: dict[str, set[str]] = field(default_factory=dict)  # task -> failed ended

    def record(self, trajectory_id: str, segment_id: str, total: float,
               failed: bool = False) -> None:
        self.totals.setdefault(trajectory_id, {})[segment_id] = float(total)
        if failed:
            self.failed.add(trajectory_id)

    def forget(self, trajectory_id: str) -> None:
        """Drop a trajectory whose outcome will never be trained (its final segment dropped)."""
        self.totals.pop(trajectory_id, None)
        self.failed.discard(trajectory_id)

    def global_advantages(self, segments: Sequence[tuple[str, str, bool]]) -> list[float]:
        """``segments``: (trajectory_id, task_id, trajectory_done) per batch segment, in order."""
        for traj, task, done in segments:
            if not (done and traj in self.totals):
                continue
            outcome = sum(self.totals.pop(traj).values())
            if traj in self.failed and self.mask_failed:
                self.failed_members.setdefault(task, set()).add(traj)
            else:
                self.groups.setdefault(task, {})[traj] = outcome
            self.failed.discard(traj)
        advantage: dict[str, float] = {}
        for task in {task for _, task, _ in segments}:
            members = self.groups.get(task, {})
            if members:
                ids = list(members)
                adv = group_outcome_advantage(torch.tensor([members[t] for t in ids],
                                                           dtype=torch.float64),
                                              [task] * len(ids))
                advantage.update(zip(ids, adv.tolist()))
            if len(members) + len(self.failed_members.get(task, ())) >= self.group_size:
                self.groups.pop(task, None)
                self.failed_members.pop(task, None)
        return [advantage.get(traj, math.nan) for traj, _, _ in segments]
