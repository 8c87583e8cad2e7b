"""Per-trajectory state stays bounded however long the trajectory (issue 15, item 5).

A 4,000-step workshop trajectory (milestones, farming actions and all) goes through the
cores of the segmenter, arbiter and learner's outcome book, and the episode runner's context
builder. What any of them holds for the open trajectory must not grow with its length:
open segments are cut at ``max_segment_steps``, pay-once and farming memory cover one
trajectory and are reset at each milestone, contexts are cut at ``context_tokens``.
(``ops/bench/memory.py`` measures the same thing as RSS, one process per role.)
"""

from __future__ import annotations

import asyncio
import random

from gyre_async.core.arbiter import ArbiterCore
from gyre_async.core.segmenter import SegmenterCore, segment_closed, segment_id
from gyre_async.envs.workshop import ACTIONS, WorkshopEnv, oracle_action
from gyre_async.storage.segments import SegmentRef
from schemas import event_id
from schemas.config import ArbiterConfig, SegmenterConfig
from schemas.events import Milestone, TrajectoryStep

STEPS = 4000
SEGMENT_STEPS = 16


def workshop_steps(tid: str, n: int):
    """``n`` steps of one workshop episode cut at ``n``: the oracle, with a random action one
    step in three (so orders complete, farming and selling happen, the chain never ends)."""
    env = WorkshopEnv(n_orders=1000, max_steps=n, noise_prob=0.0)
    rng = random.Random(5)
    observation = asyncio.run(env.reset("t", 0))
    for i in range(n):
        action = rng.choice(ACTIONS) if rng.random() < 1 / 3 else oracle_action(observation)
        result = env.step_sync(action)
        observation = result.observation
        yield TrajectoryStep(
            event_id=event_id("s", tid, i), run_id="t", producer="sampler", key=tid,
            trajectory_id=tid, task_id="workshop:0", step_index=i, policy_version=0,
            context_tokens=[1] * 64, action_tokens=[2, 3], action_logprobs=[-0.1, -0.2],
            action_text=action, feedback=result.feedback,
            milestones=[Milestone(name=m.name, proof=m.proof) for m in result.milestones],
            state_changed=result.state_changed, done=result.done, truncated=result.truncated,
            success=result.success, score=result.score)


def test_one_long_trajectory_keeps_every_core_state_bounded():
    segmenter = SegmenterCore(SegmenterConfig(max_segment_steps=SEGMENT_STEPS))
    arbiter = ArbiterCore(ArbiterConfig(milestone_reward=0.1), producer="arbiter")
    longest_open = segments = milestones = most_paid = most_repeats = 0
    for offset, step in enumerate(workshop_steps("long", STEPS)):
        for closed in segmenter.add(step, (0, offset)):
            sid = segment_id("t", closed)
            event = segment_closed(closed, sid, SegmentRef(f"mem://{sid}", "0" * 64),
                                   run_id="t", producer="segmenter")
            arbiter.handle(event)
            segments += 1
            milestones += len(event.milestones)
            most_paid = max(most_paid, sum(len(p) for p in arbiter.paid.values()))
            most_repeats = max(most_repeats, sum(len(f.repeats) for f in arbiter.farm.values()))
        longest_open = max(longest_open, max((len(s.steps) for s in segmenter.open.values()),
                                             default=0))
        assert len(segmenter.open) <= 1 and len(segmenter.next_step) <= 1
        assert set(arbiter.paid) <= {"long"} and set(arbiter.farm) <= {"long"}
    assert segments >= STEPS // SEGMENT_STEPS and milestones >= 60  # a real, long episode
    assert longest_open <= SEGMENT_STEPS
    # what the arbiter keeps for the open trajectory: the milestones it paid (one per order
    # done, bounded by the task's orders, not by steps) and the farming guard's repeat
    # counts since the last milestone (one per distinct action name)
    assert most_paid == milestones
    assert most_repeats <= len(ACTIONS)
    # the trajectory's end (its cap) frees all of it
    assert arbiter.scored == segments
    assert not segmenter.open and not arbiter.paid and not arbiter.farm
