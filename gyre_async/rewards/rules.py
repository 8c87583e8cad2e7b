"""Rule rewards: configurable checks over a closed segment ("compiled", "tests passed").

A rule is a pure function ``rule(segment) -> per-step rewards`` (one float per step of the
segment), built by a factory from the ``args`` of its :class:`~schemas.config.RuleSpec` and
multiplied by the spec's ``weight``. Rules see only what the segment event carries: actions,
raw environment feedback, milestones with their state proofs. A rule that raises, returns
the wrong length or a non-finite value *fails* (the arbiter emits ``reward-failed``); it is
never read as zero.

Built-in rules (``[[arbiter.rules]] name = ...``):

- ``proven_fact`` (args ``milestone``: a name prefix, optional ``proof``: a substring) —
  pays 1 at each step where the environment proved a milestone whose name starts with
  ``milestone`` (and whose proof contains ``proof``). This is the "compiled" / "tests
  passed" check for environments that report those as proven facts; in the workshop,
  ``milestone = "craft:lamp"`` pays lamp orders.
- ``env_feedback`` — pays the environment's raw per-step feedback. It is the naive shaping
  a reward hacker loves: in the workshop it pays ``polish tools`` as much as progress. It
  exists to show (``ops/bench/guards.py``) what the farming guard is for.

Add a rule with :func:`register_rule`, or configure any ``"module:function"`` factory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from gyre_async.rewards.plugins import Registry
from schemas.config import RuleSpec
from schemas.events import SegmentClosed

Rule = Callable[[SegmentClosed], Sequence[float]]

RULES = Registry("rule")
register_rule = RULES.register


@register_rule("proven_fact")
def proven_fact(milestone: str, proof: str = "") -> Rule:
    def rule(seg: SegmentClosed) -> list[float]:
        out = [0.0] * (seg.step_end - seg.step_start)
        steps = seg.milestone_steps or [seg.step_end - 1] * len(seg.milestones)
        for m, step in zip(seg.milestones, steps):
            if m.proof and m.name.startswith(milestone) and proof in m.proof:
                out[step - seg.step_start] += 1.0
        return out
    return rule


@register_rule("env_feedback")
def env_feedback() -> Rule:
    def rule(seg: SegmentClosed) -> list[float]:
        return list(seg.feedback) or [0.0] * (seg.step_end - seg.step_start)
    return rule


class RuleFailed(Exception):
    """A rule (or guard) failed on one segment; the arbiter reports it as reward-failed."""

    def __init__(self, component: str, reason: str):
        super().__init__(f"{component}: {reason}")
        self.component = component
        self.reason = reason


class RuleSet:
    """The configured rules, built once; ``per_step`` runs them on one segment."""

    def __init__(self, specs: Sequence[RuleSpec]):
        self.rules: list[tuple[str, float, Rule]] = []
        for i, s in enumerate(specs):
            component = f"rule:{s.name}"
            if any(c == component for c, _, _ in self.rules):
                component += f"#{i + 1}"  # the same rule twice, with other args
            self.rules.append((component, s.weight, RULES.build(s.name, dict(s.args))))

    def per_step(self, seg: SegmentClosed) -> tuple[dict[str, list[float]], list[RuleFailed]]:
        """Weighted per-step rewards of every rule that worked, and the failures."""
        n = seg.step_end - seg.step_start
        out: dict[str, list[float]] = {}
        failed: list[RuleFailed] = []
        for component, weight, rule in self.rules:
            try:
                values = [float(v) for v in rule(seg)]
            except Exception as exc:  # noqa: BLE001 - any rule error becomes reward-failed
                failed.append(RuleFailed(component, f"raised {exc!r}"))
                continue
            if len(values) != n:
                failed.append(RuleFailed(component, f"returned {len(values)} values for a "
                                                    f"{n}-step segment"))
            elif not all(math.isfinite(v) for v in values):
                failed.append(RuleFailed(component, f"returned a non-finite value: {values}"))
            else:
                out[component] = [weight * v for v in values]
        return out, failed
