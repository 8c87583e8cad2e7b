"""The restart folds of the roles whose state lives in a core: each feeds a core's own
``restore``/``apply`` (or collects for one built later), so the runner restores them like
any other fold (:mod:`gyre_async.folds.fold`)."""

from __future__ import annotations

from collections.abc import Callable

from gyre_async.folds.fold import FoldBase
from schemas import Event
from schemas.events import KeptCheckpoint, PolicyVersion, Rollback, SegmentClosed
from schemas.topics import (
    EVAL,
    KEEPER,
    POLICY_VERSION,
    SCORED,
    SEGMENT_CLOSED,
    TELEMETRY,
    TRAJECTORY_STEP,
)


class ClosedSegments(FoldBase):
    """Every segment the run closed so far, by any of its segmenters (restored on every
    assignment of ``trajectory-step`` partitions: another member may have closed some)."""

    topics = (SEGMENT_CLOSED,)
    restore_on = (TRAJECTORY_STEP,)

    def __init__(self, to: Callable[[SegmentClosed], None]):
        self.to = to

    def accepts(self, event: Event) -> bool:
        return isinstance(event, SegmentClosed)

    def apply(self, event: Event) -> None:
        assert isinstance(event, SegmentClosed)
        self.to(event)


class Verdicts(FoldBase):
    """Every verdict of the run so far (any of its arbiters), and with ``drift`` their drift
    reports (``telemetry`` is mostly heartbeats: read only when reports can be there);
    restored on every assignment of ``segment-closed`` partitions."""

    restore_on = (SEGMENT_CLOSED,)

    def __init__(self, to: Callable[[Event], None], drift: bool):
        self.to = to
        self.topics = (SCORED, TELEMETRY) if drift else (SCORED,)

    def apply(self, event: Event) -> None:
        self.to(event)


class OwnSteps(FoldBase):
    """A sampler's earlier steps in the run: its producer is the name, its trajectory ids
    start with ``<name>-`` (``sampler`` is also a prefix of ``sampler-2``'s ids)."""

    topics = (TRAJECTORY_STEP,)

    def __init__(self, name: str, to: Callable[[Event], None]):
        self.name = name
        self.to = to

    def accepts(self, event: Event) -> bool:
        return event.producer == self.name and event.key.startswith(f"{self.name}-")

    def apply(self, event: Event) -> None:
        self.to(event)


class KeeperHistory(FoldBase):
    """What the keeper decides from: versions, evaluations and its own orders, in log order,
    kept until its core exists (it needs probe contexts built at start). Announcements
    ``trusted`` refuses are counted, not kept (their live consumers dead-letter them)."""

    topics = (KEEPER, POLICY_VERSION, EVAL)

    def __init__(self, trusted: Callable[[PolicyVersion | KeptCheckpoint | Rollback], bool]):
        self.trusted = trusted
        self.events: list[Event] = []
        self.untrusted = 0

    def accepts(self, event: Event) -> bool:
        if isinstance(event, PolicyVersion | KeptCheckpoint | Rollback) \
                and not self.trusted(event):
            self.untrusted += 1
            return False
        return True

    def apply(self, event: Event) -> None:
        self.events.append(event)
