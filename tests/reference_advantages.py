"""Slow, obviously-correct references for the credit-assignment maths in ``gyre_async.rl``
(:mod:`~gyre_async.rl.advantages`, :mod:`~gyre_async.rl.fusion`): plain Python loops over
floats, one segment or group at a time, written from the formulas in those modules'
docstrings. ``test_advantages.py`` and ``test_fusion.py`` check the fast tensor code against
them on random inputs. They live with the tests because nothing else may call them.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from gyre_async.rl.fusion import CreditMode


def slow_segment_gae(
    rewards: Sequence[Sequence[float]],
    values: Sequence[Sequence[float]],
    mask: Sequence[Sequence[float]],
    bootstrap_values: Sequence[float],
    terminal: Sequence[bool],
    gamma: float,
    lam: float,
) -> tuple[list[list[float]], list[list[float]]]:
    """Reference for :func:`gyre_async.rl.advantages.segment_gae`: one segment at a time,
    textbook GAE in floats."""
    all_adv, all_ret = [], []
    for b in range(len(rewards)):
        length = sum(1 for x in mask[b] if x)
        horizon = len(rewards[b])
        adv = [0.0] * horizon
        ret = [0.0] * horizon
        last_gae = 0.0
        for t in reversed(range(length)):
            if t == length - 1:
                next_value = 0.0 if terminal[b] else float(bootstrap_values[b])
                last_gae = 0.0
            else:
                next_value = float(values[b][t + 1])
            delta = float(rewards[b][t]) + gamma * next_value - float(values[b][t])
            last_gae = delta + gamma * lam * last_gae
            adv[t] = last_gae
            ret[t] = last_gae + float(values[b][t])
        all_adv.append(adv)
        all_ret.append(ret)
    return all_adv, all_ret


def slow_group_outcome_advantage(
    outcomes: Sequence[float], group_ids: Sequence[Hashable], eps: float = 1e-6
) -> list[float]:
    """Reference for :func:`gyre_async.rl.advantages.group_outcome_advantage`, one group at
    a time."""
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    adv = [0.0] * len(outcomes)
    for idx in members.values():
        xs = [float(outcomes[i]) for i in idx]
        if len(xs) < 2 or max(xs) == min(xs):
            continue
        mean = sum(xs) / len(xs)
        std = (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5
        for i in idx:
            adv[i] = (float(outcomes[i]) - mean) / (std + eps)
    return adv


def slow_fusion_weight(
    local: Sequence[Sequence[float]],
    global_adv: Sequence[float],
    mask: Sequence[Sequence[float]],
    w_max: float = 0.5,
    eps: float = 1e-8,
) -> list[float]:
    """Reference for :func:`gyre_async.rl.advantages.fusion_weight`."""
    out = []
    for b in range(len(local)):
        real = [float(local[b][t]) for t in range(len(local[b])) if mask[b][t]]
        mean_local = sum(real) / len(real) if real else 0.0
        g = float(global_adv[b])
        g = 0.0 if g != g else abs(g)
        out.append(min(max(w_max * g / (g + abs(mean_local) + eps), 0.0), w_max))
    return out


def slow_fuse_advantages(
    local: Sequence[Sequence[float]],
    global_adv: Sequence[float],
    weight: Sequence[float],
    mask: Sequence[Sequence[float]] | None = None,
) -> list[list[float]]:
    """Reference for :func:`gyre_async.rl.advantages.fuse_advantages`."""
    out = []
    for b in range(len(local)):
        g = float(global_adv[b])
        g = 0.0 if g != g else g
        w = float(weight[b])
        row = []
        for t in range(len(local[b])):
            real = True if mask is None else bool(mask[b][t])
            row.append((1.0 - w) * float(local[b][t]) + w * g if real else 0.0)
        out.append(row)
    return out


def slow_fuse_segments(
    local: Sequence[Sequence[float]],
    mask: Sequence[Sequence[float]],
    global_adv: Sequence[float],
    mode: CreditMode = "fusion",
    w_max: float = 0.8,
    eps: float = 1e-8,
    silent: str = "local",
) -> tuple[list[list[float]], list[float]]:
    """Reference for :func:`gyre_async.rl.fusion.fuse_segments`, written out step by step.
    ``silent="skip"``: a fusion segment whose known outcome advantage is exactly 0 (its
    group's returns all equal) gets 0 everywhere and counts nothing towards the scale."""
    def is_silent(i: int) -> bool:
        return mode == "fusion" and silent == "skip" and float(global_adv[i]) == 0.0

    real = [(i, t) for i in range(len(local)) for t in range(len(local[i]))
            if mask[i][t] and not is_silent(i)]
    scale = math.sqrt(sum(float(local[i][t]) ** 2 for i, t in real) / max(len(real), 1))
    out, weights = [], []
    for i, row in enumerate(local):
        g = float(global_adv[i])
        known = g == g
        steps = [t for t in range(len(row)) if mask[i][t]]
        if is_silent(i):
            w, values = 0.0, {}
        elif mode == "gae":
            w, values = 0.0, {t: float(row[t]) for t in steps}
        elif mode == "outcome":
            w, values = (1.0 if known else 0.0), {t: (g if known else 0.0) for t in steps}
        else:
            unit = {t: float(row[t]) / (scale + eps) for t in steps}
            m = sum(unit.values()) / len(steps) if steps else 0.0
            w = w_max * abs(g) / (abs(g) + abs(m) + eps) if known else 0.0
            w = min(max(w, 0.0), w_max)
            values = {t: (1.0 - w) * unit[t] + w * (g if known else 0.0) for t in steps}
        out.append([values.get(t, 0.0) for t in range(len(row))])
        weights.append(w)
    return out, weights


def slow_anchored_credit(
    returns: Sequence[Sequence[float]],
    mask: Sequence[Sequence[float]],
    anchors: Sequence[Sequence[Hashable]],
    global_adv: Sequence[float],
    eps: float = 1e-6,
) -> tuple[list[list[float]], list[float]]:
    """Reference for :func:`gyre_async.rl.fusion.anchored_credit`: each anchor group's
    returns compared one group at a time, the known outcome added to every step."""
    steps = [(i, t) for i in range(len(returns)) for t in range(len(returns[i])) if mask[i][t]]
    groups: dict[Hashable, list[tuple[int, int]]] = {}
    for i, t in steps:
        groups.setdefault(anchors[i][t], []).append((i, t))
    step_adv: dict[tuple[int, int], float] = {}
    for members in groups.values():
        xs = [float(returns[i][t]) for i, t in members]
        if len(xs) < 2 or max(xs) == min(xs):
            continue
        mean = sum(xs) / len(xs)
        std = (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5
        for (i, t), x in zip(members, xs):
            step_adv[(i, t)] = (x - mean) / (std + eps)
    out, weights = [], []
    for i, row in enumerate(returns):
        g = float(global_adv[i])
        known = g == g
        weights.append(1.0 if known else 0.0)
        out.append([((g if known else 0.0) + step_adv.get((i, t), 0.0)) if mask[i][t] else 0.0
                    for t in range(len(row))])
    return out, weights
