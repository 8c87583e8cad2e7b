"""Arbiter: turns a closed segment into rewards, with explicit precedence.

consumes: segment-closed (SegmentClosed)
emits:    scored (Scored, or RewardFailed when a component fails),
          telemetry (DriftReport: the process reward model re-checked on reference judgments)
reads:    scored, telemetry (every verdict and drift report of the run: a fold, on each
          assignment of segment-closed partitions)

Levels, highest first (the first that applies "decides" the segment's verdict):
``guard`` (farming, unproven milestone claims, pluggable safety rules: they veto) >
``outcome`` > ``milestone`` (paid once per trajectory, only with state proof) > ``rule``
(configured checks) > ``prm`` (process reward model) > ``none``. The pure core, with the
exact definitions and the failure policy, is :mod:`gyre_async.rewards.arbitration`.

A component that fails emits ``reward-failed`` (one per component, with the reason) and
the segment gets no ``scored`` event: it is withheld, never paid with a zero in place of
the failed part. The state (pay-once, the farming guard's memory, the segments already
handled, the drift monitor's schedule and the process model's weight in force) is the
fold of the run's ``scored`` events and our ``drift-report`` events
(:mod:`gyre_async.core.arbiter`): whenever partitions come to this arbiter (its start, or
another replica of ``gyre launch --replicas arbiter=N`` leaving) they are read back and
applied, live each output is applied as it is made, so a redelivered or handed-over
segment is never scored, and never paid, twice.

Bad input is refused, never kept: a segment longer than the run's
``segmenter.max_segment_steps`` (or than any segment may be, at decode), or whose verdict
would not fit on the bus (:class:`~gyre_async.errors.OutputTooLarge`, raised before the
state changes), goes to ``dead-letter`` with the reason, and the arbiter scores on.
So does a segment whose address is not in the run's segment stores
(:mod:`gyre_async.storage.roots`): it is never passed on to the learner.
"""

from __future__ import annotations

from gyre_async.core.arbiter import ArbiterCore
from gyre_async.folds.restart import Verdicts
from gyre_async.runtime.actor import Actor, Emit
from gyre_async.storage.roots import StorageRoots
from schemas.config import ArbiterConfig, Config
from schemas.events import DriftReport, SegmentClosed
from schemas.topics import SCORED, SEGMENT_CLOSED, TELEMETRY


class Arbiter(Actor):
    role = "arbiter"
    consumes = (SEGMENT_CLOSED,)
    emits = (SCORED, TELEMETRY)
    reads = (SCORED, TELEMETRY)  # every verdict (and drift report) of the run, a fold

    def __init__(self, config: ArbiterConfig, max_segment_steps: int | None = None):
        self.config = config
        self.core = ArbiterCore(config)  # builds rules now: bad config fails at start
        #: the run's segmenter never closes a longer segment: a longer one is refused
        self.max_segment_steps = max_segment_steps
        #: the run's segment stores: an address elsewhere is refused (from_config sets it)
        self.roots: StorageRoots | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> Arbiter:
        arbiter = cls(cfg.arbiter, cfg.segmenter.max_segment_steps)
        arbiter.roots = StorageRoots.from_config(cfg)
        return arbiter

    async def on_start(self) -> None:
        self.core.producer = self.runner.name  # our outputs, and our drift reports, carry it
        self.core.max_event_bytes = self.runner.bus.max_message_bytes

    def folds(self):
        """Every verdict of this run so far, on every assignment of segment partitions."""
        return (Verdicts(self.core.apply, self.core.watches_drift),)

    async def handle(self, event, record):
        match event:
            case SegmentClosed():
                if self.roots is not None:
                    self.roots.segment(event.address)  # UntrustedAddress: dead-lettered
                steps = event.step_end - event.step_start
                if self.max_segment_steps is not None and steps > self.max_segment_steps:
                    raise ValueError(f"segment of {steps} steps, longer than this run's "
                                     f"segmenter.max_segment_steps ({self.max_segment_steps})")
                return [Emit(TELEMETRY if isinstance(e, DriftReport) else SCORED, e)
                        for e in self.core.handle(event)]
        return []

    def stats(self):
        return self.core.stats()
