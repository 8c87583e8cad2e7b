"""Reward arbitration: each guard, rule and process-model path, precedence, and failures.

The pure core is tested directly; the reward-failed path also runs through the arbiter
actor on the real embedded bus.
"""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scratch import run_until

from gyre_async.rewards.arbitration import Arbitration
from gyre_async.rewards.guards import NEW_TRAJECTORY, FarmState, farming_verdict
from gyre_async.rewards.plugins import RuleConfigError
from gyre_async.rewards.prm import LabelledSegment, save_prm, train_prm
from schemas import event_id
from schemas.config import ArbiterConfig, GuardConfig, ProcessRewardConfig, RuleSpec
from schemas.events import Milestone, RewardFailed, Scored, SegmentClosed

FARM = ["polish tools", "sweep floor"]
WORK = ["chop tree", "cut stone", "mine rock", "smelt ore", "craft"]


def seg(actions, *, start=0, feedback=None, milestones=(), steps=(), done=False,
        success=False, traj="t1", sid=None) -> SegmentClosed:
    n = len(actions)
    return SegmentClosed(
        event_id=event_id("seg", sid or traj, start), run_id="r", producer="test", key=traj,
        segment_id=sid or f"{traj}-{start}", trajectory_id=traj, task_id="task",
        step_start=start, step_end=start + n, boundary="max-length", address="a",
        content_hash="h", min_policy_version=0, max_policy_version=0, trajectory_done=done,
        success=success, milestones=list(milestones), milestone_steps=list(steps),
        feedback=list(feedback) if feedback is not None else [0.0] * n, actions=list(actions))


def proven(name="craft:axe#1"):
    return Milestone(name=name, proof="orders[0].made=1/1")


def cfg(**kw) -> ArbiterConfig:
    return ArbiterConfig(**kw)


FEEDBACK_RULE = [RuleSpec(name="env_feedback", weight=1.0)]


def test_milestones_pay_once_per_trajectory_and_only_with_proof():
    a = Arbitration(cfg())
    s = seg(WORK, milestones=[proven(), Milestone(name="craft:saw#2", proof="")],
            steps=[3, 4])
    v = a.score(s, set(), "arb").scored
    assert v.step_rewards == [0, 0, 0, 0.1, 0] and v.paid_milestones == ["craft:axe#1"]
    assert v.components["guard:unproven"] == 1.0 and v.decided_by == "guard"
    again = a.score(s, {"craft:axe#1"}, "arb").scored  # already paid in this trajectory
    assert again.components["milestone"] == 0.0 and again.total == 0.0


def test_precedence_outcome_over_milestone_over_rule_over_prm(tmp_path):
    rule = [RuleSpec(name="proven_fact", weight=0.5, args={"milestone": "craft:"})]
    a = Arbitration(cfg(rules=rule))
    assert a.score(seg(WORK, milestones=[proven()], steps=[4], done=True, success=True),
                   set(), "x").scored.decided_by == "outcome"
    assert a.score(seg(WORK, milestones=[proven()], steps=[4]), set(), "x").scored.decided_by \
        == "milestone"
    # the rule pays for a fact the milestone level already paid: still "milestone"; with the
    # milestone paid before, the rule alone decides
    only_rule = a.score(seg(WORK, milestones=[proven()], steps=[4]), {"craft:axe#1"}, "x")
    assert only_rule.scored.decided_by == "rule" and only_rule.scored.total == 0.5
    path = tmp_path / "prm.safetensors"
    save_prm(train_prm([LabelledSegment(tuple(WORK), 1.0)], epochs=20), str(path))
    p = Arbitration(cfg(prm=ProcessRewardConfig(path=str(path), weight=0.1)))
    v = p.score(seg(WORK), set(), "x").scored
    assert v.decided_by == "prm" and v.components["prm:weight"] == 0.1
    assert math.isclose(v.total, v.components["prm"]) and 0 < v.total < 0.1
    assert Arbitration(cfg()).score(seg(WORK), set(), "x").scored.decided_by == "none"


def test_farming_guard_vetoes_repeated_cheap_actions_but_keeps_verified_rewards():
    actions = WORK[:2] + ["polish tools", "polish floor", "Polish  tools"]  # one action
    s = seg(actions, feedback=[0, 0, .01, .01, .01], milestones=[proven()], steps=[1],
            done=True, success=True)
    off = Arbitration(cfg(rules=FEEDBACK_RULE, guards=GuardConfig(enabled=False)))
    paid = off.score(s, set(), "x").scored
    assert math.isclose(paid.total, 1.0 + 0.1 + 0.03) and paid.decided_by == "outcome"
    guards = GuardConfig(farm_repeat=3)  # chargeback 1: vetoed pay becomes a cost
    v = Arbitration(cfg(rules=FEEDBACK_RULE, guards=guards)).score(s, set(), "x").scored
    assert v.decided_by == "guard" and v.components["guard:farming"] == 1.0
    assert math.isclose(v.components["guard:vetoed"], 0.03)
    assert math.isclose(v.total, 1.0 + 0.1 - 0.03)  # outcome + milestone - chargeback
    assert [round(r, 6) for r in v.step_rewards] == [0, 0.1, -0.01, -0.01, 1.0 - 0.01]
    plain = Arbitration(cfg(rules=FEEDBACK_RULE, guards=GuardConfig(farm_repeat=3,
                                                                    chargeback=0.0)))
    assert math.isclose(plain.score(s, set(), "x").scored.total, 1.1)  # a plain veto
    assert "repeated cheap action 'polish': paid 3 times" in v.guard_reasons[0]
    assert math.isclose(v.components["rule:env_feedback"], 0.03)  # recorded, not paid
    whole_text = GuardConfig(farm_repeat=3, farm_action_words=0)  # three different texts
    assert Arbitration(cfg(rules=FEEDBACK_RULE, guards=whole_text)).score(
        s, set(), "x").scored.decided_by == "outcome"


def test_farming_budget_between_milestones_carries_across_segments():
    c = cfg(guards=GuardConfig(farm_repeat=100, farm_budget_ratio=3.0))  # budget 0.3
    s = seg(FARM * 5)  # 10 steps, each action only 5 times: below the repeat limit
    assert farming_verdict(s, [0.03] * 10, c)[0] is None  # exactly 3x: not above
    verdict, state = farming_verdict(s, [0.031] * 10, c)
    assert "above 3 x the milestone reward (0.3)" in verdict.reason and state.caught
    # the budget spans segments: 0.2 now, 0.2 later (no milestone between) is too much...
    first, state = farming_verdict(seg(FARM), [0.1, 0.1], c)
    assert first is None and math.isclose(state.pay, 0.2)
    assert farming_verdict(seg(FARM, start=2), [0.1, 0.1], c, state)[0] is not None
    # ...unless a proven milestone came between: progress resets it
    s2 = seg(["craft", "polish tools"], start=2, milestones=[proven()], steps=[2])
    assert farming_verdict(s2, [0.1, 0.1], c, state)[0] is None
    # a caught trajectory stays caught: one cheap step later is vetoed too
    caught = FarmState({}, 0.0, caught=True)  # e.g. after a milestone reset the budget
    assert "after this trajectory was caught" in farming_verdict(
        seg(["sweep floor"], start=10), [0.01], c, caught)[0].reason
    assert farming_verdict(seg(["chop tree"], start=10), [0.0], c, caught)[0] is None


def slow_farming_flags(trajectory, pay, progress, repeat, budget):
    """Per step: is farming detected there? Recounted from scratch at every step."""
    flags = []
    for t in range(len(trajectory)):
        last = max([p for p in progress if p <= t], default=-1)
        span = [u for u in range(last + 1, t + 1) if pay[u] > 0 and u not in progress]
        verb = trajectory[t].split()[0]
        flags.append(t in span and (
            sum(trajectory[u].split()[0] == verb for u in span) >= repeat
            or sum(pay[u] for u in span) > budget))
    return flags


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(FARM + WORK), min_size=2, max_size=16), st.data())
def test_farming_guard_matches_a_slow_reference(trajectory, data):
    n = len(trajectory)
    pay = data.draw(st.lists(st.sampled_from([0.0, 0.02, 0.05, 0.1]), min_size=n, max_size=n))
    progress = set(data.draw(st.lists(st.integers(0, n - 1), max_size=3)))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n - 1), max_size=3))))
    repeat = data.draw(st.integers(1, 4))
    c = cfg(guards=GuardConfig(farm_repeat=repeat, farm_budget_ratio=2.0))  # budget 0.2
    flags = slow_farming_flags(trajectory, pay, progress, repeat, 0.2)
    state, caught = NEW_TRAJECTORY, False
    for lo, hi in zip([0, *cuts], [*cuts, n]):
        ms = sorted(p for p in progress if lo <= p < hi)
        s = seg(trajectory[lo:hi], start=lo, milestones=[proven(f"m{p}") for p in ms],
                steps=ms)
        verdict, state = farming_verdict(s, pay[lo:hi], c, state)
        cheap = any(pay[t] > 0 and t not in progress for t in range(lo, hi))
        expected = any(flags[lo:hi]) or (caught and cheap)
        assert (verdict is not None) == expected
        caught = caught or expected


def test_safety_rule_vetoes_everything_and_plugins_resolve():
    rules = [RuleSpec(name="forbidden_text", args={"words": "sell ingot, rm -rf"})]
    a = Arbitration(cfg(guards=GuardConfig(safety_rules=rules)))
    s = seg(["craft", "sell ingot"], milestones=[proven()], steps=[0], done=True, success=True)
    v = a.score(s, set(), "x").scored
    assert math.isclose(v.total, -1.1) and v.components["guard:vetoed"] == 1.1
    assert v.decided_by == "guard" and v.paid_milestones == []
    assert v.components["guard:safety"] == 1.0 and "sell ingot" in v.guard_reasons[0]
    # "module:function" plugins work for rules and safety rules alike
    plug = cfg(rules=[RuleSpec(name="gyre_async.rewards.rules:env_feedback", weight=2.0)],
               guards=GuardConfig(enabled=False))  # (on, 1.0/step is farming: vetoed)
    assert Arbitration(plug).score(seg(["x"], feedback=[0.5]), set(), "x").scored.total == 1.0
    with pytest.raises(RuleConfigError, match="unknown rule 'compiledd'"):
        Arbitration(cfg(rules=[RuleSpec(name="compiledd")]))
    with pytest.raises(RuleConfigError, match="bad args"):
        Arbitration(cfg(rules=[RuleSpec(name="proven_fact", args={"nope": 1})]))


def broken_rule():  # a factory for the failure tests: "tests.test_arbitration:broken_rule"
    def rule(s):
        if s.actions[0] == "boom":
            raise RuntimeError("checker crashed")
        return [math.nan] * (s.step_end - s.step_start) if s.actions[0] == "nan" else [1.0]
    return rule


def test_failed_components_are_reported_never_zero(tmp_path):
    a = Arbitration(cfg(rules=[RuleSpec(name="tests.test_arbitration:broken_rule")]))
    for actions, reason in ((["boom"], "checker crashed"), (["nan"], "non-finite"),
                            (["a", "b"], "returned 1 values for a 2-step segment")):
        v = a.score(seg(actions), set(), "x")
        assert v.scored is None and len(v.failed) == 1
        assert v.failed[0].component == "rule:tests.test_arbitration:broken_rule"
        assert reason in v.failed[0].reason
    missing = Arbitration(cfg(prm=ProcessRewardConfig(path=str(tmp_path / "no.safetensors"),
                                                      weight=1.0)))
    v = missing.score(seg(WORK, milestones=[proven()], steps=[0]), set(), "x")
    assert v.scored is None and v.failed[0].component == "prm" and "not found" in v.failed[0].reason
    corrupt = tmp_path / "bad.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all")
    v = Arbitration(cfg(prm=ProcessRewardConfig(path=str(corrupt), weight=1.0))).score(
        seg(WORK), set(), "x")
    assert v.scored is None and "not a readable safetensors" in v.failed[0].reason


async def test_reward_failed_through_the_embedded_bus(tmp_path, scratch_bus):
    from actors.arbiter import Arbiter
    from schemas.topics import SCORED, SEGMENT_CLOSED

    prm_path = tmp_path / "prm.safetensors"
    config = cfg(prm=ProcessRewardConfig(path=str(prm_path), weight=0.1))
    first = [seg(WORK, start=0, milestones=[proven()], steps=[4], traj="a"),
             seg(["wait"], start=0, done=True, traj="b")]
    scratch_bus.partitions = 2  # its topics and runner: the two trajectories apart

    async def run_batch(segments, expect):
        await scratch_bus.publish(SEGMENT_CLOSED, *segments)

        async def all_scored() -> bool:
            return len(await scratch_bus.events(SCORED)) >= expect

        await scratch_bus.run(Arbiter(config), all_scored, 30, run_id="r")
        return await scratch_bus.events(SCORED)

    events = await run_batch(first, 2)  # no weights file yet: both withheld
    assert all(isinstance(e, RewardFailed) for e in events), events
    assert {(e.segment_id, e.component) for e in events} == {("a-0", "prm"), ("b-0", "prm")}
    assert all("not found" in e.reason for e in events)
    assert [e.trajectory_done for e in sorted(events, key=lambda e: e.segment_id)] == \
        [False, True]
    save_prm(train_prm([LabelledSegment(tuple(WORK), 1.0)], epochs=20), str(prm_path))
    events = await run_batch([seg(WORK, start=5, traj="a")], 3)
    scored = [e for e in events if isinstance(e, Scored)]
    assert len(scored) == 1 and scored[0].segment_id == "a-5"
    assert scored[0].components["prm"] != 0.0 and scored[0].decided_by == "prm"


async def test_a_trajectory_caught_farming_stays_caught_across_a_restart(scratch_bus):
    from actors.arbiter import Arbiter
    from schemas.topics import SCORED, SEGMENT_CLOSED

    config = cfg(rules=FEEDBACK_RULE, guards=GuardConfig(farm_repeat=3))
    farmed = seg(["polish tools"] * 3 + ["craft"], feedback=[.01, .01, .01, .1],
                 milestones=[proven()], steps=[3], traj="f")
    # one cheap step only: alone it is below every limit...
    once = [seg(["sweep floor", "chop tree"], start=4, feedback=[.01, 0], traj=t)
            for t in ("f", "clean")]
    clean_first = seg(["chop tree"], feedback=[0.0], traj="clean")
    for batch, expect in (([farmed, clean_first], 2), (once, 4)):  # a restart between
        await scratch_bus.publish(SEGMENT_CLOSED, *batch)

        async def all_scored(expect=expect) -> bool:
            return len(await scratch_bus.events(SCORED)) >= expect

        await scratch_bus.run(Arbiter(config), all_scored, 30, run_id="r")
    scored = {e.segment_id: e for e in await scratch_bus.events(SCORED)}
    # every input redelivered (a fresh consumer group): all already in our log, so
    # nothing is scored again (with the trajectory state gone, milestones would re-pay)
    runner = scratch_bus.runner(Arbiter(config), run_id="r", group="redelivery")
    await run_until(runner, lambda: runner.processed >= 4, 30)
    assert runner.processed == 4 and len(await scratch_bus.events(SCORED)) == 4
    first = scored["f-0"]
    assert first.components["guard:farming"] == 1.0
    # vetoed: feedback withheld everywhere, the no-progress pay charged back
    assert [round(r, 6) for r in first.step_rewards] == [-0.01, -0.01, -0.01, 0.1]
    # ...but the trajectory was caught before, so it is vetoed; the clean one is paid
    assert scored["f-4"].decided_by == "guard" and scored["f-4"].total < 0
    assert "after this trajectory was caught farming" in scored["f-4"].guard_reasons[0]
    assert scored["clean-4"].decided_by == "rule" and math.isclose(scored["clean-4"].total, .01)
    assert len(scored) == 4


def test_a_rebuilt_core_has_the_live_cores_state():
    """The restart path and the live path are one fold: a core that applies another core's
    outputs (its ``scored`` log) holds the same pay-once, farming and handled state, and
    does not score a redelivered segment again. Verdicts of the run's other arbiters (a
    replica that had the partition before) are folded too."""
    from gyre_async.core.arbiter import ArbiterCore

    config = cfg(rules=FEEDBACK_RULE, guards=GuardConfig(farm_repeat=3))
    live = ArbiterCore(config, producer="arbiter")
    segments = [seg(["polish tools"] * 3 + ["craft"], feedback=[.01, .01, .01, .1],
                    milestones=[proven()], steps=[3], traj="f"),
                seg(WORK, milestones=[proven()], steps=[4], traj="a"),
                seg(["wait"], start=5, done=True, traj="a"),
                seg(["sweep floor", "chop tree"], start=4, feedback=[.01, 0], traj="f")]
    outputs = [e for s in segments for e in live.handle(s)]
    assert live.handle(segments[1]) == []  # a redelivered segment: its verdict is logged
    rebuilt = ArbiterCore(config, producer="arbiter")
    for event in outputs:
        rebuilt.apply(event)
    assert rebuilt.handled == live.handled == {s.segment_id for s in segments}
    rebuilt.apply(msgspec.structs.replace(outputs[0], producer="arbiter-1", segment_id="x",
                                         trajectory_id="g", trajectory_done=True))
    assert rebuilt.paid == live.paid == {"f": {"craft:axe#1"}}  # "a" ended: forgotten
    assert rebuilt.farm == live.farm and rebuilt.farm["f"].caught
    assert rebuilt.handled == live.handled | {"x"}
    assert (rebuilt.scored, rebuilt.failed) == (live.scored + 1, live.failed) == (5, 0)
    assert rebuilt.handle(segments[3]) == []


def _ended(done: bool, truncated: bool, success: bool = False) -> SegmentClosed:
    """The segment-closed event the segmenter makes of a 2-step trajectory's end."""
    from gyre_async.core.segmenter import SegmenterCore, segment_closed
    from gyre_async.storage.segments import SegmentRef
    from schemas.config import SegmenterConfig
    from schemas.events import TrajectoryStep

    core = SegmenterCore(SegmenterConfig(max_segment_steps=8))
    closed = []
    for i in range(2):
        last = i == 1
        closed += core.add(TrajectoryStep(
            event_id=event_id("s", i), run_id="r", producer="sampler", key="t",
            trajectory_id="t", task_id="task", step_index=i, policy_version=0,
            context_tokens=[1], action_tokens=[2], action_logprobs=[-0.1],
            done=last and done, truncated=last and truncated, success=last and success),
            (0, i))
    assert len(closed) == 1
    return segment_closed(closed[0], "seg", SegmentRef(address="a", content_hash="h"),
                          run_id="r", producer="segmenter")


def test_a_lost_game_may_pay_apart_from_a_cut():
    """The game ending unwon before the cap (a wrong move) is a loss; the cap is a cut.
    ``outcome_lost`` pays the first apart; unset, both pay ``outcome_failure`` as before."""
    lost, cut, won = _ended(True, False), _ended(False, True), _ended(True, False, True)
    assert lost.lost and not cut.lost and not won.lost
    assert lost.trajectory_done and cut.trajectory_done
    apart = Arbitration(cfg(outcome_lost=-1.0))
    assert apart.score(lost, set(), "x").scored.step_rewards == [0.0, -1.0]
    assert apart.score(cut, set(), "x").scored.step_rewards == [0.0, 0.0]
    assert apart.score(won, set(), "x").scored.step_rewards == [0.0, 1.0]
    same = Arbitration(cfg(outcome_failure=-0.5))
    assert same.score(lost, set(), "x").scored.step_rewards == [0.0, -0.5]
    assert same.score(cut, set(), "x").scored.step_rewards == [0.0, -0.5]
    # an event from before the field decodes as no loss: the failure outcome, as it was paid
    old = msgspec.json.decode(msgspec.json.encode(lost).replace(b',"lost":true', b''),
                              type=SegmentClosed)
    assert not old.lost and apart.score(old, set(), "x").scored.step_rewards == [0.0, 0.0]
