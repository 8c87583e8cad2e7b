"""Token-by-token references of the PPO losses in :mod:`gyre_async.rl.ppo` (the tests
compare the vectorised losses with these; slow on purpose, never used by the library)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def slow_ppo_policy_loss(
    new_logp: Sequence[Sequence[float]],
    prox_logp: Sequence[Sequence[float]],
    behav_logp: Sequence[Sequence[float]],
    advantages: Sequence[Sequence[float]],
    mask: Sequence[Sequence[float]],
    clip_eps: float = 0.2,
    is_cap: float = 5.0,
) -> tuple[float, dict[str, float]]:
    """Reference for :func:`ppo_policy_loss`, token by token."""
    total = clipped = kl = wsum = capped = 0.0
    n = 0
    for b in range(len(new_logp)):
        for a in range(len(new_logp[b])):
            if not mask[b][a]:
                continue
            n += 1
            lr = float(new_logp[b][a]) - float(prox_logp[b][a])
            r = math.exp(lr)
            adv = float(advantages[b][a])
            s1 = r * adv
            s2 = min(max(r, 1.0 - clip_eps), 1.0 + clip_eps) * adv
            raw_w = math.exp(float(prox_logp[b][a]) - float(behav_logp[b][a]))
            w = min(raw_w, is_cap)
            total += -min(s1, s2) * w
            clipped += 1.0 if s2 < s1 else 0.0
            kl += (r - 1.0) - lr
            wsum += w
            capped += 1.0 if raw_w > is_cap else 0.0
    d = max(n, 1)
    stats = {
        "clip_fraction": clipped / d,
        "approx_kl": kl / d,
        "importance_weight_mean": wsum / d,
        "importance_weight_capped": capped / d,
    }
    return total / d, stats


def slow_value_loss(
    new_v: Sequence[float],
    old_v: Sequence[float],
    returns: Sequence[float],
    clip: float | None,
    mask: Sequence[float] | None = None,
) -> float:
    """Reference for :func:`value_loss` over flat sequences."""
    total, n = 0.0, 0
    for i in range(len(new_v)):
        if mask is not None and not mask[i]:
            continue
        v, o, r = float(new_v[i]), float(old_v[i]), float(returns[i])
        err = (v - r) ** 2
        if clip is not None:
            v_clip = o + min(max(v - o, -clip), clip)
            err = max(err, (v_clip - r) ** 2)
        total += err
        n += 1
    return 0.5 * total / max(n, 1)


def slow_entropy_bonus(
    logits: Sequence[Sequence[Sequence[float]]], mask: Sequence[Sequence[float]]
) -> float:
    """Reference for :func:`entropy_bonus`."""
    total, n = 0.0, 0
    for b in range(len(logits)):
        for a in range(len(logits[b])):
            if not mask[b][a]:
                continue
            zs = [float(z) for z in logits[b][a]]
            top = max(zs)
            log_norm = top + math.log(sum(math.exp(z - top) for z in zs))
            total += -sum(math.exp(z - log_norm) * (z - log_norm) for z in zs)
            n += 1
    return total / max(n, 1)
