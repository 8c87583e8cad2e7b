"""Exploration maths: the annealing schedule and parameter-space noise.

Early in training the policy knows little and should try widely; later it should exploit.
The policy holders that apply these rules while acting live in
:mod:`gyre_async.core.exploration`; this module is the maths only (no policy, no config).

- **Schedule.** Progress is the acting policy's version: ``x = min(version /
  anneal_versions, 1)``. A value moves from its start to its end along a straight line, or
  half a cosine ``start + (end - start) * (1 - cos(pi x)) / 2`` (slow at both ends). A
  rollback is a new, higher version, so the schedule never rewinds.
- **Parameter-space noise** (Plappert et al. 2018, "Parameter Space Noise for
  Exploration"): act with a perturbed copy of the weights, ``theta + N(0, sigma^2)`` on
  every weight matrix and embedding (norms, biases and the value head stay clean: they set
  scales, not choices). Perturbing weights gives exploration that is consistent across a
  state's neighbourhood, unlike per-token sampling noise. ``sigma`` adapts so the perturbed
  policy stays a target distance away (:class:`AdaptiveParamNoise`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch


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
