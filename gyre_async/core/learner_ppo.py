"""The learner's decoupled-PPO epochs over a prepared batch, alone or data-parallel.

:class:`PpoEpochs` is the optimisation half of an update (``LearnerCore.train`` does the
rest: admission, advantages, critic defences). Its batch-wide quantities (advantage
normalisation, behaviour and proximal log-probs, the minibatch permutation) are computed
whole; only the minibatch loss is split when a data-parallel group is given. With one
process every share below is exactly 1, so the single learner's arithmetic is unchanged.

Segments stored as one sequence (segment contexts) are read whole: minibatches are made of
whole segments (a segment's steps are never spread over minibatches, which would read its
sequence once per minibatch), and a forward/backward pass holds whole segments up to
``micro_tokens`` tokens. Window-context batches keep their step-wise minibatches.
"""

from __future__ import annotations

import numpy as np
import torch

from gyre_async.core.learner_batch import (
    PreparedBatch,
    evaluate_steps,
    pack_by_length,
    read_units,
    unit_minibatches,
)
from gyre_async.core.learner_dp import DataParallel
from gyre_async.rl.critic import clip_gradients, critic_gradients_only
from gyre_async.rl.finite import check_batch_finite, check_loss_finite
from gyre_async.rl.ppo import broadcast_step_advantages, ppo_policy_loss, value_loss
from schemas.config import LearnerConfig

#: what one gradient step reads out, in the order a data-parallel all-reduce carries them
MINIBATCH_READINGS = ("clip_fraction", "approx_kl", "importance_weight_mean",
                      "importance_weight_capped", "policy_loss", "value_loss", "entropy",
                      "kl_to_base", "loss")


def kl_to_base(logprobs: torch.Tensor, base: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || base) estimate ``exp(r) - r - 1``, ``r = base - logprobs``:
    non-negative, zero where the two agree, unbiased for tokens sampled from the policy
    (Schulman's k3), summed over ``mask``; the caller divides by its token count."""
    r = (base - logprobs) * mask
    return ((torch.exp(r) - r - 1.0) * mask).sum()


def without_ranking(adv: torch.Tensor, rel_tol: float = 1e-6) -> bool:
    """True when ``adv`` ranks nothing: empty of signal because every advantage is 0, or
    (two or more) because they are all equal, which centring turns into exact zeros.

    Equal advantages are what segment GAE gives a batch of identical one-step plays (eight
    games of Simon Says all lost at the first step, each from the same context): centred,
    the policy loss is 0, but float rounding of the mean would leave crumbs that division
    by a near-zero spread blows up to full size."""
    if not len(adv):
        return False
    if bool((adv == 0).all()):
        return True
    spread = float(adv.max() - adv.min())
    return len(adv) > 1 and spread <= rel_tol * max(1.0, float(adv.abs().max()))


def normalised_advantages(adv: torch.Tensor, std_floor: float = 0.0) -> torch.Tensor:
    """Centred and divided by their spread, or by ``std_floor`` when the spread is smaller
    (``learner.advantage_std_floor``); one advantage is left as it is; advantages that rank
    nothing (:func:`without_ranking`) become exact zeros."""
    if len(adv) <= 1:
        return adv
    if without_ranking(adv):
        return torch.zeros_like(adv)
    return (adv - adv.mean()) / (adv.std().clamp(min=std_floor) + 1e-8)


def index_slices(n: int, size: int) -> list[list[int]]:
    return [list(range(start, min(n, start + size))) for start in range(0, n, size)]


class PpoEpochs:
    """``settings.epochs`` passes of minibatch gradient steps over one prepared batch."""

    def __init__(self, policy, optimizer: torch.optim.Optimizer, settings: LearnerConfig,
                 prep: PreparedBatch, ids: list[str], dp: DataParallel | None = None):
        self.policy, self.optimizer, self.settings = policy, optimizer, settings
        self.prep, self.ids, self.dp = prep, ids, dp
        #: the rows as read together: a one-sequence segment's steps, or one step
        self.units = self._row_units(list(range(prep.n))) if prep.sequences else []
        n, adv = prep.n, prep.advantages
        self.adv_norm = normalised_advantages(adv, settings.advantage_std_floor)
        width = max(len(a) for a in prep.actions)
        self.behaviour = torch.zeros(n, width)
        self.token_mask = torch.zeros(n, width, dtype=torch.bool)
        for i, logprobs in enumerate(prep.behaviour_logprobs):
            self.behaviour[i, : len(logprobs)] = torch.tensor(logprobs)
            self.token_mask[i, : len(logprobs)] = True
        # The proximal policy is the weights before this update: the values' forward pass
        # read its log-probs off already (prepare_batch's with_logprobs); else one pass here.
        self.proximal = (prep.proximal_logprobs[:, :width] if prep.proximal_logprobs is not None
                         else self._proximal_logprobs(width))
        self.base = self._base_logprobs(width) if settings.kl_to_base > 0 else None
        check_batch_finite({}, {"proximal_logprobs": self.proximal}, ids)
        #: every advantage 0 (outcome credit where each group's episodes ended alike) or all
        #: equal (local credit on identical plays): no policy signal, so only the critic
        #: steps (``critic_gradients_only``); the value loss's gradient through the shared
        #: weights would otherwise be the whole step (fusion's Simon Says collapse, seed 2)
        self.signal_free = without_ranking(adv)

    def run(self) -> dict[str, float]:
        """Decoupled PPO epochs (see ``gyre_async.rl.ppo``); the mean of each reading.

        With a data-parallel group each rank computes only the rows it owns, its losses
        scaled to their share of the whole minibatch, and the gradients are summed before
        clipping (see ``gyre_async.core.learner_dp``)."""
        settings, n = self.settings, self.prep.n
        params = list(self.policy.parameters())
        stats: dict[str, list[float]] = {}
        gen = torch.Generator().manual_seed(n)  # the same permutation on every rank
        for _ in range(settings.epochs):
            for mb in self._minibatches(gen):
                mine = self.dp.owned(mb) if self.dp else mb
                self.optimizer.zero_grad()
                readings = (self._accumulate(mine, len(mb), int(self.token_mask[mb].sum()))
                            if mine else dict.fromkeys(MINIBATCH_READINGS, 0.0))
                if self.dp is not None:  # one all-reduce: gradients and readings
                    summed = self.dp.sum_gradients(params, list(readings.values()))
                    readings = dict(zip(readings, summed))
                    check_loss_finite(torch.tensor(readings.pop("loss")), self.ids)
                else:
                    readings.pop("loss")
                if self.signal_free:  # the value head's gradient alone (see its docs)
                    critic_gradients_only(self.policy, params)
                grad_norm, value_grad_norm = clip_gradients(
                    self.policy, params, settings.max_grad_norm, settings.clip_critic_apart)
                self.optimizer.step()
                norms = {"grad_norm": grad_norm}
                if value_grad_norm is not None:  # the critic detached: its norm read apart
                    norms["value_grad_norm"] = value_grad_norm
                for key, val in {**readings, **norms}.items():
                    stats.setdefault(key, []).append(val)
        out = {f"losses/{k}": float(np.mean(vals)) for k, vals in stats.items()}
        return {**out, "losses/policy_step_skipped": float(self.signal_free)}

    def _minibatches(self, gen: torch.Generator) -> list[list[int]]:
        """One epoch's minibatches (rows of the batch), in a fresh random order: steps
        ``minibatch_steps`` at a time; with one-sequence segments, whole segments (and
        window steps) until a minibatch holds ``minibatch_steps`` steps."""
        n, size = self.prep.n, self.settings.minibatch_steps
        if not self.prep.sequences:
            perm = torch.randperm(n, generator=gen).tolist()
            return [perm[start : start + size] for start in range(0, n, size)]
        return unit_minibatches(self.units, size, gen)

    def _micro_batches(self, rows: list[int]) -> list[list[int]]:
        """``rows`` in forward/backward passes: whole segments, longest first, up to
        ``micro_tokens`` tokens a pass counting the padding to its longest (one-sequence
        segments), else at most ``micro_steps`` rows."""
        prep, settings = self.prep, self.settings
        if prep.sequences and settings.micro_tokens > 0:
            units, lengths = read_units(rows, prep.contexts, prep.actions, prep.sequence_of)
            return [[i for u in group for i in units[u]]
                    for group in pack_by_length(lengths, settings.micro_tokens)]
        micro = settings.micro_steps
        if micro <= 0 or len(rows) <= micro:
            return [rows]
        return [rows[start : start + micro] for start in range(0, len(rows), micro)]

    def _row_units(self, rows: list[int]) -> list[list[int]]:
        """``rows`` grouped as read together (see :attr:`units`), in their order."""
        prep = self.prep
        return read_units(rows, prep.contexts, prep.actions, prep.sequence_of)[0]

    def _evaluate(self, rows: list[int]):
        prep = self.prep
        return evaluate_steps(self.policy, prep.contexts, prep.actions, rows, prep.sequences,
                              prep.sequence_of)

    def _proximal_logprobs(self, width: int) -> torch.Tensor:
        """Log-probs [n, width] of the actions under the weights before the update (each
        rank computes the rows it owns; the sum over ranks fills every row)."""
        prep = self.prep
        proximal = torch.zeros(prep.n, width)
        with torch.no_grad():
            for rows in index_slices(prep.n, 1024):
                rows = self.dp.owned(rows) if self.dp else rows
                if not rows:
                    continue
                out = self._evaluate(rows)
                proximal[rows, : out.logprobs.shape[1]] = out.logprobs.float()
        return self.dp.sum(proximal) if self.dp else proximal

    def _base_logprobs(self, width: int) -> torch.Tensor:
        """Log-probs [n, width] under the base model (adapters off), once per batch (a
        one-sequence segment read in one pass, as everywhere)."""
        prep = self.prep
        base = torch.zeros(prep.n, width)
        with self.policy.adapters_off():
            for rows in index_slices(prep.n, 1024):
                rows = self.dp.owned(rows) if self.dp else rows
                if rows:
                    out = self._evaluate(rows).logprobs
                    base[rows, : out.shape[1]] = out.float()
        return self.dp.sum(base) if self.dp else base

    def _accumulate(self, rows: list[int], mb_rows: int, mb_tokens: int) -> dict[str, float]:
        """The minibatch's gradient from ``rows`` (all of it, or this rank's share), in
        forward/backward passes of at most ``micro_steps`` rows (gradient accumulation: the
        activations held for backward are those of one micro-batch, so a large minibatch
        fits in memory). Each pass is a share of the minibatch, as a rank's share is, so the
        gradients and readings add up to those of one pass over ``rows``."""
        passes = self._micro_batches(rows)
        if len(passes) == 1:
            return self._minibatch_loss(rows, mb_rows, mb_tokens, shared=self.dp is not None)
        total = dict.fromkeys(MINIBATCH_READINGS, 0.0)
        for part_rows in passes:
            part = self._minibatch_loss(part_rows, mb_rows, mb_tokens, shared=True)
            for key, val in part.items():
                total[key] += val
        return total

    def _minibatch_loss(self, rows: list[int], mb_rows: int, mb_tokens: int, *,
                        shared: bool) -> dict[str, float]:
        """Back-propagate the loss of ``rows``, a share of a minibatch of ``mb_rows`` steps
        and ``mb_tokens`` action tokens (``shared``: a rank's or a micro-batch's share;
        else the whole minibatch): token means are taken over the minibatch's tokens and
        step means over its steps, so the shares add up to its loss. Returns the readings
        (the loss's parts, the PPO statistics), each scaled likewise."""
        settings, prep, dp = self.settings, self.prep, self.dp
        out = self._evaluate(rows)
        cols = out.logprobs.shape[1]
        mask = self.token_mask[rows, :cols]
        token_share = int(mask.sum()) / max(mb_tokens, 1) if shared else 1.0
        row_share = len(rows) / mb_rows if shared else 1.0
        tok_adv = broadcast_step_advantages(self.adv_norm[rows], mask)
        policy_loss, policy_stats = ppo_policy_loss(
            out.logprobs, self.proximal[rows, :cols], self.behaviour[rows, :cols], tok_adv,
            mask, settings.clip_eps, settings.is_cap)
        critic_loss = value_loss(out.values.float(), prep.values[rows], prep.returns[rows],
                                 clip=settings.value_clip or None)
        entropy = (out.entropy * mask).sum() / (max(mb_tokens, 1) if shared
                                                else mask.sum().clamp(min=1))
        kl = torch.zeros(())
        if self.base is not None:
            kl = kl_to_base(out.logprobs, self.base[rows, :cols], mask) / (
                max(mb_tokens, 1) if shared else mask.sum().clamp(min=1))
        loss = (token_share * policy_loss + settings.value_coef * row_share * critic_loss
                - settings.entropy_coef * entropy + settings.kl_to_base * kl)
        if dp is None:  # a group checks the summed loss, on every rank alike
            check_loss_finite(loss, self.ids)
        loss.backward()
        readings = {key: token_share * val for key, val in policy_stats.items()}
        readings.update({"policy_loss": token_share * float(policy_loss.detach()),
                         "value_loss": row_share * float(critic_loss.detach()),
                         "entropy": float(entropy.detach()), "kl_to_base": float(kl.detach()),
                         "loss": float(loss.detach())})
        return {key: readings[key] for key in MINIBATCH_READINGS}  # the all-reduce's order
