"""The cores of the sampler, segmenter and evaluator, driven directly (no bus, no loop)."""

from __future__ import annotations

from gyre_async.core.evaluation import eval_trigger
from gyre_async.core.sampler import UnfinishedTrajectories
from gyre_async.core.segmenter import PendingWrites, SegmenterCore
from schemas import event_id
from schemas.config import SegmenterConfig
from schemas.events import EnvError, PolicyVersion, TrajectoryStep
from schemas.topics import TRAJECTORY_STEP


def step(tid: str, i: int, **outcome) -> TrajectoryStep:
    return TrajectoryStep(event_id=event_id("s", tid, i), run_id="t", producer="sampler",
                          key=tid, trajectory_id=tid, task_id=f"task-{tid}", step_index=i,
                          policy_version=0, context_tokens=[1], action_tokens=[2],
                          action_logprobs=[-0.1], **outcome)


def test_closed_segments_wait_for_a_batch_and_hold_the_commit_floor():
    config = SegmenterConfig(max_segment_steps=2, write_batch_segments=2, write_delay_s=1.0)
    core, pending = SegmenterCore(config), PendingWrites(config)
    for i in range(3):  # steps 0-1 close at max length (offsets 10, 11); step 2 stays open
        pending.extend(core.add(step("a", i), (0, 10 + i)))
    assert core.commit_floor() == {(TRAJECTORY_STEP, 0): 12}
    # the closed segment is not written yet: a crash must redeliver its steps from 10
    assert pending.hold(core.commit_floor()) == {(TRAJECTORY_STEP, 0): 10}
    assert pending.take_due(now=100.0) == []  # one segment, and its wait starts now
    assert pending.take_due(now=100.9) == []
    due = pending.take_due(now=101.0)  # write_delay_s passed
    assert [(s.steps[0].step_index, s.boundary) for s in due] == [(0, "max-length")]
    assert pending.hold({}) == {}
    # two segments at once are a full batch: due without waiting
    pending.extend(core.add(step("a", 3), (0, 13)))
    pending.extend(core.add(step("b", 0, done=True, success=True), (1, 5)))
    due = pending.take_due(now=200.0)
    assert [(s.trajectory_id, s.boundary, s.terminal) for s in due] == [
        ("a", "max-length", False), ("b", "trajectory-end", True)]
    assert core.commit_floor() == {}


def test_unfinished_trajectories_are_the_open_ones_each_ended_one_step_later():
    unfinished = UnfinishedTrajectories()
    events = [step("open", 0), step("open", 1), step("done", 0), step("done", 1, done=True),
              step("cut", 0, truncated=True), step("failed", 0),
              EnvError(event_id="e", run_id="t", producer="sampler", key="failed",
                       trajectory_id="failed", task_id="x", step_index=1, kind="timeout",
                       message="slow")]
    for event in events:
        unfinished.fold(event)
    [abandoned] = unfinished.abandoned("t", "sampler")
    assert (abandoned.trajectory_id, abandoned.task_id, abandoned.step_index) == (
        "open", "task-open", 2)
    assert "abandoned" in abandoned.message
    # the same log gives the same error (idempotent by event id after another restart)
    assert unfinished.abandoned("t", "sampler")[0].event_id == abandoned.event_id


def test_which_versions_the_evaluator_validates_and_why(tiny):
    cfg = tiny.config()  # every_versions = 2, on_reasons = ["warmstart"]
    assert cfg.evaluator.every_versions == 2 and cfg.evaluator.on_reasons == ["warmstart"]

    def version(v: int, reason: str = "update", **metrics: float) -> PolicyVersion:
        return PolicyVersion(event_id=f"pv{v}", run_id="t", producer="learner", key="policy",
                             version=v, checkpoint="c", checkpoint_hash="h", reason=reason,
                             metrics=metrics)

    assert eval_trigger(cfg, version(0, "init")) == "schedule"
    assert eval_trigger(cfg, version(3)) == ""
    assert eval_trigger(cfg, version(4)) == "schedule"
    assert eval_trigger(cfg, version(3, final=1.0)) == "final"
    assert eval_trigger(cfg, version(3, "rollback")) == "reason:rollback"
    assert eval_trigger(cfg, version(1, "warmstart")) == "reason:warmstart"
    every = tiny.config(evaluator={"every_versions": 0})  # 0 is read as 1: every version
    assert eval_trigger(every, version(3)) == "schedule"
    no_start = tiny.config(evaluator={"start": False})  # version 0 is left to a judge
    assert eval_trigger(no_start, version(0, "warmstart")) == ""
    assert eval_trigger(no_start, version(0, "init")) == ""
    assert eval_trigger(no_start, version(4)) == "schedule"
    assert eval_trigger(no_start, version(0, final=1.0)) == "final"


def test_cut_all_closes_open_segments_as_length_cuts_and_frees_the_floor():
    core = SegmenterCore(SegmenterConfig(max_segment_steps=8))
    for i in range(3):
        core.add(step("a", i), (0, 10 + i))
    core.add(step("b", 0), (1, 4))
    cut = core.cut_all()
    assert [(c.trajectory_id, c.boundary, c.terminal, len(c.steps)) for c in cut] == [
        ("a", "max-length", False, 3), ("b", "max-length", False, 1)]
    assert core.commit_floor() == {} and core.open == {}
    assert core.add(step("a", 3), (0, 13)) == []  # a later step opens a new segment at 3
    assert core.open["a"].steps[0].step_index == 3


def test_sampled_validation_uses_the_evaluators_temperature(tiny):
    """``evaluator.temperature`` reaches the policy (every version validated alike)."""
    import asyncio

    from gyre_async.compose import build_policy, build_tokenizer
    from gyre_async.core.evaluation import evaluate
    from gyre_async.core.rollout import PolicyHolder
    from gyre_async.policy.context import ContextBuilder

    cfg = tiny.config(evaluator={"temperature": 0.3, "greedy": False, "episodes": 2})
    tok = build_tokenizer(cfg)
    policy = build_policy(cfg, tok)
    seen: list[tuple[float, bool]] = []
    act_batch = policy.act_batch

    def recording(contexts, params, seed=None, **sessions):
        seen.append((params.temperature, params.greedy))
        return act_batch(contexts, params, seed, **sessions)

    policy.act_batch = recording  # the real policy acts; the wrapper only records
    builder = ContextBuilder(tok, cfg.policy.context_tokens, cfg.policy.history_turns)
    result = asyncio.run(evaluate(cfg, PolicyHolder(policy, 0), builder, None, False))
    assert result["episodes"] == 2 and seen
    assert set(seen) == {(0.3, False)}


def test_a_capped_trajectory_is_terminal_only_when_the_cap_is_part_of_the_task():
    for cap_ends_episode in (False, True):
        core = SegmenterCore(SegmenterConfig(max_segment_steps=8,
                                             cap_ends_episode=cap_ends_episode))
        core.add(step("capped", 0), (0, 0))
        closed = core.add(step("capped", 1, truncated=True), (0, 1))
        won = core.add(step("won", 0, done=True, success=True), (0, 2))
        assert [(c.boundary, c.terminal) for c in closed] == [
            ("trajectory-end", cap_ends_episode)]
        assert [c.terminal for c in won] == [True]
        core.add(step("broken", 0), (0, 3))  # an environment failure stays bootstrapped
        aborted = core.abort(EnvError(event_id="e", run_id="t", producer="sampler",
                                      key="broken", trajectory_id="broken", task_id="t",
                                      step_index=1, kind="timeout", message="slow"))
        assert [c.terminal for c in aborted] == [False]


def test_a_partition_that_comes_back_before_its_segments_were_written_loses_nothing():
    """Steps 0..2 close a segment at the milestone of step 2; it waits for its batched write
    when the partition moves away (release) and comes back before the other member wrote it
    (nothing new in the ``segment-closed`` log). Redelivered from the commit floor, the
    same steps must close the same segment again, and the floor must hold them meanwhile."""
    from schemas.events import Milestone

    config = SegmenterConfig(max_segment_steps=100, write_batch_segments=64, write_delay_s=60)
    core, pending = SegmenterCore(config), PendingWrites(config)

    def feed() -> None:
        for i in range(3):
            milestones = [Milestone(name="m", proof="p")] if i == 2 else []
            pending.extend(core.add(step("a", i, milestones=milestones), (0, 10 + i)))

    feed()
    assert pending.hold(core.commit_floor()) == {(TRAJECTORY_STEP, 0): 10}
    assert core.release({0}) == 0 and pending.release({0}) == 1
    assert pending.hold(core.commit_floor()) == {}  # nothing held: the partition is not ours
    feed()  # the partition is back; the runtime redelivers from offset 10
    assert [(s.steps[0].step_index, s.steps[-1].step_index, s.boundary)
            for s in pending.segments] == [(0, 2, "milestone")]
    assert pending.hold(core.commit_floor()) == {(TRAJECTORY_STEP, 0): 10}


def test_release_keeps_what_other_partitions_segmented():
    config = SegmenterConfig(max_segment_steps=1)
    core = SegmenterCore(config)
    core.add(step("a", 0), (0, 1))
    core.add(step("b", 0, done=True, success=True), (1, 1))
    core.release({0})
    assert core.next_step == {"b": 1} and core.ended == {"b"}
    assert core.add(step("b", 0), (1, 1)) == []  # still skipped as already segmented
    assert [s.trajectory_id for s in core.add(step("a", 0), (0, 1))] == ["a"]


def test_steps_out_of_their_trajectorys_order_are_refused_never_skipped_silently():
    """A trajectory's steps come in order on one partition, so a step that cannot be a
    redelivery is refused (the actor dead-letters it) before anything changes: one of a gap
    already cut around, one after the trajectory's end, a second event for a step the open
    segment holds. Redeliveries (the same event again, or a step already segmented) are
    still skipped, and a partition that leaves takes what was learnt of its gaps along."""
    import msgspec
    import pytest

    from gyre_async.core.segmenter import OutOfOrderStep

    core = SegmenterCore(SegmenterConfig(max_segment_steps=100))
    for i in (0, 1, 2):
        assert core.add(step("a", i), (0, i)) == []
    with pytest.raises(OutOfOrderStep, match="step 1 of trajectory 'a' came after step 2 "
                                             "under another event id"):
        core.add(msgspec.structs.replace(step("a", 1), event_id="other"), (0, 3))
    assert core.add(step("a", 1), (0, 1)) == []  # the same event again: a redelivery
    [cut] = core.add(step("a", 5), (0, 4))  # 3 and 4 never came: cut before the gap
    assert [s.step_index for s in cut.steps] == [0, 1, 2]
    with pytest.raises(OutOfOrderStep, match=r"step 3 of trajectory 'a' came after step 5"):
        core.add(step("a", 3), (0, 5))
    [end] = core.add(step("a", 6, done=True), (0, 6))
    assert [s.step_index for s in end.steps] == [5, 6]
    with pytest.raises(OutOfOrderStep, match=r"came after the segment cut before its gap \[3, 5\)"):
        core.add(step("a", 4), (0, 7))
    with pytest.raises(OutOfOrderStep, match="step 7 of trajectory 'a' came after its end"):
        core.add(step("a", 7), (0, 8))
    assert core.add(step("a", 6, done=True), (0, 6)) == []  # segmented already: skipped
    assert core.open == {} and core.next_step == {"a": 7}  # the refusals changed nothing
    core.release({0})  # the partition moves: read again from the floor by its new owner
    assert core.gaps == {}


def test_evaluation_progress_counts_every_step_and_episode_it_summarises(tiny):
    """A long evaluation says how far it is: the progress lines' steps, ended episodes and
    wins are the evaluation's own totals, and the last line comes with the last episode."""
    import asyncio
    import io

    from gyre_async.compose import build_policy, build_tokenizer
    from gyre_async.core.evaluation import EvalProgress, evaluate
    from gyre_async.core.rollout import PolicyHolder
    from gyre_async.policy.context import ContextBuilder

    cfg = tiny.config(evaluator={"episodes": 3})
    tok = build_tokenizer(cfg)
    builder = ContextBuilder(tok, cfg.policy.context_tokens, cfg.policy.history_turns)
    out = io.StringIO()
    progress = EvalProgress("tiny dev games", every_s=3600.0, out=out)
    result = asyncio.run(evaluate(cfg, PolicyHolder(build_policy(cfg, tok), 0), builder, None,
                                  True, progress))
    wins = round(result["success_rate"] * result["episodes"])
    lines = out.getvalue().splitlines()
    assert len(lines) == 1  # only the last episode's line within the hour
    assert lines[0].endswith(f"tiny dev games: {result['env_steps']} env steps, "
                             f"3/3 episodes ended, {wins} won")
    assert progress.steps == result["env_steps"] > 0
