"""Pacing, don't dropping: the sampler's view of segment boundaries (it must agree with the
segmenter's), the gate following the learner's drops at once, and the stale-dropped
fraction reported by ``gyre run`` and ``ops/chaos.py``. The rule's numbers are worked out
in ``test_staleness.py``."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from gyre_async.core.pacing import SegmentCursor
from gyre_async.core.sampler import SamplerCore
from gyre_async.core.segmenter import SegmenterCore
from gyre_async.envs.base import StepResult
from gyre_async.folds.pacing import stale_dropped_fraction, stale_dropped_steps
from schemas import event_id
from schemas.config import SegmenterConfig
from schemas.events import Milestone, SegmentClosed, SegmentDropped, TrajectoryStep

MILESTONE = Milestone(name="m", proof="proof")


def _result(done: bool, milestone: bool, changed: bool) -> StepResult:
    return StepResult(observation="", feedback=0.0, done=done, truncated=False, success=done,
                      score=0.0, milestones=(MILESTONE,) if milestone else (),
                      state_changed=changed)


@pytest.mark.parametrize("close_on_milestone", [True, False])
@pytest.mark.parametrize("close_on_state_change", [True, False])
@pytest.mark.parametrize("milestone_min_steps", [0, 3])
def test_the_sampler_sees_segments_open_where_the_segmenter_opens_them(
        close_on_milestone, close_on_state_change, milestone_min_steps):
    config = SegmenterConfig(max_segment_steps=5, close_on_milestone=close_on_milestone,
                             close_on_state_change=close_on_state_change,
                             milestone_min_steps=milestone_min_steps)
    rng = random.Random(7)
    segmenter = SegmenterCore(config)
    opened_by_segmenter: list[tuple[str, int]] = []
    opened_by_sampler: list[tuple[str, int]] = []
    for episode in range(30):
        tid, cursor, length = f"t{episode}", SegmentCursor(config), rng.randint(1, 40)
        for i in range(length):
            if cursor.opens_segment:
                opened_by_sampler.append((tid, i))
            result = _result(done=i == length - 1, milestone=rng.random() < 0.15,
                             changed=rng.random() < 0.2)
            cursor.after(result)
            step = TrajectoryStep(
                event_id=event_id("s", tid, i), run_id="t", producer="sampler", key=tid,
                trajectory_id=tid, task_id="task", step_index=i, policy_version=0,
                context_tokens=[1], action_tokens=[2], action_logprobs=[-0.1],
                done=result.done, success=result.success,
                milestones=list(result.milestones), state_changed=result.state_changed)
            for closed in segmenter.add(step, (0, i)):
                opened_by_segmenter.append((closed.trajectory_id, closed.steps[0].step_index))
    assert sorted(opened_by_sampler) == sorted(opened_by_segmenter)
    assert len(opened_by_segmenter) > 30  # segments inside episodes, not just one each


def test_a_milestone_closes_a_segment_only_once_it_holds_milestone_min_steps():
    """Milestones at steps 0, 1, 2, 6 and 7 of one episode: every one closes a segment by
    default; with ``milestone_min_steps = 3`` the first closes at step 2 (three steps), the
    next at step 6, and step 7's milestone falls in a one-step segment that stays open
    until the episode ends."""
    def segment_lengths(config: SegmenterConfig) -> list[tuple[int, str]]:
        cursor, lengths, length = SegmentCursor(config), [], 0
        for i in range(10):
            length += 1
            boundary = cursor.after(_result(done=i == 9, milestone=i in (0, 1, 2, 6, 7),
                                            changed=False))
            if boundary is not None:
                lengths.append((length, boundary))
                length = 0
        return lengths

    every = segment_lengths(SegmenterConfig(max_segment_steps=24))
    assert every == [(1, "milestone"), (1, "milestone"), (1, "milestone"), (4, "milestone"),
                     (1, "milestone"), (2, "trajectory-end")]
    fewer = segment_lengths(SegmenterConfig(max_segment_steps=24, milestone_min_steps=3))
    assert fewer == [(3, "milestone"), (4, "milestone"), (3, "trajectory-end")]
    capped = segment_lengths(SegmenterConfig(max_segment_steps=2, milestone_min_steps=3))
    # the length cap still cuts first (the milestones at steps 1 and 7 end 2-step segments)
    assert capped == [(2, "max-length")] * 4 + [(2, "trajectory-end")]


def _dropped(segment: str, reason: str = "stale", steps: int = 0, consumed: int = 0,
             copy: int = 0) -> SegmentDropped:
    return SegmentDropped(event_id=event_id("dropped", segment, copy), run_id="r",
                          producer="learner", segment_id=segment, reason=reason, staleness=3,
                          steps=steps, consumed_steps=consumed)


def _core(max_staleness: int, batch: int, slots: int, longest: int, version: int = 5):
    cfg = SimpleNamespace(
        run=SimpleNamespace(mode="async"), loop=SimpleNamespace(max_staleness=max_staleness),
        learner=SimpleNamespace(batch_steps=batch),
        sampler=SimpleNamespace(replicas=1, replica=0, num_envs=slots),
        segmenter=SimpleNamespace(max_segment_steps=longest))
    return SamplerCore(cfg, SimpleNamespace(version=version), builder=None)


def test_a_drop_reopens_the_gate_at_once():
    """Quickstart-sized gate (max_staleness 2, batches 1024, H = 32 * 32): a slot waiting to
    open a segment is let through as soon as a drop announces the learner's consumed count,
    not at the next version (which a learner short of a batch would never publish)."""
    core = _core(2, 1024, 32, 32)
    core.learner_version, core.learner_consumed = 5, 5_200
    # nothing open: a segment opens while fewer than base + reach = max(5 * 1024, 5,200) +
    # 3 * 1024 = 8,272 steps are out, so it can arrive within the bound; the cap is 9,296
    core.steps_emitted = 8_272

    async def go() -> None:
        await core._admit("t0", opens_segment=False)  # inside a rebuilt segment: the cap
        assert core.steps_emitted == 8_273
        waiting = asyncio.create_task(core._admit("t1", opens_segment=True))
        await asyncio.sleep(0.01)
        assert not waiting.done() and core.at_gate == 1
        await core.follow_drop(_dropped("s1", consumed=5_190))  # older news: nothing moves
        await asyncio.sleep(0.01)
        assert not waiting.done() and core.learner_consumed == 5_200
        # 24 steps dropped: consumed 5,224 -> base + reach 8,296: 8,273 out, it may open
        await core.follow_drop(_dropped("s2", steps=24, consumed=5_224))
        await asyncio.wait_for(waiting, 1.0)
        assert core.steps_emitted == 8_274 and core.at_gate == 0

    asyncio.run(go())


def test_a_wait_the_stop_cuts_short_counts_as_paused():
    """``paused_s`` (the heartbeat's, and llm_sequence's ``sampler_paused_fraction``) counts
    every second a slot spent at the gate, also a wait that only the run's end ended: a slot
    held from its first step to the stop paused all along."""
    from gyre_async.core.sampler import _Stopped

    core = _core(2, 1024, 32, 32)
    core.learner_version, core.learner_consumed = 5, 5_200
    core.steps_emitted = 9_296  # at the hard cap: nothing more is admitted

    async def go() -> None:
        stopping = asyncio.Event()
        core._stopping = stopping
        opener = asyncio.create_task(core._open_gate_on(stopping))
        held = asyncio.create_task(core._admit("t", opens_segment=True))
        await asyncio.sleep(0.2)
        assert not held.done() and core.at_gate == 1 and core.paused_s == 0.0
        stopping.set()
        with pytest.raises(_Stopped):
            await asyncio.wait_for(held, 1.0)
        await opener
        assert core.at_gate == 0 and core.steps_emitted == 9_296
        assert core.paused_s >= 0.2

    asyncio.run(go())


def test_a_slot_waits_while_its_step_would_age_an_older_open_segment_past_the_bound():
    """max_staleness 1, batches of 8, segments of up to 4 steps: a segment opened at
    version 5 arrives within the bound if fewer than (1 + 1) * 8 = 16 steps reach the learner
    ahead of it. A younger segment's slot waits once its next step could be one of them;
    the older segment's own slot goes on, and its closing lets the younger one go."""
    core = _core(1, 8, 2, 4)
    core.learner_version, core.learner_consumed = 5, 40  # base = 40

    async def go() -> None:
        await core._admit("a", opens_segment=True)  # a opens at 0 steps out
        await core._admit("b", opens_segment=True)  # b opens beside it
        core.steps_emitted = 54  # 13 steps of segments that closed since, still not consumed
        # outside a (1 step): 53 out, room 40 + 16 - 53 - 1 = 2: b may take two more steps
        await core._admit("b", opens_segment=False)
        await core._admit("b", opens_segment=False)
        held = asyncio.create_task(core._admit("b", opens_segment=False))
        await asyncio.sleep(0.01)
        assert not held.done() and core.at_gate == 1  # one more could put a past the bound
        opener = asyncio.create_task(core._admit("c", opens_segment=True))
        await asyncio.sleep(0.01)
        assert not opener.done()  # nor may a new segment open beside a
        await core._admit("a", opens_segment=False)  # the oldest goes on
        assert not held.done()
        await core._segment_closed("a")  # a closed: nothing older to protect
        await asyncio.wait_for(held, 1.0)
        assert core.steps_emitted == 58 and core.at_gate == 1
        opener.cancel()

    asyncio.run(go())


@pytest.mark.parametrize("steps_after, opens", [(2, True), (None, False), (63, False)])
def test_a_segment_near_its_episodes_cap_holds_back_only_the_steps_the_cap_leaves(
        steps_after, opens):
    """max_staleness 1, batches of 8, segments of up to 16 steps: a new segment may open
    beside ``a`` only if its room (40 + 16 - 41 - 1 = 14) covers what ``a`` may still take.
    Opened two steps before its episode's cap, ``a`` can take 2 more, so ``b`` opens; at the
    start of a long episode (or with no cap known) ``a`` may take 15 more, so ``b`` waits."""
    core = _core(1, 8, 2, 16)
    core.learner_version, core.learner_consumed = 5, 40  # base = 40
    core.steps_emitted = 40  # all consumed

    async def go() -> None:
        await core._admit("a", opens_segment=True, steps_after=steps_after)
        assert core.steps_emitted == 41
        opener = asyncio.create_task(core._admit("b", opens_segment=True))
        await asyncio.sleep(0.01)
        assert opener.done() == opens
        if not opens:
            await core._segment_closed("a")
            await asyncio.wait_for(opener, 1.0)

    asyncio.run(go())
    assert core._segments["a" if opens else "b"].remaining == (2 if opens else 15)


def _closed(segment: str, start: int, end: int, env_steps: int = 0) -> SegmentClosed:
    return SegmentClosed(event_id=event_id("closed", segment), run_id="r", producer="segmenter",
                         segment_id=segment, trajectory_id="t", task_id="task",
                         step_start=start, step_end=end, boundary="max-length", address="a",
                         content_hash="h", min_policy_version=0, max_policy_version=0,
                         env_steps=env_steps)


def test_stale_dropped_fraction_counts_env_steps_of_stale_drops_once():
    segments = [_closed("a", 0, 32), _closed("b", 32, 40, env_steps=20), _closed("c", 0, 16)]
    dropped = [
        _dropped("a"), _dropped("a", copy=1),   # redelivered: counted once -> 32 steps
        _dropped("b"),                          # a macro segment: 20 primitive env steps
        _dropped("c", reason="rolled-back"),    # not a staleness drop: not counted
        _dropped("x", steps=5),                 # its segment-closed unread: its own length
    ]
    # 32 + 20 + 5 = 57 of 1,000 sampled env steps
    assert stale_dropped_steps(dropped, segments) == 57
    assert stale_dropped_fraction(dropped, segments, 1_000) == 0.057
    assert stale_dropped_fraction([], segments, 1_000) == 0.0
    assert stale_dropped_fraction(dropped, segments, 0) is None  # nothing sampled yet


def test_the_sampler_actor_follows_drops_on_the_bus(tmp_path, tiny):
    """Wiring: a ``segment-dropped`` on ``telemetry`` (this run's; another run's is ignored)
    moves the sampler's gate, through the real embedded bus."""
    from actors.sampler import Sampler
    from gyre_async.bus import open_bus
    from gyre_async.compose import build_policy, build_tokenizer, save_weights
    from gyre_async.runtime.actor import ActorRunner
    from gyre_async.storage.checkpoints import CheckpointStore
    from schemas import encode
    from schemas.events import PolicyVersion
    from schemas.topics import ALL_TOPICS, POLICY_VERSION, TELEMETRY

    cfg = tiny.config(run={"run_dir": str(tmp_path)})
    ref = save_weights(CheckpointStore(str(tmp_path / "checkpoints")),
                       build_policy(cfg, build_tokenizer(cfg)), 0)
    v0 = PolicyVersion(event_id=event_id("pv", 0), run_id="tiny", producer="learner",
                       key="policy", version=0, checkpoint=ref.address,
                       checkpoint_hash=ref.sha256, reason="init")

    def drop(run_id: str, consumed: int) -> SegmentDropped:
        return SegmentDropped(event_id=event_id("dropped", run_id), run_id=run_id,
                              producer="learner", key="t", segment_id=f"{run_id}-s",
                              reason="stale", staleness=3, steps=16, consumed_steps=consumed)

    async def go() -> tuple[int, int, int]:
        async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
            await bus.create_topics(ALL_TOPICS, 1)
            await bus.publish(POLICY_VERSION, [(v0.key.encode(), encode(v0))])
            sampler = Sampler(cfg)
            runner = ActorRunner(sampler, bus, run_id="tiny", name="sampler", partitions=1,
                                 heartbeat_s=30, stop_grace_s=0.2)
            task = asyncio.create_task(runner.run())
            core = sampler.core
            for _ in range(600):  # no learner progress: every slot ends up at the gate
                if core.at_gate == cfg.sampler.num_envs or task.done():
                    break
                await asyncio.sleep(0.1)
            held = core.steps_emitted
            other = drop("another-run", 10_000)
            await bus.publish(TELEMETRY, [(other.key.encode(), encode(other))])
            await asyncio.sleep(1.0)
            ignored = core.learner_consumed
            mine = drop("tiny", 300)
            await bus.publish(TELEMETRY, [(mine.key.encode(), encode(mine))])
            for _ in range(100):
                if core.steps_emitted > held:
                    break
                await asyncio.sleep(0.1)
            moved = core.steps_emitted
            runner.stop()
            await task
        return held, ignored, moved

    held, ignored, moved = asyncio.run(go())
    # tiny: 8 slots, segments of 16, batches of 256, max_staleness 2: segments open below
    # 0 + max(3 * 256 - 128, 256 + 128) = 640; the cap for open ones is 768 + 128 = 896
    assert 640 <= held <= 896
    assert ignored == 0  # another run's drop does not move this run's gate
    assert moved > held  # consumed 300: segments open again below 300 + 640 = 940


def test_a_rebuilt_episode_inside_a_segment_is_paced_like_one_the_sampler_opened():
    """A restarted sampler rebuilds an episode whose open segment (its last 2 logged steps)
    was opened by version 4; the learner is at 5 (max_staleness 1, batches of 8: that
    segment may have 8 steps ahead of it). Tracked by its first step's version, it holds a
    new segment back once its room is gone, as a segment the sampler opened would; a log
    without versions leaves it unpaced."""
    from gyre_async.core.rollout import LoggedStep

    core = _core(1, 8, 2, 4)
    core.learner_version, core.learner_consumed = 5, 40
    steps = [LoggedStep("a", "h0", (), 3), LoggedStep("b", "h1", (), 4),
             LoggedStep("c", "h2", (), 4)]
    core._track_rebuilt_segment("r", steps, 2, max_steps=64)
    # 49 out, 47 outside r: 40 + 8 - 47 - 1 = 0 steps of room left for others
    core.steps_emitted = 49

    async def go() -> None:
        opener = asyncio.create_task(core._admit("n", opens_segment=True))
        await asyncio.sleep(0.01)
        assert not opener.done() and core.at_gate == 1
        await core._admit("r", opens_segment=False)  # the rebuilt one goes on
        await core._segment_closed("r")
        await asyncio.wait_for(opener, 1.0)

    asyncio.run(go())
    unversioned = _core(1, 8, 2, 4)
    unversioned._track_rebuilt_segment("r", [LoggedStep("a", "h0"), LoggedStep("b", "h1")], 2,
                                      max_steps=64)
    assert not unversioned._segments
