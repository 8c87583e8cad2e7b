"""The run's output files, from the run fold: ``metrics.jsonl``, the TensorBoard scalars,
the learning-curve plot and ``summary.json`` (:func:`write_run_outputs`)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from gyre_async.folds.run_fold import RunFold
from gyre_async.folds.runlog import metrics_rows
from gyre_async.storage.atomic import atomic_write_text
from gyre_async.ui.tensorboard import write_tensorboard

if TYPE_CHECKING:
    from gyre_async.runtime.loop import RunResult
    from schemas.config import Config


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


def write_run_outputs(cfg: Config, result: RunResult) -> dict:
    """``gyre run``'s files from the run's result, in its run directory: ``metrics.jsonl``,
    the TensorBoard scalars, ``learning_curve.png`` and ``summary.json`` (written atomically:
    ``gyre report`` and the benches read it back). Returns the summary."""
    run_dir = cfg.run.run_dir
    write_metrics(result.runlog, os.path.join(run_dir, "metrics.jsonl"))
    write_tensorboard(metrics_rows(result.runlog), run_dir)  # for `tensorboard --logdir`
    plot_learning_curve(result.runlog, os.path.join(run_dir, "learning_curve.png"),
                        title=f"Gyre run {cfg.run.run_id} ({cfg.run.mode})")
    atomic_write_text(os.path.join(run_dir, "summary.json"),
                      json.dumps(result.summary, indent=2))
    return result.summary
