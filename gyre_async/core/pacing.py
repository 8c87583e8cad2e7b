"""Where the segmenter will cut a trajectory, as the sampler sees it while acting.

The staleness gate paces steps by the sampler's open segments (``StalenessGate.may_step``
in ``gyre_async.rl.staleness``): a segment is as old as its first step, and it stays open
until its last. The sampler must therefore know whether its next step opens a segment and
whether it closes one, and, with segment contexts
(``policy.context = "segment"``), close each context exactly where its segment closes.
It does not keep a rule of its own for either: :class:`SegmentCursor` counts the open
segment's steps and asks the segmenter's rule
(:func:`gyre_async.core.segmenter.segment_boundary`) about each step, with the same fields
the step's event carries. A gap the segmenter cuts at (a step lost upstream) is invisible
here; the view is then off until the next boundary, which makes pacing less exact, never
the bound (the learner still refuses what is too old).
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre_async.core.segmenter import segment_boundary
from gyre_async.envs.base import StepResult
from schemas.config import SegmenterConfig
from schemas.events import BoundaryReason


@dataclass
class SegmentCursor:
    """One trajectory's open segment, as the segmenter will cut it."""

    config: SegmenterConfig
    length: int = 0  # steps in the open segment (0: the next step opens one)

    @property
    def opens_segment(self) -> bool:
        return self.length == 0

    def closes(self, result: StepResult, context_full: bool = False) -> BoundaryReason | None:
        """Where the segment would close if the next step answered ``result`` (nothing
        counted: the sampler asks this before it knows whether the context is full)."""
        return segment_boundary(self.config, self.length + 1, ended=result.over,
                                milestone=bool(result.milestones),
                                state_changed=result.state_changed, context_full=context_full)

    def after(self, result: StepResult, context_full: bool = False) -> BoundaryReason | None:
        """Count one step of the trajectory; the boundary it closes the segment at, if any."""
        boundary = self.closes(result, context_full)
        self.length = 0 if boundary is not None else self.length + 1
        return boundary
