"""Arbiter: turns a closed segment into rewards, with explicit precedence.

consumes: segment-closed (SegmentClosed)
emits:    scored (Scored, or RewardFailed when a component fails),
          telemetry (DriftReport: the process reward model re-checked on reference judgments)

Levels, highest first (the first that applies "decides" the segment's verdict):
``guard`` (farming, unproven milestone claims, pluggable safety rules: they veto) >
``outcome`` > ``milestone`` (paid once per trajectory, only with state proof) > ``rule``
(configured checks) > ``prm`` (process reward model) > ``none``. The pure core, with the
exact definitions and the failure policy, is :mod:`gyre_async.rewards.arbitration`.

A component that fails emits ``reward-failed`` (one per component, with the reason) and
the segment gets no ``scored`` event: it is withheld, never paid with a zero in place of
the failed part. Pay-once and farming-guard state is rebuilt on restart from our own
``scored`` log, and a segment already in that log is not scored again, so a redelivered
segment is never paid twice; the drift monitor's schedule and the process
model's weight in force are rebuilt from our ``scored`` and ``drift-report`` events
(:mod:`gyre_async.rewards.drift`).
"""

from __future__ import annotations

from gyre_async.runtime.actor import Actor, Emit
from gyre_async.bus.reading import iter_topics
from gyre_async.rewards.arbitration import Arbitration
from gyre_async.rewards.drift import DriftWatch
from gyre_async.rewards.guards import NEW_TRAJECTORY, FarmState
from schemas import decode
from schemas.config import ArbiterConfig, Config
from schemas.events import DriftReport, Scored, SegmentClosed
from schemas.topics import SCORED, SEGMENT_CLOSED, TELEMETRY


class Arbiter(Actor):
    role = "arbiter"
    consumes = (SEGMENT_CLOSED,)
    emits = (SCORED, TELEMETRY)

    def __init__(self, config: ArbiterConfig):
        self.config = config
        self.arbitration = Arbitration(config)  # builds rules now: bad config fails at start
        self.drift = DriftWatch(config, self.arbitration.prm)
        self.paid: dict[str, set[str]] = {}
        self.farm: dict[str, FarmState] = {}  # the farming guard's memory per trajectory
        self.handled_before_start: set[str] = set()  # segment ids already in our log
        self.scored = 0
        self.failed = 0

    @classmethod
    def from_config(cls, cfg: Config) -> Arbiter:
        return cls(cfg.arbiter)

    async def on_start(self) -> None:
        handled: set[str] = set()
        async for record in iter_topics(self.runner.bus, [SCORED]):
            event = decode(SCORED, record.value, 1 << 40)
            if event.producer != self.runner.name:
                continue
            handled.add(event.segment_id)
            if event.trajectory_done:  # the trajectory ended (scored or withheld)
                self.paid.pop(event.trajectory_id, None)
                self.farm.pop(event.trajectory_id, None)
            elif isinstance(event, Scored):  # one trajectory's events are in order
                self.paid.setdefault(event.trajectory_id, set()).update(event.paid_milestones)
                self.farm[event.trajectory_id] = FarmState.decode(event.guard_state)
        last = None
        if self.drift.reference is not None:
            async for record in iter_topics(self.runner.bus, [TELEMETRY]):
                event = decode(TELEMETRY, record.value, 1 << 40)
                if isinstance(event, DriftReport) and event.producer == self.runner.name and \
                        (last is None or event.segments_scored >= last.segments_scored):
                    last = event
        self.drift.restore(len(handled), last)
        self.handled_before_start = handled

    async def handle(self, event, record):
        match event:
            case SegmentClosed() if event.segment_id in self.handled_before_start:
                return []  # redelivered after a restart: its verdict is already on the bus
            case SegmentClosed():
                out = []
                report = self.drift.before_segment(event.run_id, self.runner.name)
                if report is not None:
                    out.append(Emit(TELEMETRY, report))
                paid = self.paid.setdefault(event.trajectory_id, set())
                verdict = self.arbitration.score(
                    event, paid, self.runner.name, prm_weight=self.drift.weight,
                    farm_state=self.farm.get(event.trajectory_id, NEW_TRAJECTORY))
                if event.trajectory_done:
                    self.paid.pop(event.trajectory_id, None)
                    self.farm.pop(event.trajectory_id, None)
                if verdict.scored is None:
                    self.failed += 1
                    return out + [Emit(SCORED, f) for f in verdict.failed]
                paid.update(verdict.scored.paid_milestones)
                if not event.trajectory_done:
                    self.farm[event.trajectory_id] = FarmState.decode(verdict.scored.guard_state)
                self.scored += 1
                return out + [Emit(SCORED, verdict.scored)]
        return []

    def stats(self):
        return {"scored": float(self.scored), "reward_failed": float(self.failed),
                "prm_weight": float(self.drift.weight)}
