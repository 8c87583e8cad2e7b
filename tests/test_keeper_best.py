"""The run's product: ``best.json`` and ``summary.json``'s ``final`` / ``best``.

The keeper writes the pointer as its best slot changes (tests/test_keeper_collapse.py drives
it through a real bus); these tests cover the end of ``gyre run``: the final evaluation the
keeper never judged, ties, a run without a keeper, other runs on a shared bus, and a real
tiny run whose pointer must agree with its summary and verify against its file.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from gyre_async.core.keeper_best import (
    BestVersion,
    final_and_best,
    read_best,
    settle_best,
    write_best,
)
from gyre_async.runtime.loop import run_loop
from gyre_async.storage.checkpoints import CheckpointStore
from gyre_async.storage.urls import normalize_store_url
from gyre_async.ui.run_outputs import write_run_outputs
from schemas import event_id
from schemas.events import EvalResult, PolicyVersion


def version(v: int, run_id: str = "r") -> PolicyVersion:
    return PolicyVersion(event_id=event_id("pv", run_id, v), run_id=run_id, producer="learner",
                         key="policy", version=v, checkpoint=f"ckpt/v{v}",
                         checkpoint_hash=f"h{v}", parent=v - 1 if v else None,
                         reason="update" if v else "init", learning_rate=1e-3)


def evaluation(v: int, success: float, score: float, run_id: str = "r") -> EvalResult:
    return EvalResult(event_id=event_id("eval", run_id, v, success), run_id=run_id,
                      producer="evaluator", key="eval", policy_version=v, episodes=32,
                      success_rate=success, mean_score=score, mean_length=50.0)


def kept(v: int, success: float, score: float) -> BestVersion:
    return BestVersion(run_id="r", version=v, success_rate=success, mean_score=score,
                       episodes=32, checkpoint=f"keeper/v{v}", checkpoint_hash=f"k{v}",
                       source_checkpoint=f"ckpt/v{v}", source_checkpoint_hash=f"h{v}",
                       chosen_by="keeper")


VERSIONS = [version(v) for v in range(6)]


def test_the_keepers_choice_stands_when_the_last_version_is_worse(tmp_path):
    write_best(str(tmp_path), kept(2, 0.84, 0.95))
    evals = [evaluation(0, 0.0, 0.4), evaluation(2, 0.84, 0.95), evaluation(4, 0.22, 0.72),
             evaluation(5, 0.28, 0.75)]
    best = settle_best(str(tmp_path), "r", evals, VERSIONS)
    assert best == kept(2, 0.84, 0.95)
    summary = final_and_best("r", evals, VERSIONS, best)
    assert summary["final"] == {"version": 5, "success": 0.28, "score": 0.75, "episodes": 32,
                                "checkpoint": "ckpt/v5", "checkpoint_hash": "h5"}
    assert summary["best"] == {"version": 2, "success": 0.84, "score": 0.95, "episodes": 32,
                               "checkpoint": "keeper/v2", "checkpoint_hash": "k2",
                               "chosen_by": "keeper", "pointer": "best.json"}
    json.dumps(summary)  # goes into summary.json as is
    on_disk = json.loads((tmp_path / "best.json").read_text())  # plain JSON for any reader
    assert {"version", "checkpoint", "checkpoint_hash", "success_rate"} <= set(on_disk)


def test_a_final_evaluation_the_keeper_never_judged_can_become_the_best(tmp_path):
    write_best(str(tmp_path), kept(2, 0.84, 0.95))
    # equal to the keeper's choice: the keeper's copy stays (ties go to what stood first)
    assert settle_best(str(tmp_path), "r", [evaluation(5, 0.84, 0.95)], VERSIONS).version == 2
    # strictly better (success, then score): the learner's checkpoint of v5, pointer rewritten
    best = settle_best(str(tmp_path), "r", [evaluation(2, 0.84, 0.95),
                                            evaluation(5, 0.84, 0.97)], VERSIONS)
    assert best is not None and (best.version, best.chosen_by) == (5, "run end")
    assert (best.checkpoint, best.checkpoint_hash) == ("ckpt/v5", "h5")
    assert read_best(str(tmp_path), "r") == best
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]  # written atomically


def test_without_a_keeper_the_best_evaluation_is_chosen_and_other_runs_are_ignored(tmp_path):
    evals = [evaluation(1, 0.5, 0.8), evaluation(3, 0.5, 0.8), evaluation(4, 0.3, 0.7),
             evaluation(2, 0.9, 0.99, run_id="other")]  # another run on a shared bus
    versions = [*VERSIONS, version(2, run_id="other")]
    best = settle_best(str(tmp_path), "r", evals, versions)
    assert best is not None and (best.version, best.chosen_by) == (1, "run end")  # the earlier
    summary = final_and_best("r", evals, versions, best)
    assert summary["final"]["version"] == 4 and summary["best"]["version"] == 1
    write_best(str(tmp_path), kept(3, 0.6, 0.9))
    assert read_best(str(tmp_path), "another-run") is None  # a pointer is one run's
    assert settle_best(str(tmp_path / "none"), "r", [], VERSIONS) is None
    assert final_and_best("r", [], VERSIONS, None) == {"final": None, "best": None}


def test_an_unreadable_pointer_is_ignored_and_replaced(tmp_path):
    (tmp_path / "best.json").write_text("{not json")
    assert read_best(str(tmp_path), "r") is None
    best = settle_best(str(tmp_path), "r", [evaluation(1, 0.5, 0.8)], VERSIONS)
    assert read_best(str(tmp_path), "r") == best


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_a_real_tiny_run_hands_over_its_best_validated_version(tiny):
    """``gyre run`` on the tiny config, its last update poisoned (1000x the learning rate at
    v4, the final version) so that the run ends below an earlier version: ``best.json``
    agrees with ``summary.json``, names an earlier version than ``final``, ranks at least
    as high as every evaluation of the run, and names weights that verify. One order per
    task, so that validation is not all zeros (the untrained policy succeeds about half the
    time); 8 episodes, so that the keeper's rule sees noise and does not roll back."""
    cfg = tiny.config(task={"env_config": {"n_orders": 1, "max_steps": 80}},
                      learner={"fault_lr_spike_version": 4, "fault_lr_spike_factor": 1000.0},
                      evaluator={"every_versions": 1, "episodes": 8, "greedy": False})
    summary = write_run_outputs(cfg, asyncio.run(run_loop(cfg)))
    run_dir = tiny.tmp_path / "run"
    on_disk = json.loads((run_dir / "summary.json").read_text())
    pointer = read_best(str(run_dir), cfg.run.run_id)
    assert pointer is not None and on_disk["best"] == summary["best"]
    assert summary["best"]["version"] == pointer.version
    assert summary["best"]["checkpoint_hash"] == pointer.checkpoint_hash
    assert summary["final"]["version"] == summary["final_eval_version"]
    assert summary["final"]["success"] == summary["final_success"]
    assert summary["final"]["version"] == 4 and pointer.version < 4
    assert pointer.success_rate > summary["final"]["success"], summary["evals"]
    ranks = [(e["success"], e["score"]) for e in summary["evals"]]
    assert (pointer.success_rate, pointer.mean_score) == max(ranks)
    assert (pointer.success_rate, pointer.mean_score) >= \
        (summary["final"]["success"], summary["final"]["score"])
    _, local = normalize_store_url(pointer.checkpoint)
    assert local is not None
    tensors, _meta = CheckpointStore(str(local.parent)).load(pointer.checkpoint,
                                                              pointer.checkpoint_hash)
    assert tensors
