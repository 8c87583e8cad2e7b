"""What a run's event log says: the policy in force, metric rows and the summary.

Everything here is derived from the recorded events (no side channel), so the same code
serves a finished run, a live one and a replayed Kafka archive. The events are folded by
:class:`~gyre_async.folds.run_fold.RunFold`, the fold the monitor, the report and the
progress line use too; this module reads the log into it (the files are written by
:mod:`gyre_async.ui.run_outputs`).
Undecodable records are skipped and counted (``undecodable_records`` in the summary).
"""

from __future__ import annotations

from collections.abc import Callable

from gyre_async.bus import Bus
from gyre_async.bus.reading import read_events
from gyre_async.folds.fold import FoldBase, restore
from gyre_async.folds.run_fold import RunFold
from schemas import Event
from schemas.events import PolicyVersion, SegmentClosed
from schemas.topics import EVAL, POLICY_VERSION, SCORED, SEGMENT_CLOSED, TELEMETRY, TRAJECTORY_STEP


async def load_runlog(bus: Bus, *, with_steps: bool = True,
                      run_id: str | None = None) -> RunFold:
    """The run's events folded (skipping and counting undecodable records); with ``run_id``
    only that run's (a cluster's topics hold every run's)."""
    fold = RunFold(run_id)
    topics = [POLICY_VERSION, EVAL, SEGMENT_CLOSED, SCORED, TELEMETRY]
    if with_steps:
        topics.append(TRAJECTORY_STEP)
    async for record, event in read_events(bus, topics, on_bad="skip", counts=fold.read):
        fold.apply(event, record.topic)
    return fold


async def current_policy_version(
    bus: Bus, run_id: str, trusted: Callable[[PolicyVersion], bool] | None = None
) -> PolicyVersion | None:
    """The policy in force in ``run_id``: the last ``policy-version`` it published (in log
    order). Other runs on the same cluster share the topic, so the run id filters.

    The topic is keyed by one key, so it lives on one partition and log order is
    publication order. Actors call this on start (a rebuild): undecodable records are
    skipped, as their live consumers dead-letter them, and so are events ``trusted`` refuses
    (:meth:`gyre_async.storage.roots.StorageRoots.trusts`: another producer, a checkpoint
    outside the run's roots).
    """
    versions = await policy_versions_in_force(bus, run_id, trusted)
    return versions[0] if versions else None


async def policy_versions_in_force(
    bus: Bus, run_id: str, trusted: Callable[[PolicyVersion], bool] | None = None
) -> list[PolicyVersion]:
    """Every ``policy-version`` of ``run_id`` that ``trusted`` accepts, the one in force
    first (:meth:`VersionsInForce.in_force`)."""
    versions = VersionsInForce(trusted)
    await restore(bus, [versions], run_id=run_id)
    return versions.in_force()


class VersionsInForce(FoldBase):
    """The run's policy versions that ``trusted`` accepts, to find the one in force.

    A restart whose newest version does not load (its checkpoint missing, corrupt or
    non-finite: an announcement forged in the learner's name, or damage) goes on with the
    next one, so the fold keeps them all (a few hundred small events)."""

    topics = (POLICY_VERSION,)

    def __init__(self, trusted: Callable[[PolicyVersion], bool] | None = None):
        self.trusted = trusted
        self.found: list[PolicyVersion] = []

    def accepts(self, event: Event) -> bool:
        return isinstance(event, PolicyVersion) and (self.trusted is None or self.trusted(event))

    def apply(self, event: Event) -> None:
        assert isinstance(event, PolicyVersion)
        self.found.append(event)

    def in_force(self) -> list[PolicyVersion]:
        """The one in force first (the last publication), then the ones before it.

        Publication order is log order: every version is keyed ``policy``, so the topic
        holds them on one partition, in the order they were published. The sender's
        timestamp is not used: it is the sender's to write, and a forged announcement
        dated in the future would otherwise stay "in force" at every restart, whatever the
        learner published after it."""
        return list(reversed(self.found))


def metrics_rows(log: RunFold) -> list[dict]:
    """One JSON row per policy version and per evaluation (namespaced metric names)."""
    rows = []
    for v in log.versions:
        rows.append({"kind": "policy-version", "version": v.version, "ts": v.ts,
                     "charts/env_steps_trained": v.env_steps, "reason": v.reason,
                     **{k: val for k, val in v.metrics.items() if k != "final"}})
    for e in log.evals:
        rows.append({"kind": "eval", "version": e.policy_version, "ts": e.ts,
                     "eval/success_rate": e.success_rate, "eval/mean_score": e.mean_score,
                     "eval/mean_length": e.mean_length, "eval/episodes": e.episodes})
    rows.sort(key=lambda r: r["ts"])
    return rows


#: parts the training episodes are cut into, in the order they ended
EPISODE_PARTS = 4


def training_episodes(segments: list[SegmentClosed]) -> list[dict]:
    """Each finished training episode, in the order it ended, from its segments: length,
    milestones reached (on a task that pays its score points as milestones, the score),
    won, lost (ended by the game, not the cap), failed (an environment failure) and the
    policy version that acted its last segment first."""
    by_trajectory: dict[str, list[SegmentClosed]] = {}
    for seg in segments:
        by_trajectory.setdefault(seg.trajectory_id, []).append(seg)
    episodes = []
    for segs in by_trajectory.values():
        last = next((s for s in segs if s.trajectory_done), None)
        if last is None:
            continue  # still running when the log ends
        episodes.append({"ts": last.ts, "length": max(s.step_end for s in segs),
                         "milestones": sum(len(s.milestones) for s in segs),
                         "won": last.success, "lost": last.lost, "failed": bool(last.failure),
                         "version": last.min_policy_version})
    return sorted(episodes, key=lambda e: e["ts"])


def training_parts(segments: list[SegmentClosed], parts: int = EPISODE_PARTS) -> list[dict]:
    """The training episodes in ``parts`` consecutive groups (by when they ended): whether
    the policy got better at the task it trains on, in figures a long task moves (mean
    milestones, losses, length) even while it wins none."""
    episodes = training_episodes(segments)
    if not episodes:
        return []
    size = -(-len(episodes) // parts)
    rows = []
    for start in range(0, len(episodes), size):
        part = episodes[start : start + size]
        n = len(part)
        rows.append({"episodes": f"{start}-{start + n - 1}",
                     "versions": f"{min(e['version'] for e in part)}-"
                                 f"{max(e['version'] for e in part)}",
                     "won": sum(e["won"] for e in part), "of": n,
                     "lost": sum(e["lost"] for e in part),
                     "failed": sum(e["failed"] for e in part),
                     "mean_milestones": round(sum(e["milestones"] for e in part) / n, 3),
                     "mean_length": round(sum(e["length"] for e in part) / n, 1)})
    return rows


def summarize(log: RunFold, wall_seconds: float) -> dict:
    first = log.evals[0] if log.evals else None
    last = log.evals[-1] if log.evals else None
    span = max(log.step_last_ts - log.step_first_ts, 1e-9)
    return {
        "initial_success": first.success_rate if first else None,
        "final_success": last.success_rate if last else None,
        "initial_score": first.mean_score if first else None,
        "final_score": last.mean_score if last else None,
        "final_eval_version": last.policy_version if last else None,
        "wall_seconds": round(wall_seconds, 2),
        "env_steps": log.steps,
        "env_steps_per_s": round(log.steps / span, 2),
        "policy_versions": max((v.version for v in log.versions), default=-1) + 1,
        "episodes": log.counts.episodes,
        "train_success_rate": (log.counts.successes / log.counts.episodes
                               if log.counts.episodes else None),
        # ended by an environment failure (error, timeout, abandonment): out of group
        # baselines, their last segment bootstrapped (learner.mask_failed)
        "failed_episodes": log.counts.failed_episodes,
        "failed_by_kind": dict(sorted(log.failure_kinds.items())),
        "segments": log.counts.segments,
        "dropped_stale_segments": log.counts.dropped,
        # why (``budget-spent``: in flight when the run ended, refused instead of trained)
        "dropped_by_reason": dict(sorted(log.dropped_reasons.items())),
        "max_staleness_trained": log.max_staleness_seen,
        "evals": [{"version": e.policy_version, "success": e.success_rate,
                   "score": e.mean_score} for e in log.evals],
        # the training episodes in four groups by when they ended (empty: the fold kept
        # no records, as the live monitor's does)
        "training_parts": training_parts(log.segments),
        "undecodable_records": log.read.skipped,
        "max_unconsumed": {name: seen.max_unconsumed for name, seen in sorted(log.actors.items())},
    }
