"""The evaluator publishes each result as soon as it exists, not once per fetched batch.

Outputs of a batch go out together (publish-and-commit), so an evaluator that fetched
several policy versions used to hold the first result until the last evaluation finished;
the keeper's regression checks and ``gyre run``'s stop-at-target waited on it. With
``Evaluator.max_batch = 1`` the first result is on the bus while the second evaluation is
still running. Real embedded bus, real checkpoints, real evaluations.
"""

from __future__ import annotations

from actors.evaluator import Evaluator
from gyre_async.compose import build_policy, build_tokenizer, save_weights
from gyre_async.storage.checkpoints import CheckpointStore
from schemas import event_id
from schemas.events import PolicyVersion
from schemas.topics import EVAL, POLICY_VERSION


async def test_each_evaluation_is_published_when_it_finishes(tiny, scratch_bus):
    """Publish v0 and v1 first, then run the evaluator; count the results at first sight
    of any, and when there are two."""
    cfg = tiny.config(run={"run_id": "evalpub"},
                      evaluator={"every_versions": 1, "episodes": 32, "greedy": False})
    store = CheckpointStore(f"{cfg.run.run_dir}/checkpoints")
    policy = build_policy(cfg, build_tokenizer(cfg))
    scratch_bus.partitions = cfg.bus.partitions  # the run's topics and runner
    for version in (0, 1):
        ref = save_weights(store, policy, version, {"run_id": cfg.run.run_id})
        pv = PolicyVersion(
            event_id=event_id("policy-version", cfg.run.run_id, version), run_id=cfg.run.run_id,
            producer="learner", key="policy", version=version, checkpoint=ref.address,
            checkpoint_hash=ref.sha256, parent=version - 1 if version else None,
            reason="update" if version else "init", learning_rate=1e-3, env_steps=0)
        await scratch_bus.publish(POLICY_VERSION, pv)
    first_sight = total = 0

    async def two_results() -> bool:
        nonlocal first_sight, total
        total = len(await scratch_bus.events(EVAL))
        if total and not first_sight:
            first_sight = total
        return total >= 2

    await scratch_bus.run(Evaluator(cfg), two_results, 300, run_id=cfg.run.run_id)
    assert total == 2, "the evaluator did not publish two results in 300 s"
    assert first_sight == 1, "both results appeared together: they were held for the batch"
