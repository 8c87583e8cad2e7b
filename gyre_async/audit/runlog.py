"""The run's output files (``metrics.jsonl``, the learning-curve plot); the reading half of
the run log moved to :mod:`gyre_async.folds.runlog` (its names stay here only until their
last caller moves)."""

from __future__ import annotations

import json
import os

from gyre_async.folds.run_fold import RunFold
from gyre_async.folds.runlog import (  # noqa: F401
    current_policy_version,
    load_runlog,
    metrics_rows,
    policy_versions_in_force,
    summarize,
)


def write_metrics(log: RunFold, path: str) -> None:
    with open(path, "w") as f:
        for row in metrics_rows(log):
            f.write(json.dumps(row) + "\n")


def plot_learning_curve(log: RunFold, path: str, title: str = "Gyre learning curve") -> None:
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
