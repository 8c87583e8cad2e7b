"""Failed episodes (env error, timeout, abandonment) do not poison the learning signal.

- the group outcome baseline is computed over the properly ended members only, and the
  failed trajectory gets no outcome advantage (``learner.mask_failed``), checked against
  the slow reference on the proper members and against hand-worked numbers;
- the failed episode's last segment bootstraps from the critic (its last step's own context
  when no next context was recorded), checked against the slow GAE loop;
- the segmenter marks the failed segment with its kind, the arbiter pays it no outcome,
  old events without the field still decode;
- the fault drill (``task.fail_episode_rate``) is deterministic per seed;
- failed episodes are counted by kind (monitor, report) and the replayed outcome book
  (``gyre replay learner``, a learner's restart) masks them as the live one does.
"""

from __future__ import annotations

import asyncio
import math
import os

import msgspec
import numpy as np
import pytest
import torch
from reference_advantages import slow_group_outcome_advantage, slow_segment_gae
from rich.console import Console

from gyre_async.core.learner_batch import BatchItem, prepare_batch
from gyre_async.core.segmenter import SegmenterCore, segment_arrays, segment_closed
from gyre_async.envs.base import Env, EnvFailure, StepResult, guarded_step
from gyre_async.envs.faults import FaultSchedule, FaultyEnv, InjectedFault, with_faults
from gyre_async.folds.credit_log import replay_outcome_book
from gyre_async.folds.run_fold import RunFold
from gyre_async.folds.runlog import summarize
from gyre_async.policy.base import EvalOutput
from gyre_async.rewards.arbitration import Arbitration
from gyre_async.rl.fusion import OutcomeBook
from gyre_async.storage.segments import SegmentRef
from gyre_async.ui.monitor import MonitorState, render
from gyre_async.ui.report import ReportData, _health_html
from schemas import event_id
from schemas.config import ArbiterConfig, SegmenterConfig, TaskSection
from schemas.events import (
    EnvError,
    PolicyVersion,
    Scored,
    SegmentClosed,
    TrajectoryStep,
    failure_of,
)
from schemas.topics import TRAJECTORY_STEP

# -- groups ---------------------------------------------------------------------------------


def _end_group(book: OutcomeBook) -> list[float]:
    """Task "t": a (1.0 + 0.1), b (0.1), c (0.1) end properly; f (0.0) fails."""
    for traj, seg, total, failed in [("a", "a0", 0.1, False), ("a", "a1", 1.0, False),
                                     ("b", "b0", 0.1, False), ("c", "c0", 0.1, False),
                                     ("f", "f0", 0.0, True)]:
        book.record(traj, seg, total, failed=failed)
    return book.global_advantages([("a", "t", True), ("b", "t", True), ("f", "t", True),
                                   ("c", "t", True)])


def test_a_failed_member_is_left_out_of_its_groups_baseline():
    book = OutcomeBook(group_size=4, mask_failed=True)
    adv = _end_group(book)
    # Baseline over the proper members {1.1, 0.1, 0.1} only: mean 0.4333, sample std
    # sqrt((0.6667^2 + 2 * 0.3333^2) / 2) = 0.57735 -> a: 0.6667 / 0.57735 = 1.1547,
    # b, c: -0.3333 / 0.57735 = -0.57735. f: no outcome advantage (NaN -> fusion weight 0).
    assert adv[0] == pytest.approx(1.1547, abs=1e-4)
    assert adv[1] == pytest.approx(-0.57735, abs=1e-4) and adv[3] == pytest.approx(adv[1])
    assert math.isnan(adv[2])
    slow = slow_group_outcome_advantage([1.1, 0.1, 0.1], ["t"] * 3)
    assert [adv[0], adv[1], adv[3]] == pytest.approx(slow, abs=1e-9)
    # Four members ended (three proper, one failed) = group_size: the group is forgotten.
    assert not book.groups and not book.failed_members and not book.totals and not book.failed


def test_without_masking_a_failed_member_counts_as_a_zero_outcome():
    book = OutcomeBook(group_size=4, mask_failed=False)
    adv = _end_group(book)
    # {1.1, 0.1, 0.0, 0.1}: mean 0.325, std sqrt((0.775^2 + 2 * 0.225^2 + 0.325^2) / 3)
    # = sqrt(0.8075 / 3) = 0.51882 -> f: -0.325 / 0.51882 = -0.6264 (the crash reads as a
    # failure), and b's advantage rises from -0.5774 to -0.225 / 0.51882 = -0.4337 (the
    # baseline was pulled down).
    slow = slow_group_outcome_advantage([1.1, 0.1, 0.0, 0.1], ["t"] * 4)
    assert adv == pytest.approx(slow, abs=1e-9)
    assert adv[2] == pytest.approx(-0.6264, abs=1e-4)
    assert adv[1] == pytest.approx(-0.4337, abs=1e-4)


def test_a_group_whose_members_all_failed_is_forgotten_and_gives_no_advantage():
    book = OutcomeBook(group_size=2)
    book.record("x", "x0", 0.3, failed=True)
    book.record("y", "y0", 0.0, failed=True)
    adv = book.global_advantages([("x", "t", True), ("y", "t", True)])
    assert all(math.isnan(a) for a in adv)
    assert not book.groups and not book.failed_members and not book.totals


def test_a_failed_member_ending_first_does_not_hold_its_group_open():
    book = OutcomeBook(group_size=2)
    book.record("f", "f0", 0.0, failed=True)
    assert math.isnan(book.global_advantages([("f", "t", True)])[0])
    assert book.failed_members == {"t": {"f"}}
    book.record("a", "a0", 1.0)
    # The one proper member is alone in its baseline: no comparison -> 0, not NaN.
    assert book.global_advantages([("a", "t", True)]) == [0.0]
    assert not book.groups and not book.failed_members


# -- segments and bootstrapping ---------------------------------------------------------------


def _step(i: int, next_context: list[int] | None) -> TrajectoryStep:
    return TrajectoryStep(
        event_id=event_id("step", i), run_id="r", producer="sampler", key="tr",
        trajectory_id="tr", task_id="workshop:1", step_index=i, policy_version=0,
        context_tokens=[1 + i, 2 + i, 3], action_tokens=[5], action_logprobs=[-0.5],
        next_context_tokens=next_context)


def _error(kind: str = "exception", message: str = "step raised InjectedFault") -> EnvError:
    return EnvError(event_id=event_id("env-error", kind), run_id="r", producer="sampler",
                    key="tr", trajectory_id="tr", task_id="workshop:1", step_index=3,
                    kind=kind, message=message)


def _failed_segment(next_context: list[int] | None, error: EnvError | None = None):
    core = SegmenterCore(SegmenterConfig(max_segment_steps=16, close_on_milestone=False))
    for i in range(3):
        assert core.add(_step(i, [9, 9, i] if i < 2 else next_context), (0, i)) == []
    (closed,) = core.abort(error or _error())
    return closed


@pytest.mark.parametrize(("kind", "message", "expected"), [
    ("timeout", "step took longer than 10s", "timeout"),
    ("exception", "abandoned: the sampler restarted mid-episode", "abandoned"),
    ("exception", "step raised InjectedFault: injected fault at step 3", "env-error"),
    ("oversized-observation", "step returned 20000 characters", "env-error"),
])
def test_the_segmenter_marks_the_failed_segment_with_its_kind(kind, message, expected):
    error = _error(kind, message)
    assert failure_of(error) == expected
    closed = _failed_segment([7, 7, 7], error)
    assert closed.failure == expected and not closed.terminal
    event = segment_closed(closed, "seg", SegmentRef("a", "h"), run_id="r", producer="s")
    assert event.trajectory_done and event.failure == expected


def test_old_events_without_the_failure_field_still_decode_as_properly_ended():
    closed = _failed_segment([7, 7, 7])
    event = segment_closed(closed, "seg", SegmentRef("a", "h"), run_id="r", producer="s")
    raw = msgspec.json.decode(msgspec.json.encode(event))
    del raw["failure"]
    old = msgspec.json.decode(msgspec.json.encode(raw), type=SegmentClosed)
    assert old.failure == ""


def test_the_arbiter_pays_a_failed_episode_no_outcome_and_copies_the_mark():
    closed = _failed_segment([7, 7, 7])
    segment = segment_closed(closed, "seg", SegmentRef("a", "h"), run_id="r", producer="s")
    arbitration = Arbitration(ArbiterConfig(outcome_failure=-1.0))
    scored = arbitration.score(segment, set(), "arbiter").scored
    assert scored is not None and scored.failure == "env-error"
    assert scored.components["outcome"] == 0.0 and scored.step_rewards == [0.0, 0.0, 0.0]
    assert scored.decided_by == "none"  # nothing was paid: no outcome decided it
    proper = msgspec.structs.replace(segment, failure="")
    paid = arbitration.score(proper, set(), "arbiter").scored
    assert paid is not None and paid.components["outcome"] == -1.0 and paid.failure == ""


class ContextValues:
    """A critic stand-in: V(context) = sum(tokens) / 10 (any fixed function would do)."""

    def values(self, contexts: list[list[int]]) -> torch.Tensor:
        return torch.tensor([sum(c) / 10.0 for c in contexts])

    def evaluate(self, contexts: list[list[int]], actions: list[list[int]]) -> EvalOutput:
        """The batch's values come from the pass over contexts and actions together."""
        zeros = torch.zeros(len(actions), max(len(a) for a in actions))
        return EvalOutput(logprobs=zeros, entropy=zeros, values=self.values(contexts),
                          mask=zeros)


def _item(closed, rewards: list[float]) -> BatchItem:
    n = len(closed.steps)
    scored = Scored(
        event_id="s", run_id="r", producer="arbiter", key="tr", segment_id="seg",
        trajectory_id="tr", task_id="workshop:1", address="a", content_hash="h",
        step_start=0, step_end=n, min_policy_version=0, trajectory_done=True, success=False,
        components={}, step_rewards=rewards, total=sum(rewards), decided_by="outcome",
        failure=closed.failure)
    return BatchItem(scored, segment_arrays(closed))


GAMMA, LAM = 0.9, 0.8
REWARDS = [0.1, 0.0, 0.2]


def _reference(boot: float) -> list[float]:
    """The slow GAE loop on the same segment, bootstrapped with ``boot`` (not terminal)."""
    values = [sum(_step(i, None).context_tokens) / 10.0 for i in range(3)]
    adv, _ = slow_segment_gae([REWARDS], [values], [[1.0, 1.0, 1.0]], [boot], [False],
                              GAMMA, LAM)
    return adv[0]


def test_a_failed_last_segment_bootstraps_from_its_last_context_when_none_follows():
    closed = _failed_segment(next_context=None)  # the failed step's observation never came
    assert int(segment_arrays(closed)["bootstrap_len"][0]) == 0
    prep = prepare_batch(ContextValues(), [_item(closed, REWARDS)], GAMMA, LAM, [math.nan],
                         "fusion", bootstrap_failed=True)
    last_context = closed.steps[-1].context_tokens  # V = (3 + 4 + 3) / 10 = 1.0
    assert prep.local_advantages.tolist() == pytest.approx(_reference(sum(last_context) / 10.0))
    assert prep.fusion_weights == [0.0] and prep.failed_segments == 1
    # Masking off (the old behaviour): nothing recorded -> a zero return after the crash.
    old = prepare_batch(ContextValues(), [_item(closed, REWARDS)], GAMMA, LAM, [math.nan],
                        "gae", bootstrap_failed=False)
    assert old.local_advantages.tolist() == pytest.approx(_reference(0.0))
    assert prep.local_advantages[-1] > old.local_advantages[-1]


def test_a_failed_last_segment_with_a_next_context_bootstraps_from_it():
    closed = _failed_segment(next_context=[20, 20, 20])
    prep = prepare_batch(ContextValues(), [_item(closed, REWARDS)], GAMMA, LAM, None, "gae")
    assert prep.local_advantages.tolist() == pytest.approx(_reference(6.0))


def test_a_properly_ended_segment_is_still_not_bootstrapped():
    core = SegmenterCore(SegmenterConfig(max_segment_steps=16, close_on_milestone=False))
    core.add(_step(0, [9, 9, 0]), (0, 0))
    (closed,) = core.add(msgspec.structs.replace(_step(1, None), done=True), (0, 1))
    assert closed.terminal and closed.failure == ""
    prep = prepare_batch(ContextValues(), [_item(closed, [0.0, 1.0])], GAMMA, LAM, None, "gae")
    values = [sum(s.context_tokens) / 10.0 for s in closed.steps]
    adv, _ = slow_segment_gae([[0.0, 1.0]], [values], [[1.0, 1.0]], [0.0], [True], GAMMA, LAM)
    assert prep.local_advantages.tolist() == pytest.approx(adv[0])


# -- the fault drill ------------------------------------------------------------------------


class Counter(Env):
    """A stub environment: never ends on its own, counts its steps."""

    max_steps = 50

    def __init__(self) -> None:
        self.steps = 0

    async def reset(self, task_id: str, seed: int) -> str:
        return "start"

    async def step(self, action: str) -> StepResult:
        self.steps += 1
        return StepResult("ok", 0.0, False, False, False, 0.0)


def test_the_fault_schedule_is_deterministic_per_seed_and_stream():
    def plans(seed: object, stream: int) -> list[int | None]:
        schedule = FaultSchedule(0.1, 100, seed, stream)
        return [schedule.next_episode().fail_at for _ in range(3000)]

    first = plans((7, 0), 0)
    assert first == plans((7, 0), 0)
    assert first != plans((7, 0), 1) and first != plans((8, 0), 0)
    fails = [at for at in first if at is not None]
    # Binomial(3000, 0.1): mean 300, sd sqrt(3000 * 0.1 * 0.9) = 16.4; 5 sd either side.
    assert 218 <= len(fails) <= 382
    assert min(fails) >= 0 and max(fails) <= 99
    assert len(set(fails)) > 80  # spread over the whole range, not a fixed step


def test_a_scheduled_fault_raises_at_its_step_and_the_guard_reports_it():
    async def play(env: FaultyEnv) -> tuple[int, EnvFailure | None]:
        await env.reset("t:1", 1)
        for i in range(env.max_steps):
            result = await guarded_step(env, "go", 5.0)
            if isinstance(result, EnvFailure):
                return i, result
        return env.max_steps, None

    env = FaultyEnv(Counter(), 1.0, fault_seed=3, fail_within_steps=10, stream=0)
    twin = FaultSchedule(1.0, 10, 3, 0).next_episode()
    at, failure = asyncio.run(play(env))
    assert at == twin.fail_at and failure is not None and failure.kind == "exception"
    assert "InjectedFault" in failure.message and env.injected == 1
    assert env.inner.steps == at  # the failing step never reached the environment
    with pytest.raises(InjectedFault):
        never = FaultyEnv(Counter(), 1.0, fault_seed=3, fail_within_steps=1, stream=0)
        asyncio.run(never.reset("t:1", 1))
        asyncio.run(never.step("go"))
    clean = FaultyEnv(Counter(), 0.0, stream=0)
    assert asyncio.run(play(clean)) == (50, None)


def test_the_drill_is_off_unless_configured():
    env = Counter()
    assert with_faults(env, TaskSection()) is env
    wrapped = with_faults(env, TaskSection(fail_episode_rate=0.1, fail_within_steps=20), 1)
    assert isinstance(wrapped, FaultyEnv) and wrapped.schedule.within_steps == 20
    assert isinstance(with_faults(env, TaskSection(fail_episode_rate=0.1)), FaultyEnv)
    with pytest.raises(ValueError, match="fail_episode_rate"):
        with_faults(env, TaskSection(fail_episode_rate=1.5))


def test_arrays_of_a_failed_segment_keep_the_recorded_bootstrap():
    closed = _failed_segment(next_context=[4, 4])
    arrays = segment_arrays(closed)
    assert arrays["bootstrap_len"].tolist() == [2] and not arrays["terminal"][0]
    assert np.array_equal(arrays["bootstrap_context"][0, :2], [4, 4])


# -- counted and shown ----------------------------------------------------------------------


def test_failed_episodes_are_counted_by_kind_in_the_monitor_and_the_report(tmp_path):
    errors = [_error("timeout", "step took longer than 10s"),
              _error("exception", "abandoned: the sampler restarted mid-episode"),
              _error("exception", "step raised InjectedFault: injected fault at step 3"),
              _error("oversized-observation", "step returned 20000 characters")]
    errors = [msgspec.structs.replace(e, event_id=f"e{i}", trajectory_id=f"t{i}")
              for i, e in enumerate(errors)]
    state, report = MonitorState(), ReportData(str(tmp_path))
    for error in errors:
        state.apply(error)
        report.apply(error)
    state.apply(errors[0])  # a redelivered copy is not a second failure
    assert state.counts.failed_episodes == 4
    assert state.failure_kinds == {"env-error": 2, "timeout": 1, "abandoned": 1}
    with open(os.devnull, "w") as sink:
        console = Console(width=160, record=True, file=sink)
        console.print(render(state))
    text = console.export_text()
    assert "failed episodes 4 (env-error 2, timeout 1, abandoned 1)" in text
    page = _health_html(report)
    assert "<td>4</td><td>env-error: 2, timeout: 1, abandoned: 1</td>" in page
    fold = RunFold("r")
    for error in [*errors, errors[0]]:
        fold.apply(error, TRAJECTORY_STEP)
    summary = summarize(fold, wall_seconds=1.0)
    assert summary["failed_episodes"] == 4
    assert summary["failed_by_kind"] == {"abandoned": 1, "env-error": 2, "timeout": 1}


def test_the_replayed_outcome_book_masks_the_same_failed_member_as_the_live_one():
    def scored(traj: str, total: float, failure: str = "") -> Scored:
        return Scored(
            event_id=f"s-{traj}", run_id="r", producer="arbiter", key=traj,
            segment_id=f"seg-{traj}", trajectory_id=traj, task_id="t", address="a",
            content_hash="h", step_start=0, step_end=1, min_policy_version=0,
            trajectory_done=True, success=False, components={}, step_rewards=[total],
            total=total, decided_by="outcome", failure=failure)

    log = {s.segment_id: s for s in [scored("a", 1.0), scored("b", 0.0), scored("f", 0.0,
                                                                                "timeout")]}
    update = PolicyVersion(event_id="v1", run_id="r", producer="learner", version=1,
                           checkpoint="c", checkpoint_hash="h", trained_segments=list(log))
    for mask, expected in [(True, [0.7071, -0.7071, math.nan]),
                           (False, [1.1547, -0.5774, -0.5774])]:
        ((_, adv),) = replay_outcome_book(OutcomeBook(3, mask), log, [update])
        assert adv == pytest.approx(expected, abs=1e-4, nan_ok=True)


@pytest.mark.parametrize("task, match", [({"fail_episode_rate": 1.5}, "fail_episode_rate"),
                                         ({"fail_episode_rate": -0.1}, "fail_episode_rate"),
                                         ({"fail_within_steps": -1}, "fail_within_steps")])
def test_a_fault_drill_out_of_range_is_refused_at_load(tiny, task, match):
    from gyre_async.config import validate
    from gyre_async.errors import ConfigError

    validate(tiny.config(task={"fail_episode_rate": 0.1}))  # in range: fine
    with pytest.raises(ConfigError, match=match):
        validate(tiny.config(task=task))
