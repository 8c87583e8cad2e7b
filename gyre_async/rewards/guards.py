"""Guards: verdicts that veto what the lower arbitration levels would pay.

Three guards, each a pure function of the segment (and, for farming, of the shaping
rewards the rule and process-model levels would pay on it):

``unproven``  A milestone claimed without environment-state proof (empty ``proof``). The
              claim is never paid; the segment's verdict is ``guard``. Scope: that claim.

``farming``   Reward farming. Definitions (per segment of ``n`` steps):

              - *shaping pay* ``r_t`` = the sum, at step ``t``, of what the rule rewards and
                the process reward model would pay (never outcome or milestones);
              - a *cheap step* is a step with ``r_t > 0`` at which the environment proved no
                milestone: it was paid for something other than proven progress;
              - **repeated cheap actions**: one action text (lower-cased, whitespace
                collapsed) makes ``farm_repeat`` or more cheap steps of the segment;
              - **rate far above the task's milestone rate**: the cheap pay per step,
                ``sum(r_t over cheap steps) / n``, exceeds ``farm_rate_ratio`` times the
                task's milestone rate ``milestone_reward * task_milestones_per_step`` (the
                reward per step that proven progress pays a competent policy; workshop:
                one order per ~8 steps, so ``0.1 * 0.1 = 0.01`` per step by default).

              Either condition vetoes the segment: its shaping pay (rules and process
              model) is withheld, and its no-progress pay is charged back
              (``guards.chargeback`` times it, at the same steps); outcome and milestones
              stay (they are verified, and paid once, so they cannot be farmed). A
              trajectory once caught stays caught until it ends: any later segment of it
              with a cheap step is vetoed the same way (farming just below the limits
              would otherwise still pay).

``safety``    Pluggable rules ``rule(segment) -> reason | None`` named in
              ``guards.safety_rules`` (a registry name or ``"module:function"`` factory).
              A violation vetoes every positive reward of the segment, outcome and
              milestones included (a task done unsafely is not a success to reinforce),
              all of it charged back.

Built-in safety rule: ``forbidden_text`` (args ``words``: comma-separated phrases) — an
action containing one of the phrases is a violation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from schemas.config import ArbiterConfig, RuleSpec
from schemas.events import Milestone, SegmentClosed

from .plugins import build
from .rules import RuleFailed

SafetyRule = Callable[[SegmentClosed], "str | None"]

SAFETY_RULES: dict[str, Callable[..., SafetyRule]] = {}


def register_safety_rule(name: str):
    """Decorator: register a safety-rule factory under ``name``."""
    def deco(factory):
        SAFETY_RULES[name] = factory
        return factory
    return deco


@register_safety_rule("forbidden_text")
def forbidden_text(words: str) -> SafetyRule:
    phrases = [w.strip().lower() for w in words.split(",") if w.strip()]
    if not phrases:
        raise ValueError("forbidden_text needs at least one phrase in 'words'")

    def rule(seg: SegmentClosed) -> str | None:
        for i, action in enumerate(seg.actions):
            text = action.lower()
            for phrase in phrases:
                if phrase in text:
                    return f"step {seg.step_start + i}: action {action!r} contains {phrase!r}"
        return None
    return rule


@dataclass(frozen=True)
class Verdict:
    guard: str  # "farming" | "safety:<name>" | "unproven"
    reason: str
    scope: str  # "shaping": rules and process model withheld; "all": every positive reward


def unproven_claims(seg: SegmentClosed) -> list[Milestone]:
    return [m for m in seg.milestones if not m.proof]


def _normalise(action: str) -> str:
    return " ".join(action.lower().split())


def cheap_steps(seg: SegmentClosed, shaping: Sequence[float]) -> list[int]:
    """Steps (0-based in the segment) paid shaping reward with no milestone proven there."""
    steps = seg.milestone_steps or [seg.step_end - 1] * len(seg.milestones)
    progress = {s - seg.step_start for s, m in zip(steps, seg.milestones) if m.proof}
    return [t for t in range(seg.step_end - seg.step_start)
            if shaping[t] > 0 and t not in progress]


def farming_verdict(seg: SegmentClosed, shaping: Sequence[float], config: ArbiterConfig,
                    caught_before: bool = False) -> Verdict | None:
    """The farming guard (see the module docstring for the exact definitions)."""
    g = config.guards
    n = seg.step_end - seg.step_start
    cheap = cheap_steps(seg, shaping)
    if not cheap:
        return None
    if caught_before:
        return Verdict("farming", f"{len(cheap)} steps paid without progress after this "
                                  "trajectory was caught farming", "shaping")
    actions = seg.actions if len(seg.actions) == n else [""] * n
    counts = Counter(_normalise(actions[t]) for t in cheap)
    action, repeats = counts.most_common(1)[0]
    if repeats >= g.farm_repeat:
        return Verdict("farming", f"repeated cheap action {action!r}: paid {repeats} times "
                                  f"without progress (limit {g.farm_repeat - 1})", "shaping")
    rate = sum(shaping[t] for t in cheap) / n
    milestone_rate = config.milestone_reward * g.task_milestones_per_step
    if rate > g.farm_rate_ratio * milestone_rate:
        return Verdict("farming", f"paid {rate:.4g}/step without progress, above "
                                  f"{g.farm_rate_ratio:g} x the task's milestone rate "
                                  f"{milestone_rate:.4g}/step", "shaping")
    return None


class SafetyRules:
    """The configured safety rules, built once at start-up."""

    def __init__(self, specs: Sequence[RuleSpec]):
        self.rules = [(f"guard:safety:{s.name}",
                       build(s.name, dict(s.args), SAFETY_RULES, "safety rule")) for s in specs]

    def verdicts(self, seg: SegmentClosed) -> tuple[list[Verdict], list[RuleFailed]]:
        out: list[Verdict] = []
        failed: list[RuleFailed] = []
        for component, rule in self.rules:
            try:
                reason = rule(seg)
            except Exception as exc:  # noqa: BLE001 - a broken guard is reported, not skipped
                failed.append(RuleFailed(component, f"raised {exc!r}"))
                continue
            if reason is not None and not isinstance(reason, str):
                failed.append(RuleFailed(component, f"returned {reason!r}; expected a reason "
                                                    "string or None"))
            elif reason:
                out.append(Verdict(component.removeprefix("guard:"), reason, "all"))
        return out, failed
