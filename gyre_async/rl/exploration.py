"""Exploration that anneals with training: sampling schedules and parameter-space noise.

Early in training the policy knows little and should try widely; later it should exploit.
Two knobs, both in ``[sampler.exploration]`` (``schemas.config.ExplorationConfig``):

- **Temperature / top-p schedule.** Progress is the acting policy's version:
  ``x = min(version / anneal_versions, 1)``. The value moves from the start
  (``sampler.temperature``, ``sampler.top_p``) to the end (``temperature_end``,
  ``top_p_end``) along a straight line, or half a cosine ``start + (end - start) * (1 -
  cos(pi x)) / 2`` (slow at both ends). A rollback is a new, higher version, so the
  schedule never rewinds.
- **Parameter-space noise** (Plappert et al. 2018, "Parameter Space Noise for
  Exploration"): the sampler acts with a perturbed copy of the weights, ``theta + N(0,
  sigma^2)`` on every weight matrix and embedding (norms, biases and the value head stay
  clean: they set scales, not choices). Perturbing weights gives exploration that is
  consistent across a state's neighbourhood, unlike per-token sampling noise. ``sigma``
  adapts so the perturbed policy stays a target distance away: every ``adapt_every``
  batched calls the KL between clean and perturbed next-token distributions is measured on
  the most recent contexts, then ``sigma *= alpha`` if it is below the target, ``sigma /=
  alpha`` if above, and a fresh perturbation is drawn.

**Log-probs stay correct.** The holder (:class:`ScheduledPolicyHolder`) picks temperature
and top-p for the version it holds inside its lock, so weights and sampling parameters
always belong to the same version. ``Action.logprobs`` (recorded as ``action_logprobs`` on every
``trajectory-step``, the learner's behaviour log-probs for the importance weight) come from
the very forward pass that sampled the action: the perturbed weights, at the annealed
temperature and top-p. The step is still stamped with the clean version it was derived
from, so staleness is counted as before.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

import torch

from schemas.config import Config

from gyre_async import timing
from gyre_async.policy.base import Policy, SamplingParams
from gyre_async.policy.factory import load_weights
from gyre_async.core.rollout import PolicyHolder
from gyre_async.rl.policy_distance import policy_kl


def anneal(start: float, end: float, progress: float, shape: str = "linear") -> float:
    """The scheduled value at ``progress`` in [0, 1] (clamped), from ``start`` to ``end``."""
    x = min(max(progress, 0.0), 1.0)
    if shape == "cosine":
        x = (1.0 - math.cos(math.pi * x)) / 2.0
    return start + (end - start) * x


def training_progress(version: int, anneal_versions: int) -> float:
    """Share of the schedule done at ``version`` (1 when there is no schedule)."""
    if anneal_versions <= 0:
        return 1.0
    return min(max(version, 0) / anneal_versions, 1.0)


def sampling_params_at(cfg: Config, version: int) -> SamplingParams:
    """How the sampler draws actions while acting with ``version``."""
    s, e = cfg.sampler, cfg.sampler.exploration
    x = training_progress(version, e.anneal_versions) if e.anneal_versions else 0.0
    temperature = anneal(s.temperature, e.temperature_end or s.temperature, x, e.shape)
    top_p = anneal(s.top_p, e.top_p_end or s.top_p, x, e.shape)
    return SamplingParams(temperature=temperature, top_p=min(top_p, 1.0),
                          max_action_tokens=cfg.policy.max_action_tokens)


class AdaptiveParamNoise:
    """The noise scale rule of Plappert et al. (2018), as a small pure class.

    ``adapt(d)``: ``std *= alpha`` when the measured distance ``d`` is below ``target``,
    ``std /= alpha`` otherwise. For small perturbations KL grows like ``std**2``, so the
    measured KL settles in a band of about ``alpha**±2`` around the target.
    """

    def __init__(self, target: float, initial_std: float, alpha: float):
        if target <= 0 or initial_std <= 0 or alpha <= 1:
            raise ValueError("AdaptiveParamNoise: target and initial_std must be > 0 and "
                             "alpha > 1 (see [sampler.exploration] param_noise_*)")
        self.target, self.std, self.alpha = target, initial_std, alpha

    def adapt(self, distance: float) -> float:
        self.std = self.std * self.alpha if distance < self.target else self.std / self.alpha
        return self.std


def is_perturbed(name: str, tensor: torch.Tensor) -> bool:
    """Weight matrices and embeddings; not norms, biases or the value head."""
    return tensor.is_floating_point() and tensor.dim() >= 2 and "value_head" not in name


def perturb(state: Mapping[str, torch.Tensor], std: float, generator: torch.Generator
            ) -> dict[str, torch.Tensor]:
    """A copy of ``state`` with N(0, std^2) noise on every perturbed tensor."""
    out = {}
    for name, t in state.items():
        if is_perturbed(name, t):
            noise = torch.randn(t.shape, generator=generator, dtype=torch.float32)
            out[name] = (t.float() + std * noise).to(t.dtype)
        else:
            out[name] = t.clone()
    return out


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

    def act(self, contexts: list[list[int]], params: SamplingParams, seed: int | None):
        with self.lock:
            self._before_act(contexts)
            with timing.timed("policy"):
                return (self.policy.act_batch(contexts, self.params_now(), seed=seed),
                        self.version)

    def _before_act(self, contexts: list[list[int]]) -> None:
        """Hook run under the lock before each batch (parameter noise adapts here)."""

    def stats(self) -> dict[str, float]:
        p = self.params_now()
        return {"temperature": p.temperature, "top_p": p.top_p}


class PerturbedPolicyHolder(ScheduledPolicyHolder):
    """A scheduled holder whose policy acts with adaptively perturbed weights.

    ``load`` keeps the clean weights and installs a perturbed copy; each batch records its
    contexts (the probe set for the KL) and every ``adapt_every`` batches the noise adapts.
    Everything happens under the holder's lock, so no batch ever runs on half-swapped
    weights.
    """

    def __init__(self, policy: Policy, cfg: Config, seed: int = 0):
        super().__init__(policy, cfg)
        e = cfg.sampler.exploration
        self.noise = AdaptiveParamNoise(e.param_noise_target_kl, e.param_noise_initial_std,
                                        e.param_noise_adapt)
        self.adapt_every = max(e.param_noise_adapt_every, 1)
        self.recent: deque[list[int]] = deque(maxlen=max(e.param_noise_probe_contexts, 1))
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
