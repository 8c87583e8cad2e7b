"""Arbitration: every reward component of a segment, and who decides, in one pure function.

Levels, highest first. The first level that applies *decides* (``Scored.decided_by``);
every component is recorded in ``Scored.components`` whether paid or not:

=========== ============================================================================
level       what it does
=========== ============================================================================
guard       vetoes. ``unproven``: a milestone claim without state proof is not paid.
            ``farming``: since the last proven milestone, one action paid without
            progress ``farm_repeat`` times, or no-progress pay above
            ``farm_budget_ratio * milestone_reward``: the segment's rule and process
            rewards are withheld and the no-progress pay charged back (and the
            trajectory stays caught until it ends).
            ``safety:<rule>``: a pluggable safety rule withholds every positive reward
            (charged back too).
            (Definitions: :mod:`gyre_async.rewards.guards`.)
outcome     the verifiable outcome of a finished trajectory, at its last step (none for
            an episode ended by a failure: ``SegmentClosed.failure``).
milestone   each task milestone proven by environment state, paid once per trajectory
            at the step it was reached (tied to the task's milestones, not to actions).
rule        configured checks (``arbiter.rules``), weighted (:mod:`.rules`).
prm         the process reward model, ``weight * mean step score`` (:mod:`.prm`).
none        nothing paid (the learner still trains on the segment through its values).
=========== ============================================================================

Raw environment feedback is recorded (``feedback``) but paid only if a rule pays it.

Components: ``outcome``, ``milestone``, ``feedback``, ``rule:<name>``, ``prm``,
``prm:weight`` (the weight in force), ``guard:unproven`` (claims vetoed), ``guard:farming``
and ``guard:safety`` (1 when they vetoed), ``guard:vetoed`` (pay withheld) and
``guard:chargeback`` (``-chargeback`` times the vetoed no-progress pay, all vetoed pay for
safety, charged at those steps: a veto alone would leave farming a free bet).
``step_rewards`` sum to ``total``. ``guard_reasons`` says why each guard fired;
``guard_state`` carries the farming guard's memory of the trajectory. A verdict carries no
text of the segment's actions beyond a bounded name per action and reasons cut to
``MAX_REASON_CHARS``: its size grows with the segment's step count only (one reward per
step, which the learner trains on), never with what the agent wrote.

Failures: a component that raises, returns a non-finite value or the wrong length, or a
process model that cannot be loaded, yields one ``reward-failed`` event per failed
component and **no scored event**: the segment is withheld, never paid with the failed part
read as zero. Its milestones are not marked paid. The learner never trains on it; monitors
count ``reward-failed`` on the ``scored`` topic. The arbiter commits the input, so a
persistent failure (a missing weights file) withholds every segment, loudly, until fixed.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre_async.rewards.guards import (
    NEW_TRAJECTORY,
    FarmState,
    SafetyRules,
    Verdict,
    cheap_steps,
    farming_verdict,
    unproven_claims,
)
from gyre_async.rewards.prm import ProcessReward
from gyre_async.rewards.rules import RuleFailed, RuleSet
from schemas import event_id
from schemas.config import ArbiterConfig
from schemas.events import RewardFailed, Scored, SegmentClosed

LEVELS = ("guard", "outcome", "milestone", "rule", "prm", "none")


@dataclass
class Verdicts:
    scored: Scored | None
    failed: list[RewardFailed]


class Arbitration:
    """Builds the configured components once; :meth:`score` is pure given its arguments
    (and the process model's weights file)."""

    def __init__(self, config: ArbiterConfig):
        self.config = config
        self.rules = RuleSet(config.rules)
        self.safety = SafetyRules(config.guards.safety_rules)
        self.prm = ProcessReward(config.prm.path, config.prm.weight)

    def score(self, seg: SegmentClosed, paid: set[str], producer: str,
              prm_weight: float | None = None,
              farm_state: FarmState = NEW_TRAJECTORY) -> Verdicts:
        """One segment and its trajectory's state (milestones already paid, the farming
        guard's memory) -> scored (carrying the new farming state) or failed."""
        c = self.config
        n = seg.step_end - seg.step_start
        failures: list[RuleFailed] = []
        weight = c.prm.weight if prm_weight is None else prm_weight

        # --- components, computed independently --------------------------------------------
        shaping, rule_failures = self.rules.per_step(seg)
        failures += rule_failures
        if self.prm.enabled:
            try:
                shaping["prm"] = self.prm.per_step(seg, weight)
            except Exception as exc:  # noqa: BLE001 - reported as reward-failed
                failures.append(RuleFailed("prm", str(exc)))
        verdicts: list[Verdict] = []
        if c.guards.enabled:
            safety, safety_failures = self.safety.verdicts(seg)
            failures += safety_failures
            verdicts += safety
        if failures:
            return Verdicts(None, [_failed(seg, f, producer) for f in failures])
        shaping_steps = [sum(v[t] for v in shaping.values()) for t in range(n)]
        unproven = unproven_claims(seg)
        if c.guards.enabled:
            farming, farm_state = farming_verdict(seg, shaping_steps, c, farm_state)
            if farming is not None:
                verdicts.append(farming)
            verdicts += [Verdict("unproven", f"milestone {m.name!r} claimed without state "
                                             "proof", "claim") for m in unproven]

        # --- verifiable levels: outcome and proven milestones, paid once ------------------
        verified = [0.0] * n
        components: dict[str, float] = {"outcome": 0.0, "milestone": 0.0,
                                        "feedback": float(sum(seg.feedback))}
        newly_paid: list[str] = []
        steps = seg.milestone_steps or [seg.step_end - 1] * len(seg.milestones)
        for milestone, step in zip(seg.milestones, steps):
            if not milestone.proof or milestone.name in paid or milestone.name in newly_paid:
                continue
            newly_paid.append(milestone.name)
            verified[step - seg.step_start] += c.milestone_reward
            components["milestone"] += c.milestone_reward
        if seg.trajectory_done and not seg.failure:  # a failed episode has no outcome
            outcome = (c.outcome_success if seg.success else
                       c.outcome_lost if seg.lost and c.outcome_lost is not None else
                       c.outcome_failure)
            verified[-1] += outcome
            components["outcome"] = outcome
        for name, values in shaping.items():
            components[name] = float(sum(values))
        if self.prm.enabled:
            components["prm:weight"] = float(weight)

        # --- guards veto ------------------------------------------------------------------
        scopes = {v.scope for v in verdicts}
        rewards = [verified[t] + shaping_steps[t] for t in range(n)]
        charged = [0.0] * n
        if "all" in scopes:  # safety: every positive reward withheld, all of it charged
            withheld = [max(r, 0.0) for r in rewards]
            charged = withheld
            newly_paid = []  # nothing paid, nothing marked paid
        elif "shaping" in scopes:  # farming: shaping withheld, no-progress pay charged
            withheld = [max(s, 0.0) for s in shaping_steps]
            for t in cheap_steps(seg, shaping_steps):
                charged[t] = shaping_steps[t]
        else:
            withheld = [0.0] * n
        charge = c.guards.chargeback
        rewards = [rewards[t] - withheld[t] - charge * charged[t] for t in range(n)]
        components["guard:unproven"] = float(len(unproven))
        components["guard:farming"] = float(any(v.guard == "farming" for v in verdicts))
        components["guard:safety"] = float(any(v.guard.startswith("safety") for v in verdicts))
        components["guard:vetoed"] = float(sum(withheld))
        components["guard:chargeback"] = -charge * float(sum(charged))

        decided_by = _decider(verdicts, seg, components, shaping)
        return Verdicts(Scored(
            event_id=event_id("scored", seg.segment_id), run_id=seg.run_id, producer=producer,
            key=seg.trajectory_id, segment_id=seg.segment_id, trajectory_id=seg.trajectory_id,
            task_id=seg.task_id, address=seg.address, content_hash=seg.content_hash,
            step_start=seg.step_start, step_end=seg.step_end,
            min_policy_version=seg.min_policy_version, trajectory_done=seg.trajectory_done,
            success=seg.success, components=components, step_rewards=rewards,
            total=float(sum(rewards)), decided_by=decided_by, paid_milestones=newly_paid,
            guard_reasons=[_brief(f"{v.guard}: {v.reason}") for v in verdicts],
            guard_state=farm_state.encode() if c.guards.enabled else {},
            failure=seg.failure), [])


#: A guard reason is for people (a safety rule may quote a whole action): kept this short.
MAX_REASON_CHARS = 512


def _brief(reason: str) -> str:
    return reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS - 3] + "..."


def _decider(verdicts, seg: SegmentClosed, components: dict[str, float],
             shaping: dict[str, list[float]]) -> str:
    if verdicts:
        return "guard"
    if seg.trajectory_done and not seg.failure:
        return "outcome"
    if components["milestone"]:
        return "milestone"
    if any(any(v) for k, v in shaping.items() if k.startswith("rule:")):
        return "rule"
    if any(shaping.get("prm", [])):
        return "prm"
    return "none"


def _failed(seg: SegmentClosed, failure: RuleFailed, producer: str) -> RewardFailed:
    return RewardFailed(
        event_id=event_id("reward-failed", seg.segment_id, failure.component),
        run_id=seg.run_id, producer=producer, key=seg.trajectory_id,
        segment_id=seg.segment_id, component=failure.component, reason=failure.reason,
        trajectory_id=seg.trajectory_id, trajectory_done=seg.trajectory_done)
