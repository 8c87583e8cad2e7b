"""Wire events: the only contract between Gyre's actors.

Every event is a frozen msgspec Struct on one base, :class:`Event`, that carries the common
envelope and sets the type tag (``type`` on the wire). Events evolve by adding defaulted
fields only; a breaking change is a new tag. Unknown fields are ignored on decode, so an old
reader keeps working against a newer producer that only added fields, while a newer
``schema_version`` than this build understands is rejected at decode (see ``codec.py``).

Constraints (non-negative indices, finite floats, bounded sizes) are checked in
``__post_init__`` so a bad message fails at decode, with the field named.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from typing import Literal

import msgspec
import msgspec.inspect

#: Highest schema version this build reads. Producers stamp it on every event.
SCHEMA_VERSION = 1

#: Upper bounds that keep any one event small (large arrays live in Zarr, not on the bus).
MAX_TOKENS_PER_STEP = 8192
MAX_TEXT_CHARS = 16384
MAX_TOKEN_ID = 2**31 - 1  # token ids are stored as int32 in the segment store
#: Longest segment an event may announce: its ``scored`` verdict carries one reward per step
#: (9 bytes each on the wire), so this keeps it far below the bus limit. The segmenter's
#: ``max_segment_steps`` is validated against it.
MAX_STEPS_PER_SEGMENT = 8192


def event_id(*parts: object) -> str:
    """Deterministic id from an event's natural identity (same input -> same id).

    Handlers are idempotent by this id: an event re-emitted after a crash carries the same
    id as the first copy, so consumers can drop the duplicate.
    """
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(str(p).encode())
        h.update(b"\x1f")
    return h.hexdigest()


def _finite(name: str, *values: float) -> None:
    for v in values:
        if not math.isfinite(v):
            raise ValueError(f"{name} must be finite, got {v!r}")


#: Largest magnitude a measured float takes in an event (see :func:`finite_reading`).
MAX_READING = 1e300


def finite_reading(x: float, fallback: float = -1.0) -> float:
    """A measurement as an event carries it (events refuse NaN/inf): an infinite reading
    (a KL where the new policy gives 0 to an action) capped at +-MAX_READING, still plainly
    huge; a NaN (no reading) as ``fallback``."""
    return fallback if math.isnan(x) else max(min(x, MAX_READING), -MAX_READING)


def _non_negative(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag=True):
    """Common envelope of every event.

    ``event_id`` is deterministic (see :func:`event_id`); ``key`` chooses the partition
    (trajectory id for trajectory data, so one trajectory's events stay in order).
    """

    event_id: str
    run_id: str
    producer: str
    key: str = ""
    schema_version: int = SCHEMA_VERSION
    ts: float = msgspec.field(default_factory=time.time)

    def __post_init__(self) -> None:
        _all_finite(self)

    def __init_subclass__(cls, **kwargs) -> None:
        """Every event refuses NaN/inf in every float field, nested ones included, before
        its own checks run: an event's own ``__post_init__`` is wrapped, so no event type
        can forget it (a bad float fails at decode, and at construction in a producer)."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__post_init__")
        if own is None:
            return  # the inherited check already covers this class's fields

        def __post_init__(self) -> None:
            _all_finite(self)
            own(self)

        setattr(cls, "__post_init__", __post_init__)  # noqa: B010 - a method, replaced


def _all_finite(event: msgspec.Struct) -> None:
    """Raise ``ValueError`` naming the first NaN/inf float of ``event`` (``metrics['loss']``)."""
    for name in _float_fields(type(event)):
        _check_finite(getattr(event, name), name)


def _check_finite(value: object, path: str) -> None:
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path} must be finite, got {value!r}")
    elif isinstance(value, list | tuple):
        if value and isinstance(value[0], int | float) and all(map(math.isfinite, value)):
            return  # the usual case (log-probs, rewards), checked at C speed
        for i, item in enumerate(value):
            _check_finite(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, f"{path}[{key!r}]")
    elif isinstance(value, msgspec.Struct):
        for name in _float_fields(type(value)):
            _check_finite(getattr(value, name), f"{path}.{name}")


@functools.cache
def _float_fields(cls: type) -> tuple[str, ...]:
    """The fields of a struct whose type holds a float anywhere (token-id lists are skipped:
    checking them would cost a loop over thousands of ints per step for nothing)."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType), cls
    return tuple(f.name for f in info.fields if _holds_float(f.type))


def _holds_float(t: msgspec.inspect.Type) -> bool:
    match t:
        case msgspec.inspect.FloatType():
            return True
        case msgspec.inspect.UnionType(types=types):
            return any(_holds_float(x) for x in types)
        case msgspec.inspect.ListType(item_type=item) | msgspec.inspect.VarTupleType(
                item_type=item):
            return _holds_float(item)
        case msgspec.inspect.TupleType(item_types=items):
            return any(_holds_float(x) for x in items)
        case msgspec.inspect.DictType(value_type=value):
            return _holds_float(value)
        case msgspec.inspect.StructType(fields=fields):
            return any(_holds_float(f.type) for f in fields)
    return False


class Milestone(msgspec.Struct, frozen=True, kw_only=True):
    """A sub-task reached, as proven by environment state (never by the agent's words)."""

    name: str
    proof: str  # the state fact that proves it, e.g. "inventory.axe=1"


class PrimitiveStep(msgspec.Struct, frozen=True, kw_only=True):
    """One environment step inside a macro-action (kept for audit; PPO credits the macro)."""

    action: str
    feedback: float = 0.0
    ok: bool = True  # the environment accepted and performed the action


#: Longest macro expansion a trajectory step may record.
MAX_PRIMITIVES_PER_STEP = 256


class TrajectoryStep(Event, tag="trajectory-step", frozen=True, kw_only=True):
    """One agent step: what the policy saw and did, and what the environment answered."""

    trajectory_id: str
    task_id: str
    step_index: int
    policy_version: int
    context_tokens: list[int]
    action_tokens: list[int]
    action_logprobs: list[float]
    action_text: str = ""
    observation_ref: str = ""
    feedback: float = 0.0
    milestones: list[Milestone] = []
    state_changed: bool = False
    tool_latency_s: float = 0.0
    done: bool = False
    truncated: bool = False
    success: bool = False
    score: float = 0.0
    next_context_tokens: list[int] | None = None
    macro: str = ""  # the action was this macro-action (see gyre_async.envs.macros)
    primitives: list[PrimitiveStep] = []  # the env steps the macro expanded into (if macro)
    #: Short sha256 of the observation that followed this step's action (``""`` in logs
    #: written before it existed): a restarted sampler that rebuilds the episode by
    #: replaying the logged actions checks every rebuilt observation against it.
    observation_hash: str = ""
    #: On step 0 only: the same hash of the observation ``reset`` returned.
    reset_hash: str = ""
    #: Segment contexts (``policy.context = "segment"``) grow by appending, so a step
    #: carries only what is new: the context is the first ``context_prefix`` tokens of the
    #: previous step's context followed by its action tokens (all of them: the prefix is
    #: that whole sequence), then ``context_tokens``. 0 (and in every log written before
    #: it existed): ``context_tokens`` is the whole context.
    #: :mod:`gyre_async.core.segment_context` puts them back together.
    context_prefix: int = 0
    #: The same for ``next_context_tokens``, relative to this step's context + action.
    next_context_prefix: int = 0
    #: The next context would pass the policy's token budget (``policy.context_tokens``):
    #: the segment closes at this step (a ``max-length`` boundary), its context with it.
    context_full: bool = False

    def __post_init__(self) -> None:
        _non_negative("step_index", self.step_index)
        _non_negative("policy_version", self.policy_version)
        _non_negative("context_prefix", self.context_prefix)
        _non_negative("next_context_prefix", self.next_context_prefix)
        if len(self.primitives) > MAX_PRIMITIVES_PER_STEP:
            raise ValueError(f"more than {MAX_PRIMITIVES_PER_STEP} primitive steps in one step")
        _finite("primitives.feedback", *(p.feedback for p in self.primitives))
        if len(self.action_tokens) != len(self.action_logprobs):
            raise ValueError("action_tokens and action_logprobs must have the same length")
        if len(self.context_tokens) + len(self.action_tokens) > MAX_TOKENS_PER_STEP:
            raise ValueError(f"step carries more than {MAX_TOKENS_PER_STEP} tokens")
        for name, tokens in (("context_tokens", self.context_tokens),
                             ("action_tokens", self.action_tokens)):
            if any(not 0 <= t < MAX_TOKEN_ID for t in tokens):
                raise ValueError(f"{name} must be token ids in [0, {MAX_TOKEN_ID})")
        if len(self.action_text) > MAX_TEXT_CHARS:
            raise ValueError(f"action_text longer than {MAX_TEXT_CHARS} characters")
        _finite("action_logprobs", *self.action_logprobs)
        _finite("feedback", self.feedback, self.tool_latency_s, self.score)
        if any(lp > 1e-4 for lp in self.action_logprobs):
            raise ValueError("action_logprobs must be <= 0")


class EnvError(Event, tag="env-error", frozen=True, kw_only=True):
    """An environment failed (exception, timeout): its trajectory ends truncated."""

    trajectory_id: str
    task_id: str
    step_index: int
    kind: Literal["timeout", "exception", "oversized-observation"]
    message: str
    #: Why the *sampler* ended the trajectory when the environment itself did not fail
    #: (``""``: it did): ``"abandoned"`` (its sampler restarted and the episode cannot be
    #: rebuilt), ``"rebuild-mismatch"`` (replaying the logged actions gave another
    #: observation than the log's), ``"rebuild-failed"`` (the replay itself failed).
    #: A field of its own, not a new ``kind``: readers built before it still decode it.
    reason: str = ""

    def __post_init__(self) -> None:
        _non_negative("step_index", self.step_index)


#: How a failed episode ended (not a task outcome): "" in events, an episode that ended
#: properly. Abandonment (the sampler died mid-episode) travels as an ``exception`` whose
#: message starts with "abandoned" (the kind literal cannot grow: old readers would refuse it).
EpisodeFailure = Literal["", "env-error", "timeout", "abandoned"]


def failure_of(error: EnvError) -> EpisodeFailure:
    """The failure kind an ``env-error`` ends its episode with (counted in monitor, report)."""
    if error.kind == "timeout":
        return "timeout"
    if error.message.startswith("abandoned"):
        return "abandoned"
    return "env-error"


BoundaryReason = Literal["milestone", "state-change", "max-length", "trajectory-end"]


class SegmentClosed(Event, tag="segment-closed", frozen=True, kw_only=True):
    """A training segment was written to the segment store and is ready to score."""

    segment_id: str
    trajectory_id: str
    task_id: str
    step_start: int
    step_end: int  # exclusive
    boundary: BoundaryReason
    address: str
    content_hash: str
    min_policy_version: int
    max_policy_version: int
    trajectory_done: bool = False
    success: bool = False
    milestones: list[Milestone] = []
    milestone_steps: list[int] = []  # step index (absolute) where each milestone was reached
    feedback: list[float] = []  # per-step raw environment feedback
    actions: list[str] = []  # per-step action text (for guards; tokens live in the store)
    env_steps: int = 0  # primitive environment steps (macros expand); 0: one per step
    #: set on the last segment of an episode ended by a failure (env error, timeout,
    #: abandonment): the episode has no outcome, the learner bootstraps it instead
    failure: EpisodeFailure = ""
    #: the game itself ended the episode without a win (done, not cut at the step cap): a
    #: loss, which ``arbiter.outcome_lost`` may pay apart from a cut
    lost: bool = False

    def __post_init__(self) -> None:
        _non_negative("step_start", self.step_start)
        if self.step_end <= self.step_start:
            raise ValueError("step_end must be > step_start")
        steps = self.step_end - self.step_start
        if steps > MAX_STEPS_PER_SEGMENT:  # its verdict would carry a reward per step
            raise ValueError(f"step range [{self.step_start}, {self.step_end}) spans {steps} "
                             f"steps, more than a segment may ({MAX_STEPS_PER_SEGMENT})")
        if len(self.feedback) not in (0, steps):
            raise ValueError("feedback must have one value per step")
        if len(self.actions) not in (0, steps):
            raise ValueError("actions must have one text per step")
        if self.milestone_steps and len(self.milestone_steps) != len(self.milestones):
            raise ValueError("milestone_steps must have one step per milestone")
        if any(not self.step_start <= s < self.step_end for s in self.milestone_steps):
            raise ValueError("milestone_steps must lie inside [step_start, step_end)")
        _non_negative("min_policy_version", self.min_policy_version)
        _finite("feedback", *self.feedback)


class Scored(Event, tag="scored", frozen=True, kw_only=True):
    """The arbiter's verdict on one segment: every component and the arbitrated total."""

    segment_id: str
    trajectory_id: str
    task_id: str
    address: str
    content_hash: str
    step_start: int
    step_end: int
    min_policy_version: int
    trajectory_done: bool
    success: bool
    components: dict[str, float]
    step_rewards: list[float]
    total: float
    decided_by: str
    paid_milestones: list[str] = []
    guard_reasons: list[str] = []  # why each guard that fired vetoed (empty: no veto)
    guard_state: dict[str, float] = {}  # the farming guard's trajectory state after this segment
    failure: EpisodeFailure = ""  # copied from the segment: its episode ended by a failure

    def __post_init__(self) -> None:
        if len(self.step_rewards) != self.step_end - self.step_start:
            raise ValueError("step_rewards must have one value per step")
        _finite("components", *self.components.values())
        _finite("step_rewards", *self.step_rewards)
        _finite("total", self.total)


class RewardFailed(Event, tag="reward-failed", frozen=True, kw_only=True):
    """A reward component could not be computed; never stands in as a zero."""

    segment_id: str
    component: str
    reason: str
    trajectory_id: str = ""
    trajectory_done: bool = False  # the withheld segment was its trajectory's last


class DriftReport(Event, tag="drift-report", frozen=True, kw_only=True):
    """The process reward model re-scored on reference judgments, and the weight in force."""

    model: str  # weights file that was checked
    reference: str  # reference judgments file
    segments_scored: int  # segments the arbiter had handled when it checked
    pairs: int
    pairwise_accuracy: float
    rank_correlation: float | None = None  # None: undefined on this reference set
    base_weight: float
    weight: float  # what the arbiter pays the model with from now on
    drifted: bool

    def __post_init__(self) -> None:
        _finite("drift-report", self.pairwise_accuracy, self.base_weight, self.weight)
        if self.rank_correlation is not None:
            _finite("rank_correlation", self.rank_correlation)


class PolicyVersion(Event, tag="policy-version", frozen=True, kw_only=True):
    """A new policy to act with: where its weights are and why it exists."""

    version: int
    checkpoint: str
    checkpoint_hash: str
    parent: int | None = None
    reason: Literal["init", "update", "rollback", "warmstart"] = "update"
    learning_rate: float = 0.0
    env_steps: int = 0
    #: steps the learner has trained on *or dropped* since the start: the staleness gate lets
    #: the sampler run this far plus (max_staleness + 1) batches (0 in events before it existed)
    consumed_steps: int = 0
    metrics: dict[str, float] = {}
    trained_segments: list[str] = []  # segment ids in the batch that made this version
    advantage_digest: str = ""  # fingerprint of that batch's advantages (replay audit)
    fusion_weights: list[float] = []  # weight of the global outcome advantage per trained segment
    #: torch's intra-op threads that computed that batch (0: not recorded): a reduction
    #: split over another number of threads may add up in another order, so ``gyre replay
    #: learner`` re-derives the digest with as many
    batch_threads: int = 0
    #: content hashes of the elite pool's segments mixed into that batch, after the trained
    #: ones (``gyre_async.experience.elite``; ``gyre replay learner`` rebuilds them)
    elite_segments: list[str] = []

    def __post_init__(self) -> None:
        _non_negative("version", self.version)
        _finite("metrics", self.learning_rate, *self.metrics.values())
        _finite("fusion_weights", *self.fusion_weights)


KeptSlot = Literal["stable", "pre-large", "best"]


class KeptCheckpoint(Event, tag="kept-checkpoint", frozen=True, kw_only=True):
    """The keeper copied a version's weights into one of its three slots.

    ``stable``: the latest version whose validation did not regress; ``pre-large``: the
    version before the last large update; ``best``: the best validation so far. The file is
    the keeper's own copy (safetensors, metadata in its header), named by its sha256.
    """

    slot: KeptSlot
    version: int
    address: str
    sha256: str
    why: str = ""
    measures: dict[str, float] = {}

    def __post_init__(self) -> None:
        _non_negative("version", self.version)
        _finite("measures", *self.measures.values())


class Rollback(Event, tag="rollback", frozen=True, kw_only=True):
    """The keeper's decision: version ``regressed_version`` regressed; restore ``restore_version``.

    The learner (the only writer of version numbers) follows it by publishing a
    ``policy-version`` with reason ``rollback``: a new number, these weights, ``learning_rate``.
    ``evidence`` holds, per metric, the best's value, the new value and the z-score.
    """

    sequence: int
    regressed_version: int
    restore_version: int
    slot: KeptSlot
    checkpoint: str
    checkpoint_hash: str
    learning_rate: float
    previous_learning_rate: float
    why: str
    evidence: dict[str, float] = {}

    def __post_init__(self) -> None:
        _non_negative("sequence", self.sequence)
        _finite("learning_rate", self.learning_rate, self.previous_learning_rate,
                *self.evidence.values())
        if self.learning_rate <= 0:
            raise ValueError("learning_rate must be > 0")


class CheckpointFault(Event, tag="checkpoint-fault", frozen=True, kw_only=True):
    """A kept checkpoint failed verification (hash mismatch, missing, unreadable).

    ``fell_back_to`` names the slot used instead ("" when none was usable).
    """

    slot: str
    version: int
    address: str
    expected_sha256: str
    error: str
    fell_back_to: str = ""


class SegmentDropped(Event, tag="segment-dropped", frozen=True, kw_only=True):
    """The learner refused a segment (too stale); counted, never silently lost."""

    segment_id: str
    reason: str
    staleness: int
    steps: int = 0  # the segment's length (0 in events before it existed)
    #: the learner's count of steps trained on or dropped, this one included: the sampler's
    #: staleness gate follows it at once (0 in events before it existed)
    consumed_steps: int = 0


class CriticReset(Event, tag="critic-reset", frozen=True, kw_only=True):
    """The learner's divergence detector reset the critic and shrank the learning rate."""

    version: int  # the policy version whose update detected it
    reason: Literal["advantage", "value-loss"]
    max_abs_advantage: float
    value_loss: float
    learning_rate: float  # after shrinking
    skipped_update: bool = False

    def __post_init__(self) -> None:
        _non_negative("version", self.version)


class EvalResult(Event, tag="eval-result", frozen=True, kw_only=True):
    """Validation of one policy version on a fixed set of unseen tasks."""

    policy_version: int
    episodes: int
    success_rate: float
    mean_score: float
    mean_length: float
    milestone_rates: dict[str, float] = {}
    env_steps: int = 0
    trigger: str = ""  # schedule | final | reason:<why the version exists> | request
    decoding: str = ""  # greedy | sampled
    task_success_rates: dict[str, float] = {}  # per validation task id
    validation_seeds: list[int] = []
    validation_config: dict[str, str] = {}  # env_config overrides used for validation


class EvalRequest(Event, tag="eval-request", frozen=True, kw_only=True):
    """Ask the evaluator to validate a policy version now (``gyre evaluate``)."""

    policy_version: int = -1  # -1: the latest published version
    greedy: bool | None = None  # None: as configured (evaluator.greedy)
    reason: str = ""


class Heartbeat(Event, tag="heartbeat", frozen=True, kw_only=True):
    """An actor is alive; carries its progress and consumer lag."""

    actor: str
    role: str
    processed: int
    lag: int
    in_flight: int
    uptime_s: float
    stats: dict[str, float] = {}


class DeadLetter(Event, tag="dead-letter", frozen=True, kw_only=True):
    """Input an actor could not use, kept with the reason and the original bytes."""

    actor: str
    source_topic: str
    source_partition: int
    source_offset: int
    reason: str
    original: bytes


class Probe(Event, tag="probe", frozen=True, kw_only=True):
    """Diagnostic event for bus and runtime checks (the echo actor answers it)."""

    seq: int
    payload: str = ""

    def __post_init__(self) -> None:
        _non_negative("seq", self.seq)
