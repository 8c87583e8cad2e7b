"""The sampler's policy holders: acting at the annealed schedule, with parameter noise.

The rules themselves (the schedule, the adaptive noise scale, the perturbation) are maths in
:mod:`gyre_async.rl.exploration`; this module applies them to a live policy, configured by
``[sampler.exploration]`` (``schemas.config.ExplorationConfig``):

- temperature moves from ``sampler.temperature`` to ``temperature_end`` and top-p from
  ``sampler.top_p`` to ``top_p_end`` over ``anneal_versions`` versions (``shape``);
- with ``param_noise_target_kl > 0`` the sampler acts with perturbed weights: every
  ``adapt_every`` batched calls the KL between clean and perturbed next-token distributions
  is measured on the most recent contexts, the noise scale adapts, and a fresh perturbation
  is drawn.

**Log-probs stay correct.** The holder (:class:`ScheduledPolicyHolder`) picks temperature
and top-p for the version it holds inside its lock, so weights and sampling parameters
always belong to the same version. ``Action.logprobs`` (recorded as ``action_logprobs`` on
every ``trajectory-step``, the learner's behaviour log-probs for the importance weight) come
from the very forward pass that sampled the action: the perturbed weights, at the annealed
temperature and top-p. The step is still stamped with the clean version it was derived
from, so staleness is counted as before.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from gyre_async import timing
from gyre_async.core.rollout import PolicyHolder
from gyre_async.policy.base import Policy, SamplingParams
from gyre_async.policy.factory import load_weights
from gyre_async.rl.exploration import (
    AdaptiveParamNoise,
    anneal,
    perturb,
    training_progress,
)
from gyre_async.rl.policy_distance import policy_kl
from schemas.config import Config


def sampling_params_at(cfg: Config, version: int) -> SamplingParams:
    """How the sampler draws actions while acting with ``version``."""
    sampler, schedule = cfg.sampler, cfg.sampler.exploration
    progress = (training_progress(version, schedule.anneal_versions)
                if schedule.anneal_versions else 0.0)
    temperature = anneal(sampler.temperature, schedule.temperature_end or sampler.temperature,
                         progress, schedule.shape)
    top_p = anneal(sampler.top_p, schedule.top_p_end or sampler.top_p, progress, schedule.shape)
    return SamplingParams(temperature=temperature, top_p=min(top_p, 1.0),
                          max_action_tokens=cfg.policy.max_action_tokens)


class ScheduledPolicyHolder(PolicyHolder):
    """A policy holder that samples at the schedule's parameters for the version it holds.

    The temperature and top-p are decided inside the holder's lock, from the version whose
    weights are loaded, so a batch can never pair new weights with the previous version's
    sampling parameters (a new version may land between the batcher's call and the lock).
    The ``params`` argument of :meth:`act` gives only what the schedule does not: it is
    overridden by :func:`sampling_params_at`.
    """

    def __init__(self, policy: Policy, cfg: Config):
        super().__init__(policy)
        self.cfg = cfg

    def params_now(self) -> SamplingParams:
        return sampling_params_at(self.cfg, max(self.version, 0))

    def act(self, contexts: list[list[int]], params: SamplingParams, seed: int | None,
            sessions: list[str | None] | None = None):
        with self.lock:
            self._before_act(contexts)
            with timing.timed("policy"):
                return (self.policy.act_batch(contexts, self.params_now(), seed=seed,
                                              sessions=sessions), self.version)

    def _before_act(self, contexts: list[list[int]]) -> None:
        """Hook run under the lock before each batch (parameter noise adapts here)."""

    def stats(self) -> dict[str, float]:
        params = self.params_now()
        return {"temperature": params.temperature, "top_p": params.top_p}


class PerturbedPolicyHolder(ScheduledPolicyHolder):
    """A scheduled holder whose policy acts with adaptively perturbed weights.

    ``load`` keeps the clean weights and installs a perturbed copy; each batch records its
    contexts (the probe set for the KL) and every ``adapt_every`` batches the noise adapts.
    Everything happens under the holder's lock, so no batch ever runs on half-swapped
    weights.
    """

    def __init__(self, policy: Policy, cfg: Config, seed: int = 0):
        super().__init__(policy, cfg)
        schedule = cfg.sampler.exploration
        self.noise = AdaptiveParamNoise(schedule.param_noise_target_kl,
                                        schedule.param_noise_initial_std,
                                        schedule.param_noise_adapt)
        self.adapt_every = max(schedule.param_noise_adapt_every, 1)
        self.recent: deque[list[int]] = deque(maxlen=max(schedule.param_noise_probe_contexts, 1))
        self.generator = torch.Generator().manual_seed(seed)
        self.clean: dict[str, torch.Tensor] | None = None
        self.perturbed: dict[str, torch.Tensor] | None = None
        self.calls = 0
        self.last_kl = float("nan")
        self.adaptations = 0

    def load(self, path: str, sha256: str, version: int) -> None:
        with self.lock:
            load_weights(self.policy, path, sha256)
            self.clean = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
            self.version = version
            self._redraw()

    def _before_act(self, contexts: list[list[int]]) -> None:
        self.recent.extend(contexts)
        self.calls += 1
        if self.clean is not None and self.calls % self.adapt_every == 0:
            self.adapt_now()

    def measure_kl(self, contexts: list[list[int]] | None = None) -> float:
        """KL(clean || perturbed) of next-token distributions on ``contexts`` (default:
        the recent ones). Leaves the perturbed weights installed."""
        assert self.clean is not None and self.perturbed is not None, "load weights first"
        probe = contexts if contexts is not None else list(self.recent)
        return policy_kl(self.policy, self.clean, self.perturbed, probe)

    def adapt_now(self) -> float:
        """One step of the adaptive rule: measure, rescale, redraw. Returns the KL measured."""
        if not self.recent:
            return self.last_kl
        self.last_kl = self.measure_kl()
        self.noise.adapt(self.last_kl)
        self.adaptations += 1
        self._redraw()
        return self.last_kl

    def _redraw(self) -> None:
        assert self.clean is not None
        self.perturbed = perturb(self.clean, self.noise.std, self.generator)
        self.policy.load_state_dict(self.perturbed)

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "param_noise_std": self.noise.std,
                "param_noise_kl": self.last_kl, "param_noise_target_kl": self.noise.target,
                "param_noise_adaptations": float(self.adaptations)}


def make_holder(cfg: Config, policy: Policy) -> ScheduledPolicyHolder:
    """The sampler's policy holder: scheduled, and perturbed when parameter-space noise is
    configured."""
    if cfg.sampler.exploration.param_noise_target_kl > 0:
        return PerturbedPolicyHolder(policy, cfg, seed=cfg.run.seed)
    return ScheduledPolicyHolder(policy, cfg)


def exploration_stats(holder: PolicyHolder) -> dict[str, float]:
    """Heartbeat numbers: what the sampler is exploring with right now."""
    if not isinstance(holder, ScheduledPolicyHolder):
        return {}
    return {k: v for k, v in holder.stats().items() if math.isfinite(v)}
