"""The evaluator publishes each result as soon as it exists, not once per fetched batch.

Outputs of a batch go out together (publish-and-commit), so an evaluator that fetched
several policy versions used to hold the first result until the last evaluation finished;
the keeper's regression checks and ``gyre run``'s stop-at-target waited on it. With
``Evaluator.max_batch = 1`` the first result is on the bus while the second evaluation is
still running. Real embedded bus, real checkpoints, real evaluations.
"""

from __future__ import annotations

import asyncio
import time

from actors.evaluator import Evaluator
from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_topics
from gyre_async.compose import build_policy, build_tokenizer, save_weights
from gyre_async.runtime.actor import ActorRunner
from gyre_async.storage.checkpoints import CheckpointStore
from schemas import decode, encode, event_id
from schemas.events import PolicyVersion
from schemas.topics import ALL_TOPICS, EVAL, POLICY_VERSION


async def _scenario(cfg, url: str) -> tuple[int, int]:
    """Publish v0 and v1 first, then run the evaluator; (evals seen at first sight, at end)."""
    store = CheckpointStore(f"{cfg.run.run_dir}/checkpoints")
    policy = build_policy(cfg, build_tokenizer(cfg))
    async with open_bus(url) as bus:
        await bus.create_topics(ALL_TOPICS, cfg.bus.partitions)
        for version in (0, 1):
            ref = save_weights(store, policy, version, {"run_id": cfg.run.run_id})
            pv = PolicyVersion(
                event_id=event_id("policy-version", cfg.run.run_id, version), run_id=cfg.run.run_id,
                producer="learner", key="policy", version=version, checkpoint=ref.address,
                checkpoint_hash=ref.sha256, parent=version - 1 if version else None,
                reason="update" if version else "init", learning_rate=1e-3, env_steps=0)
            await bus.publish(POLICY_VERSION, [(pv.key.encode(), encode(pv))])
        runner = ActorRunner(Evaluator(cfg), bus, run_id=cfg.run.run_id)
        task = asyncio.create_task(runner.run())
        try:
            deadline = time.monotonic() + 300
            first_sight = 0
            while time.monotonic() < deadline:
                evals = [decode(EVAL, r.value) for r in await read_topics(bus, [EVAL])]
                if evals and not first_sight:
                    first_sight = len(evals)
                if len(evals) >= 2:
                    return first_sight, len(evals)
                assert not task.done(), task.exception()
                await asyncio.sleep(0.02)
            raise AssertionError("the evaluator did not publish two results in 300 s")
        finally:
            runner.stop()
            await task


def test_each_evaluation_is_published_when_it_finishes(tmp_path, tiny):
    cfg = tiny.config(run={"run_id": "evalpub"},
                      evaluator={"every_versions": 1, "episodes": 32, "greedy": False})
    first_sight, total = asyncio.run(_scenario(cfg, f"sqlite:///{tmp_path}/events.db"))
    assert total == 2
    assert first_sight == 1, "both results appeared together: they were held for the batch"
