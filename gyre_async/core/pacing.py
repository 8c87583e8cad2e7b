"""Where the segmenter will cut a trajectory, as the sampler sees it while acting.

The staleness gate paces the *opening* of segments (``StalenessGate.may_open_segment`` in
``gyre_async.rl.staleness``): a segment is as old as its first step, so whether it will
reach the learner within the bound is decided when that step is taken. The sampler must
therefore know whether its next step opens a segment. The segmenter's rule
(:meth:`gyre_async.core.segmenter.SegmenterCore.add`) depends only on the trajectory's own
steps: a segment opens at the first step and after any step that closed one (a milestone
reached with ``close_on_milestone``, a state change with ``close_on_state_change``,
``max_segment_steps`` steps, the trajectory's end), so the sampler follows the same rule on
the steps it makes. A gap the segmenter cuts at (a step lost upstream) is invisible here;
the view is then off until the next boundary, which makes pacing less exact, never the
bound (the learner still refuses what is too old).
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre_async.envs.base import StepResult
from schemas.config import SegmenterConfig


@dataclass
class SegmentCursor:
    """One trajectory's open segment, as the segmenter will cut it."""

    config: SegmenterConfig
    length: int = 0  # steps in the open segment (0: the next step opens one)

    @property
    def opens_segment(self) -> bool:
        return self.length == 0

    def after(self, result: StepResult) -> None:
        """Count one step of the trajectory, and close the segment where the segmenter will."""
        self.length += 1
        if (result.over
                or (result.milestones and self.config.close_on_milestone)
                or (result.state_changed and self.config.close_on_state_change)
                or self.length >= self.config.max_segment_steps):
            self.length = 0
