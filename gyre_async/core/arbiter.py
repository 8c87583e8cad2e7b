"""The arbiter's core: per-trajectory reward state, folded from its own verdicts (no bus).

The state is what pay-once and the farming guard need across segments of a trajectory,
plus the idempotency record and the drift monitor's schedule and weight:

- ``paid``: milestones already paid, per open trajectory;
- ``farm``: the farming guard's memory, per open trajectory (carried in each ``scored``);
- ``handled``: segment ids with a verdict (``scored`` or ``reward-failed``) in our log: a
  redelivered segment is never scored, so never paid, twice;
- the drift monitor's weight in force (the latest ``drift-report``) and its schedule (the
  count of handled segments).

One idiom serves a restart and live work (event sourcing): :meth:`ArbiterCore.apply` folds
one of our own output events. A restart applies every recorded ``scored`` (and, with a
reference set, ``drift-report``) event of ours; live, :meth:`ArbiterCore.handle` scores
a segment and applies each output before returning it. Verdicts of the run's other arbiters
(scale-out: the replicas split ``segment-closed``'s partitions, a trajectory's segments
share one) are folded alike, so a partition that moves from one arbiter to another keeps
its pay-once record and is never scored twice; drift reports are each arbiter's own (its
schedule counts what it handled). The caller keeps other runs' events out. Precedence and
the failure policy are :mod:`gyre_async.rewards.arbitration`'s.

Outputs are measured before they are applied: one larger than ``max_event_bytes`` (the
bus limit) raises :class:`~gyre_async.errors.OutputTooLarge` with the state untouched, so
the runtime dead-letters the segment and the live state stays the fold of the log.
"""

from __future__ import annotations

from gyre_async.errors import OutputTooLarge
from gyre_async.rewards.arbitration import Arbitration
from gyre_async.rewards.drift import DriftWatch
from gyre_async.rewards.guards import NEW_TRAJECTORY, FarmState
from schemas import Event, encode
from schemas.codec import MAX_EVENT_BYTES
from schemas.config import ArbiterConfig
from schemas.events import DriftReport, RewardFailed, Scored, SegmentClosed


class ArbiterCore:
    """Scores segments; its state is the fold of its own verdicts and drift reports."""

    def __init__(self, config: ArbiterConfig, producer: str = "arbiter",
                 max_event_bytes: int = MAX_EVENT_BYTES):
        self.config, self.producer = config, producer
        self.max_event_bytes = max_event_bytes  # the bus limit (the actor sets its bus's)
        self.arbitration = Arbitration(config)  # builds rules now: bad config fails at start
        self.drift = DriftWatch(config, self.arbitration.prm)
        self.paid: dict[str, set[str]] = {}
        self.farm: dict[str, FarmState] = {}
        self.handled: set[str] = set()
        self.scored = 0
        self.failed = 0  # segments withheld (one or more components failed)

    def apply(self, event: Event) -> None:
        """Fold one verdict of the run, or one of our drift reports, into the state (a
        restart, a partition taken over and live work alike). Idempotent."""
        match event:
            case Scored() | RewardFailed():
                if event.segment_id in self.handled:
                    return  # a redelivered copy, or the segment's next failed component
                self.handled.add(event.segment_id)
                if isinstance(event, Scored):
                    self.scored += 1
                else:
                    self.failed += 1
                if event.trajectory_done:  # the trajectory ended (scored or withheld)
                    self.paid.pop(event.trajectory_id, None)
                    self.farm.pop(event.trajectory_id, None)
                elif isinstance(event, Scored):  # one trajectory's events are in order
                    self.paid.setdefault(event.trajectory_id, set()).update(
                        event.paid_milestones)
                    self.farm[event.trajectory_id] = FarmState.decode(event.guard_state)
            case DriftReport() if event.producer == self.producer:
                self.drift.apply(event)

    @property
    def watches_drift(self) -> bool:
        """Whether drift reports are made (and so must be folded on a restart)."""
        return self.drift.reference is not None

    def stats(self) -> dict[str, float]:
        return {"scored": float(self.scored), "reward_failed": float(self.failed),
                "prm_weight": float(self.drift.weight)}

    def handle(self, segment: SegmentClosed) -> list[Event]:
        """Live: the segment's outputs (a drift report first when a check is due, then its
        ``scored`` or ``reward-failed`` events), each applied before it is returned; all
        measured first (:class:`OutputTooLarge`: nothing applied, nothing returned)."""
        if segment.segment_id in self.handled:
            return []  # redelivered: its verdict is already in our log
        report = self.drift.check(segment.run_id, self.producer, len(self.handled))
        verdict = self.arbitration.score(
            segment, self.paid.get(segment.trajectory_id, set()), self.producer,
            prm_weight=self.drift.weight if report is None else report.weight,
            farm_state=self.farm.get(segment.trajectory_id, NEW_TRAJECTORY))
        out: list[Event] = [] if report is None else [report]
        out += [verdict.scored] if verdict.scored is not None else verdict.failed
        for event in out:
            size = len(encode(event))
            if size > self.max_event_bytes:
                raise OutputTooLarge(f"{type(event).__name__} of segment "
                                     f"{segment.segment_id}", size, self.max_event_bytes)
        for event in out:
            self.apply(event)
        return out
