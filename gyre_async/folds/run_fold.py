"""One fold of a run's events: the numbers every view of a run shows.

The monitor (``gyre_async.ui.monitor``), the report (``gyre_async.ui.report``), the run log
files (``metrics.jsonl``, ``summary.json``: ``gyre_async.folds.runlog``) and the progress
line of ``gyre run`` all read the same events; :class:`RunFold` folds them once, so the
views can never disagree (the monitor's ``--once`` frame, the report and ``summary.json``
count the same episodes, steps and versions). Each view keeps only its own derivations on
top (the monitor's rates and silent actors, the report's figures).

Rules of the fold, each there for a reason:

- **any order**: topics are read concurrently, so cross-topic order is not guaranteed; a
  policy version may name trained segments whose ``segment-closed`` has not been read yet
  (they wait until it arrives), and the lists are kept in time order whatever the order
  of arrival (sorted lazily, on first read after an out-of-order append);
- **at-least-once**: delivery may publish an event twice (an actor restarted between
  publishing and committing); a copy with an event id already folded is counted in
  ``counts.duplicates`` and ignored. Ids are remembered over a window of the latest
  :data:`DEDUPE_WINDOW` events (copies follow their original closely: same key, same
  partition), except steps and heartbeats, the bulk of the log, which are not deduplicated;
- **no clock**: every notion of "now" is the newest event time, so a finished log folds
  the way the run looked at its end;
- **bounded when live**: ``keep_records=False`` (the monitor, the progress line: long-lived
  followers) keeps counts and short curves only; ``keep_records=True`` (the report, the run
  log: one pass over a finished log) also keeps the segment, scored, dropped, dead-letter
  events and the step times. Policy versions and evaluations are always kept (few).

Undecodable records never reach the fold: the readers skip them with
:func:`gyre_async.bus.reading.read_events` and count them in :attr:`RunFold.read`, which
the views show.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from gyre_async.bus.reading import ReadCounts
from gyre_async.envs.macros import env_steps_of
from schemas import Event
from schemas.events import (
    CriticReset,
    DeadLetter,
    EnvError,
    EvalResult,
    Heartbeat,
    PolicyVersion,
    RewardFailed,
    Scored,
    SegmentClosed,
    SegmentDropped,
    TrajectoryStep,
    failure_of,
)

CURVE_POINTS = 240  #: points kept per curve (the monitor's sparklines show the tail)
RECENT_EPISODES = 100  #: episodes in the rolling training success rate
STEP_WINDOW_S = 10.0  #: window of the "current" env steps/s, in seconds of event time
DEDUPE_WINDOW = 200_000  #: event ids remembered to recognise a redelivered copy
LATEST_DEAD_LETTERS = 3

T = TypeVar("T")


class TimeOrdered(Generic[T]):
    """A list kept in ``key`` order: appends are O(1), a read after an out-of-order append
    sorts once (nearly sorted input: timsort is linear)."""

    def __init__(self, key: Callable[[T], Any]):
        self.key = key
        self._items: list[T] = []
        self._ordered = True

    def add(self, item: T) -> None:
        if self._items and self.key(item) < self.key(self._items[-1]):
            self._ordered = False
        self._items.append(item)

    @property
    def items(self) -> list[T]:
        if not self._ordered:
            self._items.sort(key=self.key)
            self._ordered = True
        return self._items


@dataclass
class ActorSeen:
    """What the heartbeats of one actor name say (latest values + a short history)."""

    actor: str
    role: str
    last_ts: float = 0.0
    processed: int = 0
    lag: int = 0
    #: the most inputs it had not handled yet at any heartbeat (``lag`` also counts what it
    #: handled but holds on purpose): whether the actor kept pace over the run
    max_unconsumed: int = 0
    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=6))

    def rate(self) -> float | None:
        """Inputs processed per second over the last few heartbeats (None: not known yet)."""
        if len(self.history) < 2:
            return None
        (t0, p0), (t1, p1) = self.history[0], self.history[-1]
        return (p1 - p0) / (t1 - t0) if t1 > t0 else None


@dataclass
class RunCounts:
    """How many of each thing the fold has seen (first copies of this run's events)."""

    events: int = 0
    other_runs: int = 0  # events of another run id (when the fold is for one run)
    duplicates: int = 0  # redelivered copies, ignored
    segments: int = 0
    episodes: int = 0  # segments that ended their trajectory
    successes: int = 0
    scored: int = 0
    reward_failed: int = 0
    dropped: int = 0
    env_errors: int = 0
    failed_episodes: int = 0  # episodes ended by a failure (each env-error ends one)
    dead_letters: int = 0
    updates: int = 0  # policy versions with reason "update"


class RunFold:
    """A run's events folded once, in any order (rules in the module docstring)."""

    def __init__(self, run_id: str | None = None, *, keep_records: bool = True):
        self.run_id = run_id
        self.keep_records = keep_records
        self.read = ReadCounts()  # what the readers feeding this fold skipped
        self.counts = RunCounts()
        self.by_topic: collections.Counter[str] = collections.Counter()
        self.run_ids: set[str] = set()
        self.newest_ts = 0.0
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        # policy
        self._versions: TimeOrdered[PolicyVersion] = TimeOrdered(lambda v: (v.ts, v.version))
        self.current: PolicyVersion | None = None  # in force: the last published
        self.max_version = -1
        self.final_version = -1  # the learner's last version (metrics["final"])
        self.learner_staleness = self.max_staleness_seen = 0.0
        self.critic_resets: list[CriticReset] = []
        # validation
        self._evals: TimeOrdered[EvalResult] = TimeOrdered(lambda e: (e.policy_version, e.ts))
        self.newest_eval: EvalResult | None = None  # the last one read
        self.evaluated: set[int] = set()
        # segments and staleness
        self._segments: TimeOrdered[SegmentClosed] = TimeOrdered(_ts)
        self.segment_env_steps = 0  # env steps the closed segments cover
        self._recent: collections.deque[float] = collections.deque(maxlen=RECENT_EPISODES)
        self.train_curve: collections.deque[float] = collections.deque(maxlen=CURVE_POINTS)
        self._segment_min_version: dict[str, int] = {}
        self._pending_trained: dict[str, int] = {}
        self.staleness_hist: collections.Counter[int] = collections.Counter()
        self._dropped: TimeOrdered[SegmentDropped] = TimeOrdered(_ts)
        self.dropped_hist: collections.Counter[int] = collections.Counter()
        self.dropped_reasons: collections.Counter[str] = collections.Counter()
        # rewards
        self._scored: TimeOrdered[Scored] = TimeOrdered(_ts)
        self.total_reward = 0.0
        self.components: dict[str, list[float]] = {}  # name -> [count, sum]
        self._episode_return: dict[str, float] = {}
        self.returns: collections.deque[float] = collections.deque(maxlen=CURVE_POINTS)
        # steps, errors, actors
        self.steps = 0  # primitive env steps (macros expand)
        self.step_first_ts = self.step_last_ts = 0.0
        self._step_ts: TimeOrdered[float] = TimeOrdered(float)
        self.step_seconds: collections.Counter[int] = collections.Counter()  # recent only
        self.env_error_kinds: collections.Counter[str] = collections.Counter()
        #: failed episodes by how they ended (env-error, timeout, abandoned): no outcome,
        #: kept out of group baselines by the learner (``learner.mask_failed``)
        self.failure_kinds: collections.Counter[str] = collections.Counter()
        self._dead_letters: TimeOrdered[DeadLetter] = TimeOrdered(_ts)
        self.latest_dead: collections.deque[DeadLetter] = collections.deque(
            maxlen=LATEST_DEAD_LETTERS)
        self.actors: dict[str, ActorSeen] = {}

    # -- the lists, in time order ---------------------------------------------------------------
    @property
    def versions(self) -> list[PolicyVersion]:
        """Every policy version, by (publication time, version)."""
        return self._versions.items

    @property
    def rollbacks(self) -> list[PolicyVersion]:
        return [v for v in self.versions if v.reason == "rollback"]

    @property
    def evals(self) -> list[EvalResult]:
        """Every evaluation, by (policy version, time)."""
        return self._evals.items

    @property
    def segments(self) -> list[SegmentClosed]:
        """Closed segments by time (kept only with ``keep_records``)."""
        return self._segments.items

    @property
    def scored(self) -> list[Scored]:
        return self._scored.items

    @property
    def dropped(self) -> list[SegmentDropped]:
        return self._dropped.items

    @property
    def dead_letters(self) -> list[DeadLetter]:
        return self._dead_letters.items

    @property
    def step_ts(self) -> list[float]:
        """The time of every step record (kept only with ``keep_records``)."""
        return self._step_ts.items

    @property
    def train_success(self) -> float | None:
        """Success rate of the last :data:`RECENT_EPISODES` finished trajectories."""
        return sum(self._recent) / len(self._recent) if self._recent else None

    # -- folding --------------------------------------------------------------------------------
    def apply(self, event: Event, topic: str | None = None) -> bool:
        """Fold one decoded event; False when it is another run's or a redelivered copy."""
        if self.run_id and event.run_id != self.run_id:
            self.counts.other_runs += 1
            return False
        if not isinstance(event, (TrajectoryStep, Heartbeat)) and self._is_copy(event.event_id):
            self.counts.duplicates += 1
            return False
        self.counts.events += 1
        if topic is not None:
            self.by_topic[topic] += 1
        if len(self.run_ids) < 8:
            self.run_ids.add(event.run_id)
        self.newest_ts = max(self.newest_ts, event.ts)
        match event:
            case TrajectoryStep():
                self._step(event)
            case SegmentClosed():
                self._segment(event)
            case Scored():
                self._score(event)
            case PolicyVersion():
                self._policy(event)
            case EvalResult():
                self._evals.add(event)
                self.newest_eval = event
                self.evaluated.add(event.policy_version)
            case Heartbeat():
                self._heartbeat(event)
            case SegmentDropped():
                self.counts.dropped += 1
                self.dropped_hist[event.staleness] += 1
                self.dropped_reasons[event.reason.split(":")[0]] += 1
                self._segment_min_version.pop(event.segment_id, None)
                self._keep(self._dropped, event)
            case DeadLetter():
                self.counts.dead_letters += 1
                self.latest_dead.append(event)
                self._keep(self._dead_letters, event)
            case EnvError():
                self.counts.env_errors += 1
                self.env_error_kinds[event.kind] += 1
                self.counts.failed_episodes += 1
                self.failure_kinds[failure_of(event)] += 1
            case RewardFailed():
                self.counts.reward_failed += 1
            case CriticReset():
                self.critic_resets.append(event)
        return True

    def _is_copy(self, event_id: str) -> bool:
        if event_id in self._seen:
            return True
        self._seen[event_id] = None
        if len(self._seen) > DEDUPE_WINDOW:
            self._seen.popitem(last=False)
        return False

    def _keep(self, where: TimeOrdered, item) -> None:
        if self.keep_records:
            where.add(item)

    def _step(self, e: TrajectoryStep) -> None:
        self.steps += env_steps_of(e)
        self.step_first_ts = min(self.step_first_ts or e.ts, e.ts)
        self.step_last_ts = max(self.step_last_ts, e.ts)
        self._keep(self._step_ts, e.ts)
        self.step_seconds[int(e.ts)] += 1
        if len(self.step_seconds) > 4 * STEP_WINDOW_S:  # keep only what the window can use
            horizon = self.newest_ts - 2 * STEP_WINDOW_S
            for sec in [s for s in self.step_seconds if s < horizon]:
                del self.step_seconds[sec]

    def _segment(self, e: SegmentClosed) -> None:
        self.counts.segments += 1
        self.segment_env_steps += e.env_steps or (e.step_end - e.step_start)
        self._keep(self._segments, e)
        if e.trajectory_done:
            self.counts.episodes += 1
            self.counts.successes += int(e.success)
            self._recent.append(float(e.success))
            self.train_curve.append(sum(self._recent) / len(self._recent))
        learner_version = self._pending_trained.pop(e.segment_id, None)
        if learner_version is not None:
            self.staleness_hist[learner_version - e.min_policy_version] += 1
        else:
            self._segment_min_version[e.segment_id] = e.min_policy_version

    def _score(self, e: Scored) -> None:
        self.counts.scored += 1
        self._keep(self._scored, e)
        self.total_reward += e.total
        for name, value in e.components.items():
            acc = self.components.setdefault(name, [0, 0.0])
            acc[0] += 1
            acc[1] += value
        ret = self._episode_return.pop(e.trajectory_id, 0.0) + e.total
        if e.trajectory_done:
            self.returns.append(ret)
        else:
            self._episode_return[e.trajectory_id] = ret

    def _policy(self, e: PolicyVersion) -> None:
        self._versions.add(e)
        self.max_version = max(self.max_version, e.version)
        # the policy in force is the last one published (a rollback may lower it)
        if self.current is None or (e.ts, e.version) >= (self.current.ts, self.current.version):
            self.current = e
        if e.reason == "update":
            self.counts.updates += 1
        if e.metrics.get("final", 0.0) > 0:
            self.final_version = e.version
        if "charts/max_staleness_seen" in e.metrics:
            self.learner_staleness = e.metrics["charts/max_staleness_seen"]
            self.max_staleness_seen = max(self.max_staleness_seen, self.learner_staleness)
        # the version that was trained to produce this one
        learner_version = e.parent if e.parent is not None else e.version - 1
        for sid in e.trained_segments:
            min_version = self._segment_min_version.pop(sid, None)
            if min_version is None:
                self._pending_trained[sid] = learner_version
            else:
                self.staleness_hist[learner_version - min_version] += 1

    def _heartbeat(self, e: Heartbeat) -> None:
        seen = self.actors.get(e.actor)
        if seen is None:
            seen = self.actors[e.actor] = ActorSeen(e.actor, e.role)
        if e.ts < seen.last_ts:  # an older beat delivered late: latest values stay
            return
        if seen.history and e.processed < seen.history[-1][1]:
            seen.history.clear()  # the actor restarted: its counter began again
        seen.role, seen.last_ts, seen.processed, seen.lag = e.role, e.ts, e.processed, e.lag
        seen.history.append((e.ts, e.processed))
        seen.max_unconsumed = max(seen.max_unconsumed, int(e.stats.get("unconsumed", 0)))


def _ts(event: Event) -> float:
    return event.ts
