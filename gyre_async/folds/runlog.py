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
from schemas.events import PolicyVersion
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
        "undecodable_records": log.read.skipped,
        "max_unconsumed": {name: seen.max_unconsumed for name, seen in sorted(log.actors.items())},
    }
