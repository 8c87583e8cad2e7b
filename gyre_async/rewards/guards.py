"""Guards: verdicts that veto what the lower arbitration levels would pay.

Three guards, each a pure function of the segment (and, for farming, of the shaping
rewards the rule and process-model levels would pay on it):

``unproven``  A milestone claimed without environment-state proof (empty ``proof``). The
              claim is never paid; the segment's verdict is ``guard``. Scope: that claim.

``farming``   Reward farming: being paid, by the rule and process-model levels, for steps
              that prove no progress. Definitions, per trajectory, over the steps since
              its last proven milestone (a proven milestone resets the count):

              - *shaping pay* ``r_t`` = the sum, at step ``t``, of what the rule rewards and
                the process reward model would pay (never outcome or milestones);
              - a *cheap step* is a step with ``r_t > 0`` at which the environment proved no
                milestone: it was paid for something other than proven progress;
              - an *action* is named by the first ``farm_action_words`` words of its text
                (lower-cased; 0 = the whole text), so ``polish tools`` / ``polish floor``
                count as one action, as the environment parses them; a name longer than
                ``MAX_ACTION_NAME`` characters is kept as its start and a hash of the whole
                (equal names stay equal; the state that rides on ``scored`` stays small);
              - **repeated cheap actions**: one action makes ``farm_repeat`` cheap steps;
              - **pay far above the task's milestone rate**: the cheap pay ``sum(r_t)``
                exceeds ``farm_budget_ratio * milestone_reward``: between two proven
                milestones, shaping may pay at most that multiple of what proven
                progress pays, however many different cheap actions earn it.

              Either condition vetoes the segment where it happens: its shaping pay is
              withheld, and its no-progress pay is charged back (``guards.chargeback``
              times it, at the same steps); outcome and milestones stay (they are
              verified and paid once, so they cannot be farmed). A trajectory once caught
              stays caught until it ends: any later segment with a cheap step is vetoed
              the same way (farming just below the limits would otherwise still pay).
              The per-trajectory state rides on each ``scored`` event (``guard_state``),
              so a restarted arbiter resumes it.

``safety``    Pluggable rules ``rule(segment) -> reason | None`` named in
              ``guards.safety_rules`` (a registry name or ``"module:function"`` factory).
              A violation vetoes every positive reward of the segment, outcome and
              milestones included (a task done unsafely is not a success to reinforce),
              all of it charged back.

Built-in safety rule: ``forbidden_text`` (args ``words``: comma-separated phrases) — an
action containing one of the phrases is a violation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gyre_async.rewards.plugins import Registry
from gyre_async.rewards.rules import RuleFailed
from schemas.config import ArbiterConfig, RuleSpec
from schemas.events import Milestone, SegmentClosed

SafetyRule = Callable[[SegmentClosed], "str | None"]

SAFETY_RULES = Registry("safety rule")
register_safety_rule = SAFETY_RULES.register


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


def cheap_steps(seg: SegmentClosed, shaping: Sequence[float]) -> list[int]:
    """Steps (0-based in the segment) paid shaping reward with no milestone proven there."""
    progress = _progress_steps(seg)
    return [t for t in range(seg.step_end - seg.step_start)
            if shaping[t] > 0 and t not in progress]


def _progress_steps(seg: SegmentClosed) -> set[int]:
    steps = seg.milestone_steps or [seg.step_end - 1] * len(seg.milestones)
    return {s - seg.step_start for s, m in zip(steps, seg.milestones) if m.proof}


#: Longest action name the farming memory keeps as is (see ``action_name``).
MAX_ACTION_NAME = 64


def action_name(action: str, words: int) -> str:
    parts = action.lower().split()
    name = " ".join(parts[:words] if words > 0 else parts)
    if len(name) <= MAX_ACTION_NAME:
        return name
    digest = hashlib.blake2b(name.encode(), digest_size=8).hexdigest()
    return f"{name[:MAX_ACTION_NAME - 18]}~{digest}"


@dataclass(frozen=True)
class FarmState:
    """The farming guard's memory of one trajectory, since its last proven milestone."""

    repeats: dict[str, int]
    pay: float = 0.0
    caught: bool = False

    def encode(self) -> dict[str, float]:
        return {"pay": self.pay, "caught": float(self.caught),
                **{f"repeat:{a}": float(k) for a, k in self.repeats.items()}}

    @classmethod
    def decode(cls, d: dict[str, float]) -> FarmState:
        return cls({k.removeprefix("repeat:"): int(v) for k, v in d.items()
                    if k.startswith("repeat:")}, d.get("pay", 0.0), d.get("caught", 0.0) > 0)


NEW_TRAJECTORY = FarmState({})


def farming_verdict(seg: SegmentClosed, shaping: Sequence[float], config: ArbiterConfig,
                    state: FarmState = NEW_TRAJECTORY) -> tuple[Verdict | None, FarmState]:
    """The farming guard (exact definitions in the module docstring): verdict, new state."""
    g = config.guards
    n = seg.step_end - seg.step_start
    actions = seg.actions if len(seg.actions) == n else [""] * n
    progress = _progress_steps(seg)
    repeats, pay = dict(state.repeats), state.pay
    budget = g.farm_budget_ratio * config.milestone_reward
    reasons, cheap, flagged = [], 0, set()
    for t in range(n):
        if t in progress:
            repeats, pay = {}, 0.0
            continue
        if shaping[t] <= 0:
            continue
        cheap += 1
        name = action_name(actions[t], g.farm_action_words)
        repeats[name] = repeats.get(name, 0) + 1
        pay += shaping[t]
        if repeats[name] >= g.farm_repeat and name not in flagged:
            flagged.add(name)
            reasons.append(f"repeated cheap action {name!r}: paid {repeats[name]} times "
                           "without progress")
        if pay > budget and "" not in flagged:
            flagged.add("")
            reasons.append(f"paid {pay:.4g} without progress, above {g.farm_budget_ratio:g} x "
                           f"the milestone reward ({budget:.4g})")
    if state.caught and cheap and not reasons:
        reasons.append(f"{cheap} steps paid without progress after this trajectory was "
                       "caught farming")
    caught = state.caught or bool(reasons)
    verdict = Verdict("farming", "; ".join(reasons), "shaping") if reasons else None
    return verdict, FarmState(repeats, pay, caught)


class SafetyRules:
    """The configured safety rules, built once at start-up."""

    def __init__(self, specs: Sequence[RuleSpec]):
        self.rules = [(f"guard:safety:{s.name}",
                       SAFETY_RULES.build(s.name, dict(s.args))) for s in specs]

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
