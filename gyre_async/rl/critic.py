"""Critic stability: a conservative start, refits on complete returns, a divergence detector.

Segment GAE leans on the critic twice (every step's baseline and every boundary's
bootstrap), so a wrong critic corrupts credit everywhere at once. Four defences:

* **prior**: before the first update the value head predicts ``mean step reward / (1 -
  gamma)`` of the first batch for every state (weights near zero, bias = the prior): the
  value of a policy that keeps earning what it earns now, with no per-state guesses yet.
* **clipped value loss** (``gyre_async.rl.ppo.value_loss``): per update the critic moves at
  most ``value_clip`` from the values the advantages were computed with.
* **refit**: periodically, extra value-only passes on steps whose Monte-Carlo return is
  complete in the batch (:func:`complete_returns`): targets that need no bootstrap.
* **divergence detector** (:class:`DivergenceDetector`): a non-finite or extreme raw
  advantage (before the update) or an exploding value loss (after it) resets the value
  head to the prior and multiplies the learning rate by ``lr_shrink``; an advantage alarm
  also skips that batch's update (its advantages are garbage). The learner announces each
  reset with a ``critic-reset`` event.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

DivergenceReason = Literal["advantage", "value-loss"]


def value_prior(step_rewards: Sequence[float], gamma: float) -> float:
    """``mean(r) / (1 - gamma)``: the discounted value of earning the mean reward forever.

    ``gamma = 1`` has no finite prior; it gives 0 (the neutral start)."""
    if not step_rewards or gamma >= 1.0:
        return 0.0
    return float(sum(step_rewards) / len(step_rewards)) / (1.0 - gamma)


def reset_value_head(head: torch.nn.Linear, prior: float, seed: int = 0) -> None:
    """Re-initialise a linear value head: tiny weights (all states look alike), bias = prior."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        std = 1e-3 / max(head.in_features, 1) ** 0.5
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * std)
        head.bias.fill_(prior)


def complete_returns(
    rewards: Sequence[Sequence[float]],
    trajectory_ids: Sequence[str],
    step_starts: Sequence[int],
    terminal: Sequence[bool],
    gamma: float,
) -> list[list[float | None]]:
    """Monte-Carlo returns for the steps whose return is complete in this batch.

    Segments are given with their rewards, trajectory, first step index and whether the
    trajectory ended (really, not truncated) at their last step. A step's return
    ``sum_k gamma^k r_{t+k}`` is complete when every later step of its trajectory up to a
    terminal one is in the batch; other steps get ``None``.
    """
    by_traj: dict[str, list[int]] = {}
    for i, traj in enumerate(trajectory_ids):
        by_traj.setdefault(traj, []).append(i)
    out: list[list[float | None]] = [[None] * len(r) for r in rewards]
    for idx in by_traj.values():
        idx.sort(key=lambda i: step_starts[i])
        tail = None  # return from the step after the current one; None: not complete
        expected_next = None
        for i in reversed(idx):
            end = step_starts[i] + len(rewards[i])
            if terminal[i]:
                tail, expected_next = 0.0, end
            if tail is None or expected_next != end:
                tail = None
                continue
            for t in range(len(rewards[i]) - 1, -1, -1):
                tail = float(rewards[i][t]) + gamma * tail
                out[i][t] = tail
            expected_next = step_starts[i]
    return out


@dataclass
class Divergence:
    reason: DivergenceReason
    max_abs_advantage: float
    value_loss: float


@dataclass(frozen=True)
class DivergenceDetector:
    """Thresholds of a diverging critic (0 disables a check).

    Per-step rewards in a sane run are O(1) and returns O(horizon * reward), so a raw
    advantage of ``max_advantage`` or a value loss of ``max_value_loss`` means the critic's
    targets or its predictions have run away (a reward spike, a poisoned batch, a blown-up
    value head), not that the policy improved.
    """

    max_advantage: float = 50.0
    max_value_loss: float = 25.0

    def check_advantages(self, raw: torch.Tensor) -> Divergence | None:
        if raw.numel() == 0:
            return None
        finite = bool(torch.isfinite(raw).all())
        peak = float(raw.abs().max()) if finite else math.inf
        if not finite or (self.max_advantage and peak > self.max_advantage):
            return Divergence("advantage", peak, math.nan)
        return None

    def check_value_loss(self, value_loss: float, peak_advantage: float) -> Divergence | None:
        if not math.isfinite(value_loss) or (self.max_value_loss
                                             and value_loss > self.max_value_loss):
            return Divergence("value-loss", peak_advantage, value_loss)
        return None


def value_head(policy) -> torch.nn.Linear:
    """The policy's value head (TorchPolicy and the HF policy both name it ``value_head``)."""
    head = getattr(policy.model, "value_head", None)
    if not isinstance(head, torch.nn.Linear):
        raise TypeError("critic stability needs a policy whose model has a Linear value_head")
    return head


def value_head_ids(policy) -> set[int]:
    """``id`` of each value-head parameter (empty for a policy without a value head)."""
    try:
        return {id(p) for p in value_head(policy).parameters()}
    except TypeError:
        return set()


def critic_gradients_only(policy, params: Sequence[torch.nn.Parameter]) -> None:
    """Drop the gradient of every parameter in ``params`` but the value head's, so that the
    optimizer's next step moves the critic alone.

    For a batch with no advantage (outcome credit where each group's episodes ended alike):
    the value loss's gradient also reaches the weights the critic shares with the policy
    (the trunk, an LLM's LoRA adapters), and Adam turns even a tiny gradient, or the
    momentum of earlier updates, into a full-size step; on Simon Says such batches raised
    the policy's entropy 0.14 -> 1.30 in 21 versions with a policy loss of 0.0 in every
    update. torch's optimizers skip a parameter whose ``grad`` is None, moments included.
    A policy without a value head steps nothing."""
    head = value_head_ids(policy)
    for p in params:
        if id(p) not in head:
            p.grad = None


def clip_gradients(policy, params: Sequence[torch.nn.Parameter], max_norm: float,
                   apart: bool = False) -> tuple[float, float | None]:
    """Clip the gradients of ``params`` to ``max_norm``; returns the norms before clipping:
    (the policy's, the value head's), the head's None unless the critic is detached.

    With the critic detached (``learner.value_trunk_gradient = false``, the policy's
    ``critic_detached``) the value head's gradient comes from the value loss alone and the
    other weights' from the policy loss alone, so the two norms are read apart. Clipped
    together (the default), a batch with a large critic error (Simon Says: value-head norms
    3-29 against a policy part of 0.01-0.65) scales the policy's step down by the critic's
    size; ``apart`` (``learner.clip_critic_apart``) clips each part to ``max_norm`` on its
    own. Otherwise (the critic shares the weights) one norm over all."""
    if not getattr(policy, "critic_detached", False):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm)), None
    head = value_head_ids(policy)
    critic = [p for p in params if id(p) in head]
    rest = [p for p in params if id(p) not in head]
    policy_norm, critic_norm = (torch.nn.utils.get_total_norm(
        [p.grad for p in part if p.grad is not None]) for part in (rest, critic))
    if apart:
        torch.nn.utils.clip_grads_with_norm_(rest, max_norm, policy_norm)
        torch.nn.utils.clip_grads_with_norm_(critic, max_norm, critic_norm)
    else:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.hypot(policy_norm,
                                                                           critic_norm))
    return float(policy_norm), float(critic_norm)


class CriticGuard:
    """The learner's critic defences, with the state they keep between updates.

    ``settings`` is the run's ``LearnerConfig`` (gamma, value_prior, value_refit_every,
    value_refit_epochs, minibatch_steps, divergence_* fields). Resets found are appended to
    ``resets`` for the actor to announce; the learning rate lives in the optimizer.
    """

    def __init__(self, settings, seed: int = 0):
        self.s = settings
        self.seed = seed
        self.detector = DivergenceDetector(settings.divergence_max_advantage,
                                           settings.divergence_max_value_loss)
        self.initialised = not settings.value_prior  # no prior asked: nothing to set
        self.prior = 0.0
        self.updates = 0
        self.resets: list[Divergence] = []

    def resume(self) -> None:
        """Keep the critic the policy already has (restored from a checkpoint): no prior."""
        self.initialised = True

    def take_resets(self) -> list[Divergence]:
        """The resets found since the last call (each is announced once)."""
        found, self.resets = self.resets, []
        return found

    def start(self, policy, step_rewards: Sequence[float],
              complete: Sequence[float] = ()) -> None:
        """Before the first update only: put the value head on the prior.

        ``complete``: the first batch's complete Monte-Carlo returns (steps whose episode
        ended within the batch). When there are any, the task's episodes end and their mean
        is the prior: ``mean(r) / (1 - gamma)`` assumes rewards forever, and for 15-step
        episodes with gamma 0.99 it put the critic 20x above every return (value loss ~100,
        read as divergence: a reset and a halved learning rate on most updates). On a long
        task whose first batch ended no episode, ``mean(r) / (1 - gamma)`` stays."""
        if self.initialised:
            return
        self.prior = (float(sum(complete) / len(complete)) if complete
                      else value_prior(step_rewards, self.s.gamma))
        reset_value_head(value_head(policy), self.prior, self.seed)
        self.initialised = True

    def screen(self, policy, optimizer, raw_advantages: torch.Tensor) -> bool:
        """Check a batch's raw advantages; on divergence reset and return True (skip it)."""
        found = self.detector.check_advantages(raw_advantages)
        if found is None:
            return False
        self._reset(policy, optimizer, found)
        return True

    def after_update(self, policy, optimizer, value_loss: float, peak_advantage: float) -> None:
        found = self.detector.check_value_loss(value_loss, peak_advantage)
        if found is not None:
            self._reset(policy, optimizer, found)

    def _reset(self, policy, optimizer, found: Divergence) -> None:
        head = value_head(policy)
        reset_value_head(head, self.prior, self.seed + len(self.resets) + 1)
        for p in head.parameters():
            optimizer.state.pop(p, None)  # stale Adam moments would undo the reset
        for group in optimizer.param_groups:
            group["lr"] *= self.s.divergence_lr_shrink
        self.resets.append(found)

    def refit_due(self) -> bool:
        self.updates += 1
        every = self.s.value_refit_every
        return bool(every) and self.updates % every == 0

    def refit(self, policy, optimizer, contexts: list[list[int]], actions: list[list[int]],
              targets: torch.Tensor, max_grad_norm: float,
              evaluate: Callable[[list[int]], Any] | None = None,
              critic_only: bool = False,
              minibatches: Callable[[torch.Generator], list[list[int]]] | None = None
              ) -> float:
        """Value-only passes on (context, complete return) pairs; returns the last loss.
        ``evaluate(rows)``: how the pairs ``rows`` are evaluated (default: each context
        apart, ``policy.evaluate``; the learner reads one-sequence segments in one pass).
        ``critic_only``: step the value head alone (see :func:`critic_gradients_only`).
        ``minibatches(gen)``: one epoch's minibatches of pair indices (default: a random
        permutation, ``minibatch_steps`` pairs at a time; the learner keeps a one-sequence
        segment's steps together, ``gyre_async.core.learner_batch.unit_minibatches``)."""
        if evaluate is None:
            def evaluate(rows: list[int]) -> Any:
                return policy.evaluate([contexts[i] for i in rows], [actions[i] for i in rows])
        n = len(contexts)
        loss_value = 0.0
        gen = torch.Generator().manual_seed(self.seed + self.updates)
        size = self.s.minibatch_steps
        for _ in range(self.s.value_refit_epochs):
            if minibatches is not None:
                batches = minibatches(gen)
            else:
                perm = torch.randperm(n, generator=gen).tolist()
                batches = [perm[start:start + size] for start in range(0, n, size)]
            for mb in batches:
                out = evaluate(mb)
                loss = 0.5 * ((out.values.float() - targets[mb]) ** 2).mean()
                optimizer.zero_grad()
                loss.backward()
                if critic_only:
                    critic_gradients_only(policy, list(policy.parameters()))
                torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
                optimizer.step()
                loss_value = float(loss.detach())
        return loss_value
