"""What a run's event log says: metrics, summary and the learning-curve plot.

Everything here is derived from the recorded events (no side channel), so the same code
serves a finished run, a live one and a replayed Kafka archive.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from schemas import DecodeError, decode
from schemas.events import (
    EvalResult, Heartbeat, PolicyVersion, Scored, SegmentClosed, SegmentDropped, TrajectoryStep,
)
from schemas.topics import EVAL, POLICY_VERSION, SCORED, SEGMENT_CLOSED, TELEMETRY, TRAJECTORY_STEP

from gyre_async.bus import Bus
from gyre_async.bus.reading import iter_topics
from gyre_async.envs.macros import env_steps_of


@dataclass
class RunLog:
    versions: list[PolicyVersion] = field(default_factory=list)
    evals: list[EvalResult] = field(default_factory=list)
    segments: list[SegmentClosed] = field(default_factory=list)
    scored: list[Scored] = field(default_factory=list)
    dropped: list[SegmentDropped] = field(default_factory=list)
    heartbeats: list[Heartbeat] = field(default_factory=list)
    steps: int = 0
    step_first_ts: float = 0.0
    step_last_ts: float = 0.0
    episodes: int = 0
    successes: int = 0


async def load_runlog(bus: Bus, *, with_steps: bool = True) -> RunLog:
    log = RunLog()
    topics = [POLICY_VERSION, EVAL, SEGMENT_CLOSED, SCORED, TELEMETRY]
    if with_steps:
        topics.append(TRAJECTORY_STEP)
    known = {t.name for t in await bus.topics()}
    async for record in iter_topics(bus, [t for t in topics if t in known]):
        try:
            event = decode(record.topic, record.value, 1 << 40)
        except DecodeError:
            continue
        match event:
            case PolicyVersion():
                log.versions.append(event)
            case EvalResult():
                log.evals.append(event)
            case SegmentClosed():
                log.segments.append(event)
                if event.trajectory_done:
                    log.episodes += 1
                    log.successes += int(event.success)
            case Scored():
                log.scored.append(event)
            case SegmentDropped():
                log.dropped.append(event)
            case Heartbeat():
                log.heartbeats.append(event)
            case TrajectoryStep():
                log.steps += env_steps_of(event)  # primitive env steps (macros expand)
                log.step_first_ts = min(log.step_first_ts or event.ts, event.ts)
                log.step_last_ts = max(log.step_last_ts, event.ts)
    log.versions.sort(key=lambda v: (v.ts, v.version))
    log.evals.sort(key=lambda e: (e.policy_version, e.ts))
    return log


async def current_policy_version(bus: Bus) -> PolicyVersion | None:
    """The policy in force: the last ``policy-version`` published (a rollback may lower it).

    The topic is keyed by one key, so it lives on one partition and log order is
    publication order.
    """
    latest = None
    known = {t.name for t in await bus.topics()}
    if POLICY_VERSION not in known:
        return None
    async for record in iter_topics(bus, [POLICY_VERSION]):
        try:
            event = decode(POLICY_VERSION, record.value, 1 << 40)
        except DecodeError:
            continue
        if latest is None or (event.ts, event.version) >= (latest.ts, latest.version):
            latest = event
    return latest


def metrics_rows(log: RunLog) -> list[dict]:
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


def write_metrics(log: RunLog, path: str) -> None:
    with open(path, "w") as f:
        for row in metrics_rows(log):
            f.write(json.dumps(row) + "\n")


def plot_learning_curve(log: RunLog, path: str, title: str = "Gyre learning curve") -> None:
    """Validation success and score against policy version and trained env steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps_at = {v.version: v.env_steps for v in log.versions}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    xs = [steps_at.get(e.policy_version, 0) for e in log.evals]
    axes[0].plot(xs, [e.success_rate for e in log.evals], "o-", label="validation success")
    axes[0].plot(xs, [e.mean_score for e in log.evals], "s--", label="validation score")
    axes[0].set_xlabel("env steps trained on")
    axes[0].set_ylim(-0.02, 1.02)
    axes[0].set_title("unseen tasks")
    axes[0].legend()
    axes[0].grid(alpha=0.3)
    upd = [v for v in log.versions if v.reason == "update"]
    xs = [v.version for v in upd]
    axes[1].plot(xs, [v.metrics.get("charts/mean_reward", 0.0) for v in upd], color="C0",
                 label="mean step reward")
    axes[1].set_ylabel("mean step reward", color="C0")
    axes[1].set_xlabel("policy version")
    axes[1].set_title("learner")
    axes[1].grid(alpha=0.3)
    ent = axes[1].twinx()
    ent.plot(xs, [v.metrics.get("losses/entropy", 0.0) for v in upd], color="C1",
             label="policy entropy")
    ent.set_ylabel("policy entropy (nats/token)", color="C1")
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summarize(log: RunLog, wall_seconds: float) -> dict:
    first = log.evals[0] if log.evals else None
    last = log.evals[-1] if log.evals else None
    span = max(log.step_last_ts - log.step_first_ts, 1e-9)
    staleness = [v.metrics.get("charts/max_staleness_seen", 0.0) for v in log.versions]
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
        "episodes": log.episodes,
        "train_success_rate": log.successes / log.episodes if log.episodes else None,
        "segments": len(log.segments),
        "dropped_stale_segments": len(log.dropped),
        "max_staleness_trained": max(staleness, default=0.0),
        "evals": [{"version": e.policy_version, "success": e.success_rate,
                   "score": e.mean_score} for e in log.evals],
    }
