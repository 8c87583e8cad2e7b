"""The keeper's judgement, without I/O: which validation is best, and what is a regression.

Why a rule at all: validation runs a few dozen episodes, so two evaluations of the *same*
weights differ by ±10-30 points of success rate. Rolling back on every dip would undo real
progress; never rolling back lets one poisoned update wreck the run. The rule below rolls
back only when the drop is larger than the noise of the two measurements: on several
metrics at once, or on the success rate alone when its drop is far beyond that noise.

**Regression rule.** Each validation metric is a rate in [0, 1] measured on ``n``
episodes: the success rate, the mean score (the workshop's score is the share of orders
done) and each milestone's rate (share of episodes that reached it). For a metric with best
value ``p_b`` (``n_b`` episodes) and new value ``p_e`` (``n_e`` episodes), with the pooled
rate ``p = (p_b n_b + p_e n_e) / (n_b + n_e)``, the drop's standard error is the two-
proportion binomial one::

    se = sqrt(p (1 - p) (1/n_b + 1/n_e)),   z = (p_b - p_e) / se

For the mean score (not a count of successes) the same formula is an upper bound on the
standard error: a variable in [0, 1] with mean m has variance at most m (1 - m). When
``p`` is 0 or 1 both measurements agree exactly and nothing regressed (``se`` 0, ``z`` 0).
A metric *regresses* when ``z > k`` (``keeper.noise_k``, default 3: a drop this large
between equal policies has probability ~0.1% per metric under the normal approximation;
2 would give ~2.3%). The version *regresses* when the **success rate** regresses and
either

1. its drop alone is decisive: ``z > keeper.success_alone_k`` (default 4), or
2. at least ``min_regressed_metrics`` (default 2) metrics regress at once, the success
   rate counted.

Success must be among them (``require_success_regression``, default on) because
partial-progress metrics dip on their own early in training: a random policy completes
many sub-tasks by luck, and a policy that is narrowing towards the task loses that
breadth before it gains success (the quickstart's score fell from 0.41 at v0 to 0.23 at
v20, one milestone rate by 3.2 standard errors, before success rose to 100%). One metric
alone can be a fluke or a legitimate trade (a milestone skipped by a better route). The
metrics are correlated, not independent witnesses: on a one-order workshop task the score
*is* the success rate, so the two always regress together and the rule reduces to one
binomial test at ``noise_k``.

**Why success alone can decide, and why at 4.** Corroboration fails exactly on a collapse
near the top: once most episodes succeed, the score and the milestone rates sit near 1
and a policy that stops *finishing* still does most sub-tasks, so they fall far less than
success. Success 27/32 = 0.844 -> 7/32 = 0.219 (the quickstart's collapse): pooled
``p = 34/64 = 0.531``, ``se = sqrt(0.531 * 0.469 * 2/32) = 0.125``, ``z = 0.625 / 0.125
= 5.0``; 9/32 = 0.281 a version later gives ``z = 4.5``. Meanwhile a score of 0.95 -> 0.72
gives ``z = 2.5`` (pooled 0.835, se 0.093) and a milestone rate 0.875 -> 0.656 gives 2.1:
no second metric, so rule 2 alone never rolled back. The alone threshold is higher than
``noise_k`` because the best is the *maximum* of every evaluation so far, so it sits
above its policy's true rate (the winner's curse) and the drops measured against it are
inflated. Simulated with 32 episodes per evaluation, a policy on a plateau (true success
0.3 to 0.8) judged 39 times against its running best drops below it by more than 3
standard errors in 1.6-2.1% of evaluations (33-39% of such runs would see a false
rollback), by more than 4 in 0.02-0.06% (0.8-2% of runs). Between 3 and 4 standard errors
the success drop still needs a second metric (rule 2): 0.75 -> 0.375 on 32 episodes
(``z = 3.02``) with the score at ``z = 1.8`` is left alone.

**Best version.** Highest success rate; ties go to the higher mean score, then to the
earlier version (it has stood longer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from schemas.config import KeeperConfig
from schemas.events import EvalResult


def metric_values(result: EvalResult) -> dict[str, float]:
    """The rates the rule compares: success, score and one per milestone."""
    values = {"success_rate": result.success_rate, "mean_score": result.mean_score}
    for name, rate in result.milestone_rates.items():
        values[f"milestone/{name}"] = rate
    return values


def drop_z(best: float, best_n: int, new: float, new_n: int) -> float:
    """z-score of the drop ``best - new`` of two rates (pooled two-proportion binomial)."""
    if best_n <= 0 or new_n <= 0:
        return 0.0
    pooled = (best * best_n + new * new_n) / (best_n + new_n)
    var = pooled * (1.0 - pooled) * (1.0 / best_n + 1.0 / new_n)
    if var <= 0.0:
        return 0.0
    return (best - new) / math.sqrt(var)


@dataclass(frozen=True)
class Verdict:
    """Whether a new evaluation regressed against the best one, and why."""

    regressed: bool
    regressed_metrics: tuple[str, ...]
    evidence: dict[str, float] = field(default_factory=dict)  # per metric: best, new, z
    why: str = ""


def judge(best: EvalResult, new: EvalResult, noise_k: float, min_metrics: int,
          require_success: bool = True,
          success_alone_k: float = KeeperConfig().success_alone_k) -> Verdict:
    """Apply the regression rule of the module docstring to ``new`` against ``best``."""
    best_values, new_values = metric_values(best), metric_values(new)
    evidence: dict[str, float] = {}
    regressed: list[str] = []
    for name, b in best_values.items():
        e = new_values.get(name, 0.0)  # a milestone never reached now has rate 0
        z = drop_z(b, best.episodes, e, new.episodes)
        evidence[f"{name}/best"] = b
        evidence[f"{name}/new"] = e
        evidence[f"{name}/z"] = z
        if z > noise_k:
            regressed.append(name)
    success_z = evidence["success_rate/z"]
    decisive = "success_rate" in regressed and success_alone_k > 0 and \
        success_z > success_alone_k
    corroborated = len(regressed) >= max(min_metrics, 1) and \
        (not require_success or "success_rate" in regressed)
    parts = [f"{m} {best_values[m]:.3f}->{new_values.get(m, 0.0):.3f} "
             f"(z={evidence[f'{m}/z']:.2f})" for m in regressed]
    if decisive and not corroborated:
        why = (f"v{new.policy_version} regressed against best v{best.policy_version}: "
               f"success rate beyond {success_alone_k:g} standard errors, decisive alone: "
               + "; ".join(parts))
    elif corroborated:
        why = (f"v{new.policy_version} regressed against best v{best.policy_version} on "
               f"{len(regressed)} metrics beyond {noise_k:g} standard errors: "
               + "; ".join(parts))
    else:
        why = ""
    return Verdict(decisive or corroborated, tuple(regressed), evidence, why)


def is_better(candidate: EvalResult, incumbent: EvalResult | None) -> bool:
    """Strictly better validation: success rate, then mean score (earlier wins ties)."""
    if incumbent is None:
        return True
    return (candidate.success_rate, candidate.mean_score) > \
        (incumbent.success_rate, incumbent.mean_score)
