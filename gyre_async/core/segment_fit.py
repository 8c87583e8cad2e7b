"""Closed segments cut to fit the bus: every announcement is a ``segment-closed`` event that
must not exceed the bus limit, and its size grows with the action texts it carries.

``segment-closed`` carries each step's action text (the guards and the process reward model
read them), up to ``MAX_TEXT_CHARS`` characters each, so a legitimate segment of 64 steps
with long actions weighs over 1 MB: more than the bus carries. Such a segment is split
into consecutive parts that each fit, cut where a length cut (``max-length``) would be:
a part is a contiguous run of steps, the learner bootstraps its value at the cut as at any
length cut, and only the last part keeps the original boundary (trajectory end, milestone,
failure). The cut depends only on the steps and the limit, so every segmenter of a run
cuts the same way (segment ids are deterministic from the step range).

A single step too large on its own cannot be split: it is announced as it is and the
runtime dead-letters the oversized output (``gyre_async.runtime.actor``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from gyre_async.core.segmenter import ClosedSegment
from schemas import encode
from schemas.events import SegmentClosed

#: ``part -> its announcement`` (with a placeholder address as long as a real one)
Announce = Callable[[ClosedSegment], SegmentClosed]


def fit_to_bus(seg: ClosedSegment, announce: Announce, max_bytes: int) -> list[ClosedSegment]:
    """``seg`` as consecutive parts whose announcements each fit in ``max_bytes`` (one part,
    ``seg`` itself, when it fits). Greedy: each part takes as many steps as fit."""
    if _size(announce, seg) <= max_bytes or len(seg.steps) == 1:
        return [seg]
    parts: list[ClosedSegment] = []
    start = 0
    while start < len(seg.steps):
        end = _longest_fitting(seg, start, announce, max_bytes)
        parts.append(_part(seg, start, end))
        start = end
    return parts


def _longest_fitting(seg: ClosedSegment, start: int, announce: Announce,
                     max_bytes: int) -> int:
    """The largest ``end`` such that steps ``[start, end)`` fit (at least one step), by
    bisection over measured sizes (an announcement grows with every step it takes)."""
    lo, hi = start + 1, len(seg.steps)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _size(announce, _part(seg, start, mid)) <= max_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _part(seg: ClosedSegment, start: int, end: int) -> ClosedSegment:
    last = end == len(seg.steps)
    if start == 0 and last:
        return seg
    steps = seg.steps[start:end]
    if last:  # keeps the segment's own boundary, outcome and failure
        return replace(seg, steps=steps)
    return replace(seg, steps=steps, boundary="max-length", terminal=False, failure="")


def _size(announce: Announce, part: ClosedSegment) -> int:
    return len(encode(announce(part)))
