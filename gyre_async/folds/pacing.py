"""How much sampled work the staleness bound threw away: ``stale_dropped_fraction``.

Env steps in segments the learner refused as too stale (``segment-dropped`` with reason
``stale``), over every env step sampled. The pacing of the sampler's staleness gate
(``gyre_async.rl.staleness``) is meant to keep it near zero without slowing learning; the
bound itself stays hard, so a drop is the visible price of a segment that arrived too late.
Env steps are primitive steps (a macro call counts its primitives), as ``env_steps`` in
``summary.json``; a dropped segment's length is read from its ``segment-closed`` event
(``steps`` on the drop event where that is missing). Pure: ``gyre run`` feeds it its run
fold, ``ops/chaos.py`` the audited log.
"""

from __future__ import annotations

from collections.abc import Iterable

from schemas.events import SegmentClosed, SegmentDropped

STALE = "stale"


def stale_dropped_steps(dropped: Iterable[SegmentDropped],
                        segments: Iterable[SegmentClosed]) -> int:
    """Env steps of the distinct segments dropped as stale."""
    length = {s.segment_id: s.env_steps or (s.step_end - s.step_start) for s in segments}
    stale = {d.segment_id: d.steps for d in dropped if d.reason == STALE}
    return sum(length.get(sid, steps) for sid, steps in stale.items())


def stale_dropped_fraction(dropped: Iterable[SegmentDropped], segments: Iterable[SegmentClosed],
                           sampled_env_steps: int) -> float | None:
    """Stale-dropped env steps / sampled env steps (None before any step), 4 decimals."""
    if sampled_env_steps <= 0:
        return None
    return round(stale_dropped_steps(dropped, segments) / sampled_env_steps, 4)
