"""Segmenter: cuts trajectories into training segments at sub-task boundaries.

consumes: trajectory-step (TrajectoryStep, EnvError)
emits:    segment-closed (SegmentClosed)

A segment closes when a milestone is reached (a sub-task completed), optionally when the
environment signals a significant state change, at ``max_segment_steps``, and when the
trajectory ends. Its arrays (context and action tokens, behaviour log-probs, masks,
versions, feedback, and the context that follows it, for the value bootstrap) are written
to the Zarr segment store *before* ``segment-closed`` announces their address.

Crash safety: open segments live in memory, so the runtime never commits past the oldest
step an open segment holds (``commit_floor``); on restart the segmenter rebuilds, from its
own ``segment-closed`` log, where each trajectory's next segment starts, so redelivered
steps of already-closed segments are skipped and nothing is segmented twice.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from gyre_async import timing
from gyre_async.runtime.actor import Actor, Emit
from gyre_async.bus.reading import iter_topics
from gyre_async.envs.macros import env_steps_of
from gyre_async.experience.retention import Retention, incoming_bytes
from gyre_async.storage.segments import SegmentStore
from schemas import decode, event_id
from schemas.config import Config, SegmenterConfig
from schemas.events import EnvError, SegmentClosed, TrajectoryStep
from schemas.topics import SEGMENT_CLOSED, TRAJECTORY_STEP


@dataclass
class OpenSegment:
    steps: list[TrajectoryStep] = field(default_factory=list)
    offsets: list[tuple[int, int]] = field(default_factory=list)  # (partition, offset)


@dataclass(frozen=True)
class ClosedSegment:
    trajectory_id: str
    steps: tuple[TrajectoryStep, ...]
    boundary: str
    terminal: bool  # the trajectory ended with a real outcome (no value bootstrap)
    first_offset: tuple[int, int] = (0, -1)  # (partition, offset) of its first step


def pad(rows: list[list[int]], width: int, dtype=np.int32) -> tuple[np.ndarray, np.ndarray]:
    out = np.zeros((len(rows), max(width, 1)), dtype=dtype)
    lengths = np.zeros(len(rows), dtype=np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
        lengths[i] = len(row)
    return out, lengths


def segment_arrays(seg: ClosedSegment) -> dict[str, np.ndarray]:
    """The arrays the learner trains on, one row per step."""
    steps = seg.steps
    ctx, ctx_len = pad([s.context_tokens for s in steps], max(len(s.context_tokens) for s in steps))
    width = max(len(s.action_tokens) for s in steps)
    act, act_len = pad([s.action_tokens for s in steps], width)
    logp = np.zeros((len(steps), max(width, 1)), dtype=np.float32)
    for i, s in enumerate(steps):
        logp[i, : len(s.action_logprobs)] = s.action_logprobs
    mask = (np.arange(max(width, 1))[None, :] < act_len[:, None]).astype(np.uint8)
    last = steps[-1]
    boot = last.next_context_tokens or []
    boot_arr = np.zeros((1, max(len(boot), 1)), dtype=np.int32)
    boot_arr[0, : len(boot)] = boot
    return {
        "context_tokens": ctx, "context_len": ctx_len, "action_tokens": act,
        "action_logprobs": logp, "action_mask": mask,
        "policy_version": np.array([s.policy_version for s in steps], dtype=np.int32),
        "feedback": np.array([s.feedback for s in steps], dtype=np.float32),
        "step_index": np.array([s.step_index for s in steps], dtype=np.int64),
        "bootstrap_context": boot_arr,
        "bootstrap_len": np.array([len(boot)], dtype=np.int32),
        "terminal": np.array([1 if seg.terminal else 0], dtype=np.uint8),
    }


class SegmenterCore:
    """Pure segmentation logic: steps in, closed segments out (no bus, no storage)."""

    def __init__(self, config: SegmenterConfig):
        self.config = config
        self.open: dict[str, OpenSegment] = {}
        self.next_step: dict[str, int] = {}  # first step index not yet in a closed segment
        self.ended: set[str] = set()

    def restore(self, closed: SegmentClosed) -> None:
        """Fold one of our own past outputs back into state (restart recovery)."""
        self.next_step[closed.trajectory_id] = max(
            self.next_step.get(closed.trajectory_id, 0), closed.step_end
        )
        if closed.boundary == "trajectory-end":
            self.ended.add(closed.trajectory_id)

    def add(self, step: TrajectoryStep, where: tuple[int, int]) -> list[ClosedSegment]:
        tid = step.trajectory_id
        if tid in self.ended or step.step_index < self.next_step.get(tid, 0):
            return []  # already segmented (redelivery after a restart)
        seg = self.open.setdefault(tid, OpenSegment())
        if seg.steps and step.step_index <= seg.steps[-1].step_index:
            return []  # duplicate within the open segment
        if seg.steps and step.step_index != seg.steps[-1].step_index + 1:
            # A gap (a step lost upstream, e.g. dead-lettered): a segment covers contiguous
            # steps only, so cut before the gap and start a new segment at this step.
            return [self._close(tid, "max-length", terminal=False)] + self.add(step, where)
        seg.steps.append(step)
        seg.offsets.append(where)
        if step.done or step.truncated:
            return [self._close(tid, "trajectory-end", terminal=step.done and not step.truncated)]
        if step.milestones and self.config.close_on_milestone:
            return [self._close(tid, "milestone", terminal=False)]
        if step.state_changed and self.config.close_on_state_change:
            return [self._close(tid, "state-change", terminal=False)]
        if len(seg.steps) >= self.config.max_segment_steps:
            return [self._close(tid, "max-length", terminal=False)]
        return []

    def abort(self, error: EnvError) -> list[ClosedSegment]:
        """An environment failure ends the trajectory: close what is open, as truncated."""
        tid = error.trajectory_id
        seg = self.open.get(tid)
        self.ended.add(tid)
        if seg is None or not seg.steps:
            self.open.pop(tid, None)
            return []
        return [self._close(tid, "trajectory-end", terminal=False)]

    def _close(self, tid: str, boundary: str, terminal: bool) -> ClosedSegment:
        seg = self.open.pop(tid)
        self.next_step[tid] = seg.steps[-1].step_index + 1
        if boundary == "trajectory-end":
            self.ended.add(tid)
        return ClosedSegment(tid, tuple(seg.steps), boundary, terminal, seg.offsets[0])

    def commit_floor(self) -> dict[tuple[str, int], int]:
        floor: dict[tuple[str, int], int] = {}
        for seg in self.open.values():
            for partition, offset in seg.offsets[:1]:
                tp = (TRAJECTORY_STEP, partition)
                floor[tp] = min(floor.get(tp, offset), offset)
        return floor


class Segmenter(Actor):
    role = "segmenter"
    consumes = (TRAJECTORY_STEP,)
    emits = (SEGMENT_CLOSED,)

    def __init__(self, config: SegmenterConfig, store_url: str, run_id: str):
        self.core = SegmenterCore(config)
        self.store = SegmentStore(store_url, durable=config.fsync)
        self.retention = Retention(self.store, config.retain_bytes)
        self.run_id = run_id
        self.segments = 0
        self._closed: list[ClosedSegment] = []
        self._oldest: float | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> Segmenter:
        store = cfg.segmenter.store or f"{cfg.run.run_dir}/segments.zarr"
        return cls(cfg.segmenter, store, cfg.run.run_id)

    async def on_start(self) -> None:
        async for record in iter_topics(self.runner.bus, [SEGMENT_CLOSED]):
            event = decode(SEGMENT_CLOSED, record.value, 1 << 40)
            if event.producer == self.runner.name:
                self.core.restore(event)

    async def handle(self, event, record):
        match event:
            case TrajectoryStep():
                self._closed += self.core.add(event, (record.partition, record.offset))
            case EnvError():
                self._closed += self.core.abort(event)
        return []

    async def after_batch(self):
        """Write every segment closed in this batch in one store transaction, then announce.

        One batched write (one fsync round) per input batch instead of one per segment:
        the store's per-write cost is dominated by syncing, not by bytes.
        """
        if not self._closed:
            return []
        loop = asyncio.get_running_loop()
        if self._oldest is None:
            self._oldest = loop.time()
        cfg = self.core.config
        if (len(self._closed) < cfg.write_batch_segments
                and loop.time() - self._oldest < cfg.write_delay_s):
            return []  # wait for more: their steps stay uncommitted (commit_floor)
        closed, self._closed, self._oldest = self._closed, [], None
        items = [(self._segment_id(seg), segment_arrays(seg)) for seg in closed]
        await self.retention.follow(self.runner.bus)  # what the learner is done with
        refs = await asyncio.to_thread(self._write, items)
        return [self._announce(seg, sid, ref) for seg, (sid, _), ref in zip(closed, items, refs)]

    def _write(self, items):
        with timing.timed("storage"):
            self.retention.make_room(incoming_bytes(items))
            return self.store.write_many(items)

    def _segment_id(self, seg: ClosedSegment) -> str:
        return event_id("segment", self.run_id, seg.trajectory_id, seg.steps[0].step_index,
                        seg.steps[-1].step_index + 1)

    def _announce(self, seg: ClosedSegment, segment_id: str, ref) -> Emit:
        first, last = seg.steps[0], seg.steps[-1]
        milestones = [m for s in seg.steps for m in s.milestones]
        milestone_steps = [s.step_index for s in seg.steps for _ in s.milestones]
        versions = [s.policy_version for s in seg.steps]
        self.segments += 1
        return Emit(SEGMENT_CLOSED, SegmentClosed(
            event_id=event_id("segment-closed", segment_id),
            run_id=self.run_id, producer=self.runner.name, key=seg.trajectory_id,
            segment_id=segment_id, trajectory_id=seg.trajectory_id, task_id=first.task_id,
            step_start=first.step_index, step_end=last.step_index + 1,
            boundary=seg.boundary,  # type: ignore[arg-type]
            address=ref.address, content_hash=ref.content_hash,
            min_policy_version=min(versions), max_policy_version=max(versions),
            trajectory_done=seg.boundary == "trajectory-end", success=last.success,
            milestones=milestones, milestone_steps=milestone_steps,
            feedback=[s.feedback for s in seg.steps],
            actions=[s.action_text for s in seg.steps],
            env_steps=sum(env_steps_of(s) for s in seg.steps),
        ))

    def commit_floor(self):
        floor = self.core.commit_floor()
        for seg in self._closed:  # closed but not yet written: still needed after a crash
            tp = (TRAJECTORY_STEP, seg.first_offset[0])
            floor[tp] = min(floor.get(tp, seg.first_offset[1]), seg.first_offset[1])
        return floor

    def stats(self):
        r = self.retention.stats
        return {"segments": float(self.segments), "open_segments": float(len(self.core.open)),
                "retention_deleted": float(r.deleted), "retention_over_bound": float(r.over_bound)}

    async def on_stop(self) -> None:
        await self.retention.close()
