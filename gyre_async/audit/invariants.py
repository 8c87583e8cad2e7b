"""The loop's delivery invariants, read back from a run's event log and stores.

One checker serves the end-to-end tests (one process, or one process per role) and the
chaos run (``ops/chaos.py``, actors SIGKILLed at random and restarted): whatever happened
to the processes, the log and the stores must show that

- **nothing was lost**: every trajectory step the segmenter consumed (committed) lies in a
  segment, every finished trajectory is segmented in full, every segment the arbiter
  consumed was scored (or withheld with a ``reward-failed`` reason), every scored segment the
  learner consumed was trained or dropped
  with a reason;
- **nothing was duplicated**: no step was published twice under different ids or lies in
  two segments, no segment was scored twice with different results, no segment entered two
  training batches, no policy version number names two checkpoints;
- **nothing is corrupt**: every announced segment reads back with its content hash, every
  segment in the store's index is readable, every announced checkpoint matches its
  sha256, and every checkpoint file a reader can list is whole (its name carries the sha256
  of its bytes; one saved but never announced is whole, and counted as
  ``unannounced_checkpoints``). Leftovers readers never see (a checkpoint temp file of a killed save, rows
  past the index cursor) are counted as ``invisible_leftovers``, not as corruption;
- **order**: policy versions are 0, 1, 2, ... with no gap, and no segment was trained on
  beyond the staleness bound.

At-least-once delivery (Kafka) may write the same event twice: records are de-duplicated by
event id first, which is exactly what idempotent consumers do. A record of the loop's topics
that does not decode stops the check (``UndecodableRecord``): an audit does not vouch for a
log it could not read in full.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from gyre_async.bus import Bus
from gyre_async.bus.reading import read_events
from schemas.events import (
    EnvError,
    Event,
    PolicyVersion,
    RewardFailed,
    Scored,
    SegmentClosed,
    SegmentDropped,
    TrajectoryStep,
)
from schemas.topics import (
    POLICY_VERSION,
    SCORED,
    SEGMENT_CLOSED,
    TELEMETRY,
    TRAJECTORY_STEP,
)

TOPICS = (TRAJECTORY_STEP, SEGMENT_CLOSED, SCORED, POLICY_VERSION, TELEMETRY)
#: role -> the topic whose committed offsets say what the role has consumed
CONSUMED = {"segmenter": TRAJECTORY_STEP, "arbiter": SEGMENT_CLOSED, "learner": SCORED}
#: the event class a read-back asks for (its results are of that class)
EventT = TypeVar("EventT", bound=Event)
_CHECKPOINT_NAME = re.compile(r"^v(\d{12})-([0-9a-f]{64})\.safetensors$")


@dataclass
class RunEvents:
    """A run's events per topic, each as (partition, offset, event), and consumed offsets."""

    by_topic: dict[str, list[tuple[int, int, object]]]
    committed: dict[str, dict[int, int]]  # role -> partition -> next offset

    def events(self, topic: str, cls: type[EventT]) -> list[EventT]:
        """Events of ``cls`` on ``topic``, first copy of each event id only."""
        seen: set[str] = set()
        out: list[EventT] = []
        for _, _, e in self.by_topic.get(topic, []):
            if isinstance(e, cls) and e.event_id not in seen:
                seen.add(e.event_id)
                out.append(e)
        return out

    def consumed(self, role: str, topic: str, cls: type[EventT]) -> list[EventT]:
        """Events of ``cls`` the role has committed past (at least one copy consumed)."""
        done = self.committed.get(role, {})
        seen: set[str] = set()
        out: list[EventT] = []
        for partition, offset, e in self.by_topic.get(topic, []):
            if (isinstance(e, cls) and offset < done.get(partition, 0)
                    and e.event_id not in seen):
                seen.add(e.event_id)
                out.append(e)
        return out


async def read_run(bus: Bus, run_id: str) -> RunEvents:
    """Every event of ``run_id`` on the loop's topics, and each role's committed offsets."""
    known = {t.name for t in await bus.topics()}
    by_topic: dict[str, list[tuple[int, int, object]]] = defaultdict(list)
    async for record, event in read_events(bus, TOPICS, on_bad="raise"):
        if event.run_id == run_id:
            by_topic[record.topic].append((record.partition, record.offset, event))
    committed = {role: (await bus.committed(f"{run_id}.{role}", topic) if topic in known else {})
                 for role, topic in CONSUMED.items()}
    return RunEvents(dict(by_topic), committed)


@dataclass
class InvariantReport:
    """Violations by kind (each a sentence naming the ids), plus counts for the record."""

    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.corrupt or self.order)

    def describe(self, limit: int = 10) -> str:
        lines = [f"counts: {self.counts}"]
        for kind in ("lost", "duplicated", "corrupt", "order"):
            items = getattr(self, kind)
            if items:
                lines.append(f"{kind} ({len(items)}):")
                lines += [f"  - {x}" for x in items[:limit]]
        return "\n".join(lines)


def check_run(run: RunEvents, *, segment_store: str, checkpoint_dir: str | None,
              max_staleness: int) -> InvariantReport:
    """Check every invariant of the module docstring; never raises on a violation."""
    rep = InvariantReport()
    steps = run.events(TRAJECTORY_STEP, TrajectoryStep)
    errors = run.events(TRAJECTORY_STEP, EnvError)
    segments = run.events(SEGMENT_CLOSED, SegmentClosed)
    scored = run.events(SCORED, Scored)
    versions = run.events(POLICY_VERSION, PolicyVersion)
    dropped = run.events(TELEMETRY, SegmentDropped)

    _check_steps(rep, run, steps, errors, segments)
    withheld = {e.segment_id for e in run.events(SCORED, RewardFailed)}
    _check_scoring(rep, run, segments, scored, withheld)
    trained = _check_training(rep, run, versions, segments, scored, dropped, max_staleness)
    _check_segment_store(rep, segments, segment_store)
    if checkpoint_dir is not None:
        _check_checkpoints(rep, versions, Path(checkpoint_dir))
    rep.counts.update(steps=len(steps), env_errors=len(errors), segments=len(segments),
                      scored=len(scored), withheld=len(withheld), versions=len(versions),
                      trained=len(trained),
                      dropped=len({d.segment_id for d in dropped}))
    return rep


def _check_steps(rep, run, steps, errors, segments) -> None:
    by_traj: dict[str, dict[int, str]] = defaultdict(dict)
    for s in steps:
        other = by_traj[s.trajectory_id].setdefault(s.step_index, s.event_id)
        if other != s.event_id:
            rep.duplicated.append(f"step {s.trajectory_id}#{s.step_index} published twice "
                                  f"under ids {other} and {s.event_id}")
    covered: dict[str, list[int]] = defaultdict(list)
    for seg in segments:
        covered[seg.trajectory_id] += list(range(seg.step_start, seg.step_end))
    for tid, idx in covered.items():
        if len(idx) != len(set(idx)):
            rep.duplicated.append(f"a step of {tid} lies in two segments")
        if not set(idx) <= set(by_traj[tid]):
            rep.lost.append(f"segments of {tid} cover steps never published: "
                            f"{sorted(set(idx) - set(by_traj[tid]))[:5]}")
    for s in run.consumed("segmenter", TRAJECTORY_STEP, TrajectoryStep):
        if s.step_index not in covered[s.trajectory_id]:
            rep.lost.append(f"step {s.trajectory_id}#{s.step_index} consumed by the "
                            "segmenter but in no segment")
    # A finished trajectory (its last step or its env-error consumed) is segmented in full.
    ends = {s.trajectory_id for s in run.consumed("segmenter", TRAJECTORY_STEP, TrajectoryStep)
            if s.done or s.truncated}
    ends |= {e.trajectory_id for e in run.consumed("segmenter", TRAJECTORY_STEP, EnvError)}
    for tid in sorted(ends):
        missing = set(by_traj[tid]) - set(covered[tid])
        if missing:
            rep.lost.append(f"finished trajectory {tid}: steps {sorted(missing)[:5]} in no "
                            "segment")
    rep.counts["finished_trajectories"] = len(ends)


def _check_scoring(rep, run, segments, scored, withheld: set[str]) -> None:
    """A consumed segment is either scored or withheld with a ``reward-failed`` reason."""
    results: dict[str, tuple] = {}
    for e in scored:
        result = (e.total, tuple(e.step_rewards), e.content_hash)
        if results.setdefault(e.segment_id, result) != result:
            rep.duplicated.append(f"segment {e.segment_id} scored twice with different "
                                  f"results: {results[e.segment_id][0]} vs {e.total}")
    seg_ids = {s.segment_id for s in segments}
    for sid in sorted(set(results) - seg_ids):
        rep.lost.append(f"scored segment {sid} was never announced")
    for s in run.consumed("arbiter", SEGMENT_CLOSED, SegmentClosed):
        if s.segment_id not in results and s.segment_id not in withheld:
            rep.lost.append(f"segment {s.segment_id} consumed by the arbiter, never scored")
    rep.counts["scored_twice_same_result"] = sum(
        1 for _ in scored) - len(results)


def _check_training(rep, run, versions, segments, scored, dropped, max_staleness) -> list[str]:
    by_number: dict[int, PolicyVersion] = {}
    for v in versions:
        first = by_number.setdefault(v.version, v)
        if first.checkpoint_hash != v.checkpoint_hash:
            rep.duplicated.append(f"policy version {v.version} names two checkpoints "
                                  f"({first.checkpoint_hash[:12]}, {v.checkpoint_hash[:12]})")
    numbers = sorted(by_number)
    if numbers != list(range(len(numbers))):
        rep.order.append(f"policy versions are not 0..n-1 without gaps: {numbers[:20]}")
    for v in by_number.values():
        if v.parent is not None and v.parent != v.version - 1 and v.reason == "update":
            rep.order.append(f"version {v.version} was trained from {v.parent}, not "
                             f"{v.version - 1}")
    trained: list[str] = [sid for n in numbers for sid in by_number[n].trained_segments]
    counts: dict[str, int] = defaultdict(int)
    for sid in trained:
        counts[sid] += 1
    for sid, c in counts.items():
        if c > 1:
            rep.duplicated.append(f"segment {sid} entered {c} training batches")
    dropped_ids = {d.segment_id for d in dropped}
    for sid in sorted(dropped_ids & set(counts)):
        rep.duplicated.append(f"segment {sid} was both trained on and dropped")
    scored_ids = {s.segment_id for s in scored}
    for sid in sorted(set(counts) - scored_ids):
        rep.lost.append(f"trained segment {sid} was never scored")
    for s in run.consumed("learner", SCORED, Scored):
        if s.segment_id not in counts and s.segment_id not in dropped_ids:
            rep.lost.append(f"scored segment {s.segment_id} consumed by the learner, neither "
                            "trained nor dropped")
    seg_by_id = {s.segment_id: s for s in segments}
    for n in numbers:
        for sid in by_number[n].trained_segments:
            seg = seg_by_id.get(sid)
            if seg is not None and (n - 1) - seg.min_policy_version > max_staleness:
                rep.order.append(f"segment {sid} (policy v{seg.min_policy_version}) trained "
                                 f"into v{n}, beyond max_staleness {max_staleness}")
    return trained


def _check_segment_store(rep, segments, url: str) -> None:
    """Every store the announcements name (one per segmenter) and ``url``, the run's own."""
    from gyre_async.storage.roots import StorageRoots
    from gyre_async.storage.store_set import store_url_of
    from gyre_async.storage.urls import normalize_store_url

    roots = StorageRoots("", normalize_store_url(url)[0], "", "")  # the run's segment stores
    by_store: dict[str, list[SegmentClosed]] = defaultdict(list)
    for seg in segments:
        try:  # an address outside the run's stores is reported, never opened
            by_store[store_url_of(roots.segment(seg.address))].append(seg)
        except ValueError as exc:
            rep.corrupt.append(f"announced segment {seg.segment_id}: {exc}")
    by_store.setdefault(normalize_store_url(url)[0], [])
    rep.counts["store_segments"] = rep.counts["unannounced_segments"] = 0
    for store_url, announced_here in sorted(by_store.items()):
        _check_one_store(rep, announced_here, store_url)
    rep.counts["segment_stores"] = len(by_store)


def _check_one_store(rep, segments, url: str) -> None:
    from gyre_async.storage.segments import SegmentStore, SegmentStoreError

    try:
        store = SegmentStore(url, read_only=True)
    except Exception as exc:  # noqa: BLE001 - reported, the check goes on
        if segments:
            rep.corrupt.append(f"segment store {url} cannot be opened: {exc}")
        return
    announced = {s.segment_id for s in segments}
    for seg in segments:
        try:
            arrays = store.read(seg.address)  # verifies the content hash
        except SegmentStoreError as exc:
            rep.corrupt.append(f"announced segment {seg.segment_id}: {exc}")
            continue
        if len(arrays["step_index"]) != seg.step_end - seg.step_start:
            rep.corrupt.append(f"segment {seg.segment_id} holds {len(arrays['step_index'])} "
                               f"steps, its event says {seg.step_end - seg.step_start}")
    indexed = store.list_segments()
    unannounced = [sid for sid in indexed if sid not in announced]
    for sid in unannounced:  # written, then the writer died before announcing: still whole?
        try:
            store.read(store.address(sid))
        except SegmentStoreError as exc:
            rep.corrupt.append(f"indexed segment {sid}: {exc}")
    rep.counts["store_segments"] += len(indexed)
    rep.counts["unannounced_segments"] += len(unannounced)


def _check_checkpoints(rep, versions, root: Path) -> None:
    from gyre_async.storage.checkpoints import CheckpointError, CheckpointStore
    from gyre_async.storage.errors import UntrustedAddress

    store = CheckpointStore(str(root))
    seen_files: set[str] = set()
    for v in versions:
        if v.checkpoint in seen_files:
            continue
        seen_files.add(v.checkpoint)
        try:
            store.load(v.checkpoint, v.checkpoint_hash)  # refuses a file outside the root
        except (CheckpointError, UntrustedAddress) as exc:
            rep.corrupt.append(f"checkpoint of version {v.version}: {exc}")
    leftovers = unannounced = 0
    announced = {v.checkpoint.rsplit("/", 1)[-1] for v in versions}
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        m = _CHECKPOINT_NAME.match(path.name)
        if m is None:
            leftovers += 1  # a temp file of a save that was killed: invisible to readers
            continue
        unannounced += path.name not in announced  # saved, then stopped before announcing
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != m.group(2):
            rep.corrupt.append(f"visible checkpoint {path.name} has sha256 {digest}")
    rep.counts["invisible_leftovers"] = leftovers
    rep.counts["unannounced_checkpoints"] = unannounced
