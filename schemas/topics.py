"""Topics and the union of events each one carries (one union per topic)."""

from __future__ import annotations

from .events import (
    CheckpointFault,
    CriticReset,
    DeadLetter,
    DriftReport,
    EnvError,
    EvalRequest,
    EvalResult,
    Heartbeat,
    KeptCheckpoint,
    PolicyVersion,
    Probe,
    RewardFailed,
    Rollback,
    Scored,
    SegmentClosed,
    SegmentDropped,
    TrajectoryStep,
)

TRAJECTORY_STEP = "trajectory-step"
SEGMENT_CLOSED = "segment-closed"
SCORED = "scored"
POLICY_VERSION = "policy-version"
EVAL = "eval"
EVAL_REQUEST = "eval-request"
TELEMETRY = "telemetry"
DEAD_LETTER = "dead-letter"
PROBE_IN = "probe-in"
PROBE_OUT = "probe-out"
KEEPER = "keeper"

#: topic -> the union of event types it carries. Adding a topic here is all a new topic needs.
TOPIC_UNIONS: dict[str, object] = {
    TRAJECTORY_STEP: TrajectoryStep | EnvError,
    SEGMENT_CLOSED: SegmentClosed,
    SCORED: Scored | RewardFailed,
    POLICY_VERSION: PolicyVersion,
    EVAL: EvalResult,
    EVAL_REQUEST: EvalRequest,
    TELEMETRY: Heartbeat | SegmentDropped | CriticReset | DriftReport,
    DEAD_LETTER: DeadLetter,
    PROBE_IN: Probe,
    PROBE_OUT: Probe,
    KEEPER: KeptCheckpoint | Rollback | CheckpointFault,
}

ALL_TOPICS: tuple[str, ...] = tuple(TOPIC_UNIONS)
