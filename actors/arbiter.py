"""Arbiter: turns a closed segment into rewards, with explicit precedence.

consumes: segment-closed (SegmentClosed)
emits:    scored (Scored)

Levels, highest first (the first that applies "decides" the segment's verdict):
1. ``guard``    — a milestone claimed without environment-state proof is vetoed (paid 0,
                  recorded as ``guard:unproven``).
2. ``outcome``  — the verifiable outcome, at the last step of a finished trajectory.
3. ``milestone``— each sub-task milestone, paid once per trajectory, at the step it was
                  reached, only with state proof.
4. ``none``     — nothing to pay (the learner still trains on it through its values).

Raw environment ``feedback`` is recorded as a component but never paid: it is exactly what
reward-farming actions inflate. Pay-once state is rebuilt on restart from our own
``scored`` log, so a redelivered segment is never paid twice.
"""

from __future__ import annotations

from gyre_async.actor import Actor, Emit
from gyre_async.bus.reading import iter_topics
from schemas import decode, event_id
from schemas.config import ArbiterConfig, Config
from schemas.events import Scored, SegmentClosed
from schemas.topics import SCORED, SEGMENT_CLOSED


def score_segment(seg: SegmentClosed, config: ArbiterConfig, paid: set[str],
                  producer: str) -> Scored:
    """The pure core: one segment and the trajectory's already-paid milestones -> verdict."""
    n = seg.step_end - seg.step_start
    rewards = [0.0] * n
    components = {"outcome": 0.0, "milestone": 0.0, "guard:unproven": 0.0,
                  "feedback": float(sum(seg.feedback))}
    newly_paid: list[str] = []
    decided_by = "none"
    for milestone, step in zip(seg.milestones, seg.milestone_steps or [seg.step_end - 1] * len(seg.milestones)):
        if not milestone.proof:
            components["guard:unproven"] += 1.0
            decided_by = "guard"
            continue
        if milestone.name in paid or milestone.name in newly_paid:
            continue
        newly_paid.append(milestone.name)
        rewards[step - seg.step_start] += config.milestone_reward
        components["milestone"] += config.milestone_reward
        if decided_by == "none":
            decided_by = "milestone"
    if seg.trajectory_done:
        outcome = config.outcome_success if seg.success else config.outcome_failure
        rewards[-1] += outcome
        components["outcome"] = outcome
        if decided_by != "guard":
            decided_by = "outcome"
    return Scored(
        event_id=event_id("scored", seg.segment_id), run_id=seg.run_id, producer=producer,
        key=seg.trajectory_id, segment_id=seg.segment_id, trajectory_id=seg.trajectory_id,
        task_id=seg.task_id, address=seg.address, content_hash=seg.content_hash,
        step_start=seg.step_start, step_end=seg.step_end,
        min_policy_version=seg.min_policy_version, trajectory_done=seg.trajectory_done,
        success=seg.success, components=components, step_rewards=rewards,
        total=float(sum(rewards)), decided_by=decided_by, paid_milestones=newly_paid,
    )


class Arbiter(Actor):
    role = "arbiter"
    consumes = (SEGMENT_CLOSED,)
    emits = (SCORED,)

    def __init__(self, config: ArbiterConfig):
        self.config = config
        self.paid: dict[str, set[str]] = {}
        self.scored = 0

    @classmethod
    def from_config(cls, cfg: Config) -> Arbiter:
        return cls(cfg.arbiter)

    async def on_start(self) -> None:
        async for record in iter_topics(self.runner.bus, [SCORED]):
            event = decode(SCORED, record.value, 1 << 40)
            if isinstance(event, Scored) and event.producer == self.runner.name:
                self.paid.setdefault(event.trajectory_id, set()).update(event.paid_milestones)

    async def handle(self, event, record):
        match event:
            case SegmentClosed():
                paid = self.paid.setdefault(event.trajectory_id, set())
                scored = score_segment(event, self.config, paid, self.runner.name)
                paid.update(scored.paid_milestones)
                if event.trajectory_done:
                    self.paid.pop(event.trajectory_id, None)
                self.scored += 1
                return [Emit(SCORED, scored)]
        return []

    def stats(self):
        return {"scored": float(self.scored)}
