"""The run summary's training episodes by part (``training_parts``): a long task's learning
shows in milestones, losses and lengths while it wins nothing, so the summary says how each
quarter of the training episodes went, folded from ``segment-closed`` events alone."""

from __future__ import annotations

from gyre_async.folds.run_fold import RunFold
from gyre_async.folds.runlog import summarize, training_episodes, training_parts
from schemas.events import Milestone, SegmentClosed
from schemas.topics import SEGMENT_CLOSED


def _segment(traj: str, start: int, end: int, ts: float, *, done: bool = False,
             won: bool = False, lost: bool = False, milestones: int = 0,
             version: int = 0) -> SegmentClosed:
    return SegmentClosed(
        event_id=f"seg-{traj}-{start}", run_id="r", producer="segmenter", key=traj, ts=ts,
        segment_id=f"{traj}-{start}", trajectory_id=traj, task_id="t", step_start=start,
        step_end=end, boundary="trajectory-end" if done else "milestone", address="a",
        content_hash="h", min_policy_version=version, max_policy_version=version,
        trajectory_done=done, success=won, lost=lost,
        milestones=[Milestone(name=f"m{i}", proof="p") for i in range(milestones)],
        milestone_steps=[start] * milestones)


def test_training_episodes_are_told_by_part_in_the_order_they_ended():
    segments = []
    for i in range(8):  # episode i: two segments, ends at ts 10 + i, 4 - i // 2 milestones
        traj = f"e{i}"
        segments.append(_segment(traj, 0, 3, 10.0 + i - 0.5, milestones=1, version=i))
        segments.append(_segment(traj, 3, 10 + i, 10.0 + i, done=True, won=i == 1,
                                 lost=i >= 6, milestones=3 - i // 2, version=i))
    segments.append(_segment("running", 0, 5, 30.0, milestones=2))  # not finished: left out
    fold = RunFold("r")
    for seg in reversed(segments):  # folded in any order
        fold.apply(seg, SEGMENT_CLOSED)
    episodes = training_episodes(fold.segments)
    assert [e["length"] for e in episodes] == list(range(10, 18))
    assert [e["milestones"] for e in episodes] == [4, 4, 3, 3, 2, 2, 1, 1]
    parts = summarize(fold, wall_seconds=1.0)["training_parts"]
    assert parts == training_parts(fold.segments)
    assert parts == [
        {"episodes": "0-1", "versions": "0-1", "won": 1, "of": 2, "lost": 0, "failed": 0,
         "mean_milestones": 4.0, "mean_length": 10.5},
        {"episodes": "2-3", "versions": "2-3", "won": 0, "of": 2, "lost": 0, "failed": 0,
         "mean_milestones": 3.0, "mean_length": 12.5},
        {"episodes": "4-5", "versions": "4-5", "won": 0, "of": 2, "lost": 0, "failed": 0,
         "mean_milestones": 2.0, "mean_length": 14.5},
        {"episodes": "6-7", "versions": "6-7", "won": 0, "of": 2, "lost": 2, "failed": 0,
         "mean_milestones": 1.0, "mean_length": 16.5}]


def test_a_run_with_fewer_episodes_than_parts_and_none_at_all():
    one = [_segment("a", 0, 4, 1.0, done=True, won=True, milestones=2)]
    assert training_parts(one) == [{"episodes": "0-0", "versions": "0-0", "won": 1, "of": 1,
                                    "lost": 0, "failed": 0, "mean_milestones": 2.0,
                                    "mean_length": 4.0}]
    assert training_parts([]) == []
    assert summarize(RunFold("r"), wall_seconds=1.0)["training_parts"] == []
