"""The segmenter's core: trajectory steps in, closed training segments out (no bus, no I/O).

A segment closes when a milestone is reached (a sub-task completed), optionally when the
environment signals a significant state change, at ``max_segment_steps``, and when the
trajectory ends. :func:`segment_arrays` gives the arrays the learner trains on and
:func:`segment_closed` the event that announces them once they are stored.

Crash safety is expressed as a commit floor: open segments, and closed segments not yet
written (:class:`PendingWrites`), live only in memory, so the runtime must never commit past
the oldest step they hold. After a restart :meth:`SegmenterCore.restore` folds the
segmenter's own ``segment-closed`` log back in, so redelivered steps of already-closed
segments are skipped and nothing is segmented twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from gyre_async.core.segment_context import continues, resolve_step
from gyre_async.envs.macros import env_steps_of
from gyre_async.storage.segments import SegmentRef
from schemas import event_id
from schemas.config import SegmenterConfig
from schemas.events import (
    BoundaryReason,
    EnvError,
    EpisodeFailure,
    SegmentClosed,
    TrajectoryStep,
    failure_of,
)
from schemas.topics import TRAJECTORY_STEP

#: (topic, partition) -> the lowest offset still needed after a crash
CommitFloor = dict[tuple[str, int], int]


@dataclass
class OpenSegment:
    steps: list[TrajectoryStep] = field(default_factory=list)
    offsets: list[tuple[int, int]] = field(default_factory=list)  # (partition, offset)


@dataclass(frozen=True)
class ClosedSegment:
    trajectory_id: str
    steps: tuple[TrajectoryStep, ...]
    boundary: BoundaryReason
    terminal: bool  # the trajectory ended with a real outcome (no value bootstrap)
    first_offset: tuple[int, int] = (0, -1)  # (partition, offset) of its first step
    failure: EpisodeFailure = ""  # closed by a failure (see abort): the episode has no outcome


def pad(rows: list[list[int]], width: int, dtype=np.int32) -> tuple[np.ndarray, np.ndarray]:
    out = np.zeros((len(rows), max(width, 1)), dtype=dtype)
    lengths = np.zeros(len(rows), dtype=np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
        lengths[i] = len(row)
    return out, lengths


def segment_arrays(seg: ClosedSegment) -> dict[str, np.ndarray]:
    """The arrays the learner trains on, one row per step.

    Two layouts of the contexts. When each step's context is the previous one's context and
    action followed by more (segment contexts), the segment is **one sequence**:
    ``sequence_tokens`` [1, L] holds every context and action once, ``context_len`` [n]
    where each step's action starts in it; the store then holds O(L) tokens, not O(n L),
    and the learner reads the segment in one pass. Otherwise (window contexts) one row per
    step: ``context_tokens`` [n, width] and ``context_len``. :func:`segment_contexts`
    gives each step's context back from either."""
    steps = seg.steps
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
    if len(steps) > 1 and all(continues(a, b) for a, b in zip(steps, steps[1:])):
        sequence = [*last.context_tokens, *last.action_tokens]
        contexts = {"sequence_tokens": np.array([sequence], dtype=np.int32),
                    "sequence_len": np.array([len(sequence)], dtype=np.int32),
                    "context_len": np.array([len(s.context_tokens) for s in steps],
                                            dtype=np.int32)}
    else:
        ctx, ctx_len = pad([s.context_tokens for s in steps],
                           max(len(s.context_tokens) for s in steps))
        contexts = {"context_tokens": ctx, "context_len": ctx_len}
    return {
        **contexts, "action_tokens": act,
        "action_logprobs": logp, "action_mask": mask,
        "policy_version": np.array([s.policy_version for s in steps], dtype=np.int32),
        "feedback": np.array([s.feedback for s in steps], dtype=np.float32),
        "step_index": np.array([s.step_index for s in steps], dtype=np.int64),
        "bootstrap_context": boot_arr,
        "bootstrap_len": np.array([len(boot)], dtype=np.int32),
        "terminal": np.array([1 if seg.terminal else 0], dtype=np.uint8),
    }


def segment_sequence(arrays: Mapping[str, np.ndarray]) -> list[int] | None:
    """A one-sequence segment's tokens (every context and action once); None: the segment
    keeps one context per step (see :func:`segment_arrays`)."""
    if "sequence_tokens" not in arrays:
        return None
    return arrays["sequence_tokens"][0, : int(arrays["sequence_len"][0])].tolist()


def segment_contexts(arrays: Mapping[str, np.ndarray]) -> list[list[int]]:
    """Each step's context, from either layout of :func:`segment_arrays`."""
    lengths = [int(n) for n in arrays["context_len"]]
    sequence = segment_sequence(arrays)
    if sequence is not None:
        return [sequence[:n] for n in lengths]
    tokens = arrays["context_tokens"]
    return [tokens[i, :n].tolist() for i, n in enumerate(lengths)]


def segment_id(run_id: str, seg: ClosedSegment) -> str:
    """Deterministic: the same steps of the same trajectory always get the same id."""
    return event_id("segment", run_id, seg.trajectory_id, seg.steps[0].step_index,
                    seg.steps[-1].step_index + 1)


def segment_closed(seg: ClosedSegment, segment_id: str, ref: SegmentRef, *, run_id: str,
                   producer: str) -> SegmentClosed:
    """The announcement of a stored segment (only ever made after the write)."""
    first, last = seg.steps[0], seg.steps[-1]
    versions = [s.policy_version for s in seg.steps]
    return SegmentClosed(
        event_id=event_id("segment-closed", segment_id),
        run_id=run_id, producer=producer, key=seg.trajectory_id,
        segment_id=segment_id, trajectory_id=seg.trajectory_id, task_id=first.task_id,
        step_start=first.step_index, step_end=last.step_index + 1, boundary=seg.boundary,
        address=ref.address, content_hash=ref.content_hash,
        min_policy_version=min(versions), max_policy_version=max(versions),
        trajectory_done=seg.boundary == "trajectory-end", success=last.success,
        lost=seg.boundary == "trajectory-end" and last.done and not last.success,
        milestones=[m for s in seg.steps for m in s.milestones],
        milestone_steps=[s.step_index for s in seg.steps for _ in s.milestones],
        feedback=[s.feedback for s in seg.steps],
        actions=[s.action_text for s in seg.steps],
        env_steps=sum(env_steps_of(s) for s in seg.steps),
        failure=seg.failure,
    )


def segment_boundary(config: SegmenterConfig, length: int, *, ended: bool, milestone: bool,
                     state_changed: bool, context_full: bool = False) -> BoundaryReason | None:
    """Where a trajectory's segments close: THE rule, asked by everyone who needs it.

    ``length`` counts the steps of the open segment, the step in question included; the
    flags are that step's (``ended``: done or truncated; ``context_full``: its next
    segment context would pass the policy's token budget). A segment closes when the
    trajectory ends, at a milestone (``close_on_milestone``) once the segment holds
    ``milestone_min_steps`` steps, at a significant state change
    (``close_on_state_change``), at ``max_segment_steps`` steps, or when its context is
    full; None: it stays open. :meth:`SegmenterCore.add` cuts with it, and the sampler asks
    it while acting (:class:`~gyre_async.core.pacing.SegmentCursor`): where its segment
    contexts restart and how it paces the opening of segments. Both see the same fields
    of the same steps, so they cut at the same places (a gap in the steps, which only the
    segmenter sees, is the one exception; see :meth:`SegmenterCore.add`)."""
    if ended:
        return "trajectory-end"
    if milestone and config.close_on_milestone and length >= config.milestone_min_steps:
        return "milestone"
    if state_changed and config.close_on_state_change:
        return "state-change"
    if length >= config.max_segment_steps or context_full:
        return "max-length"
    return None


def _lower(floor: CommitFloor, partition: int, offset: int) -> None:
    where = (TRAJECTORY_STEP, partition)
    floor[where] = min(floor.get(where, offset), offset)


class OutOfOrderStep(ValueError):
    """A trajectory step that arrived out of its trajectory's order (after a gap was cut
    around it, after the trajectory's end, or a second event for a step already held): not
    a redelivery, never segmented; the segmenter dead-letters it with this reason. The
    sampler publishes a trajectory's steps in order, on one partition (its key)."""


class SegmenterCore:
    """Pure segmentation logic: steps in, closed segments out (no bus, no storage)."""

    def __init__(self, config: SegmenterConfig):
        self.config = config
        self.open: dict[str, OpenSegment] = {}
        self.next_step: dict[str, int] = {}  # first step index not yet in a closed segment
        self.ended: set[str] = set()
        #: per trajectory, the step ranges ``[start, end)`` a segment was cut before because
        #: they never came (see :meth:`add`): a step of one arriving later is out of order
        self.gaps: dict[str, list[tuple[int, int]]] = {}
        #: the input partition of each trajectory this core took steps of (a trajectory's
        #: steps share one partition, its key): what ``release`` forgets
        self.partition_of: dict[str, int] = {}

    def restore(self, closed: SegmentClosed) -> None:
        """Fold one closed segment of the run back into state: on a restart, and when a
        partition comes from another segmenter of the run (scale-out), so that steps it
        already segmented are skipped. Idempotent."""
        self.next_step[closed.trajectory_id] = max(
            self.next_step.get(closed.trajectory_id, 0), closed.step_end
        )
        if closed.boundary == "trajectory-end":
            self.ended.add(closed.trajectory_id)

    def add(self, step: TrajectoryStep, where: tuple[int, int]) -> list[ClosedSegment]:
        """Take one step; the segments it closes. A segment-context step is kept with its
        whole context (:func:`~gyre_async.core.segment_context.resolve_step`, against the
        step before it in the open segment); one that does not resolve raises
        :class:`~gyre_async.core.segment_context.UnresolvedContext` before anything changes
        (the actor dead-letters it)."""
        tid = step.trajectory_id
        if self._seen_before(step):
            return []  # already segmented (redelivery after a restart), or this step again
        seg = self.open.get(tid)
        held = seg is not None and bool(seg.steps)
        expected = seg.steps[-1].step_index + 1 if seg and seg.steps \
            else self.next_step.get(tid, 0)
        gap = step.step_index != expected
        step = resolve_step(step, seg.steps[-1] if seg and seg.steps and not gap else None)
        self.partition_of[tid] = where[0]
        closed: list[ClosedSegment] = []
        if gap:
            # Steps lost upstream (e.g. dead-lettered): remembered, so that one of them
            # coming later is refused as out of order, not skipped as segmented already.
            self.gaps.setdefault(tid, []).append((expected, step.step_index))
        if gap and held:
            # A segment covers contiguous steps only: cut before the gap, start at this step.
            closed.append(self._close(tid, "max-length", terminal=False))
        seg = self.open.setdefault(tid, OpenSegment())
        seg.steps.append(step)
        seg.offsets.append(where)
        boundary = segment_boundary(self.config, len(seg.steps),
                                    ended=step.done or step.truncated,
                                    milestone=bool(step.milestones),
                                    state_changed=step.state_changed,
                                    context_full=step.context_full)
        if boundary is None:
            return closed
        # a capped episode is lost when the cap is the task's
        terminal = boundary == "trajectory-end" and (step.done or self.config.cap_ends_episode)
        return [*closed, self._close(tid, boundary, terminal=terminal)]

    def _seen_before(self, step: TrajectoryStep) -> bool:
        """True: ``step`` is one this core has segmented or holds already (a redelivery:
        skip it). Raises :class:`OutOfOrderStep` for a step that cannot be a redelivery,
        since a trajectory's steps reach the segmenter in order on one partition: one of
        a gap already cut around, one after the trajectory's end, or another event for a
        step index the open segment holds. Nothing changes before it raises (the actor
        dead-letters the step), and steps that belong are never skipped silently."""
        tid, index = step.trajectory_id, step.step_index
        done = self.next_step.get(tid, 0)
        if index < done:
            for start, end in self.gaps.get(tid, ()):
                if start <= index < end:
                    raise OutOfOrderStep(f"step {index} of trajectory {tid!r} came after the "
                                         f"segment cut before its gap [{start}, {end})")
            return True
        if tid in self.ended:
            last = f"its last step was {done - 1}" if done else "an env-error ended it"
            raise OutOfOrderStep(f"step {index} of trajectory {tid!r} came after its end "
                                 f"({last})")
        seg = self.open.get(tid)
        if seg is None or not seg.steps or index > seg.steps[-1].step_index:
            return False
        held = next((s for s in seg.steps if s.step_index == index), None)
        if held is not None and held.event_id == step.event_id:
            return True
        raise OutOfOrderStep(
            f"step {index} of trajectory {tid!r} came after step {seg.steps[-1].step_index}"
            + (f" under another event id than the one held ({held.event_id})" if held else ""))

    def abort(self, error: EnvError) -> list[ClosedSegment]:
        """An environment failure ends the trajectory: close what is open, as truncated
        (not terminal: the learner bootstraps its value) and marked with the failure's
        kind, so the learner keeps the episode out of its group's outcome baseline.

        Nothing open (the failure came right after a segment closed, or at reset): no
        segment carries the mark; the episode's earlier segments were trained, if at all,
        before its end was known, so they never had an outcome advantage to mask."""
        tid = error.trajectory_id
        seg = self.open.get(tid)
        self.ended.add(tid)
        if seg is None or not seg.steps:
            self.open.pop(tid, None)
            return []
        closed = self._close(tid, "trajectory-end", terminal=False)
        return [replace(closed, failure=failure_of(error))]

    def cut_all(self) -> list[ClosedSegment]:
        """Close every open segment where it stands, as a length cut (``max-length``: not
        an end, so the learner bootstraps its value), for the end of a run: no more steps
        will come this run, and nothing should stay only in memory. A later sampler ends
        those trajectories with an ``env-error`` (nothing left open to close then)."""
        return [self._close(tid, "max-length", terminal=False)
                for tid in [tid for tid, seg in self.open.items() if seg.steps]]

    def _close(self, tid: str, boundary: BoundaryReason, terminal: bool) -> ClosedSegment:
        seg = self.open.pop(tid)
        self.next_step[tid] = seg.steps[-1].step_index + 1
        if boundary == "trajectory-end":
            self.ended.add(tid)
        return ClosedSegment(tid, tuple(seg.steps), boundary, terminal, seg.offsets[0])

    def release(self, partitions: set[int]) -> int:
        """Forget everything derived from ``partitions`` (now another segmenter's: it reads
        them again from our commit floor and closes them itself): their open segments, and
        how far their trajectories were segmented (``next_step``, ``ended``).

        The second half matters as much as the first: ``next_step`` also counts segments
        closed but not yet written (:class:`PendingWrites`, released with the partition). If
        it survived and the partition came back before the other member wrote those
        segments, their redelivered steps would be skipped as already segmented, and the
        commit floor would no longer hold them: lost. What was durably written comes back
        with the partition (the actor folds the run's ``segment-closed`` log on every
        assignment). Returns how many open segments were dropped."""
        gone = [tid for tid, seg in self.open.items()
                if seg.offsets and seg.offsets[0][0] in partitions]
        for tid in gone:
            del self.open[tid]
        for tid in [tid for tid, p in self.partition_of.items() if p in partitions]:
            self.next_step.pop(tid, None)
            self.ended.discard(tid)
            self.gaps.pop(tid, None)
            del self.partition_of[tid]
        return len(gone)

    def commit_floor(self) -> CommitFloor:
        floor: CommitFloor = {}
        for seg in self.open.values():
            for partition, offset in seg.offsets[:1]:
                _lower(floor, partition, offset)
        return floor


class PendingWrites:
    """Closed segments waiting to be written together, in one store transaction.

    One batched write (one fsync round) for several segments instead of one per segment:
    the store's per-write cost is dominated by syncing, not by bytes. A batch is due once
    it holds ``write_batch_segments`` segments or its oldest has waited ``write_delay_s``
    (``now`` is any monotonic clock, in seconds).
    """

    def __init__(self, config: SegmenterConfig):
        self.config = config
        self.segments: list[ClosedSegment] = []
        self._oldest: float | None = None

    def extend(self, closed: list[ClosedSegment]) -> None:
        self.segments += closed

    def take_due(self, now: float) -> list[ClosedSegment]:
        if not self.segments:
            return []
        if self._oldest is None:
            self._oldest = now
        if (len(self.segments) < self.config.write_batch_segments
                and now - self._oldest < self.config.write_delay_s):
            return []  # wait for more: their steps stay uncommitted (commit_floor)
        due, self.segments, self._oldest = self.segments, [], None
        return due

    def release(self, partitions: set[int]) -> int:
        """Drop the closed-but-unwritten segments from ``partitions`` (see
        :meth:`SegmenterCore.release`); their new owner writes them."""
        kept = [seg for seg in self.segments if seg.first_offset[0] not in partitions]
        dropped = len(self.segments) - len(kept)
        self.segments = kept
        if not kept:
            self._oldest = None
        return dropped

    def hold(self, floor: CommitFloor) -> CommitFloor:
        """``floor`` lowered to the first step of every segment not yet written (a crash
        before the write must get those steps again)."""
        for seg in self.segments:
            _lower(floor, *seg.first_offset)
        return floor
