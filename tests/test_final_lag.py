"""The end of a run, read from the bus: how far behind each consumer group is."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_role_cores import step

from gyre_async.bus import open_bus
from gyre_async.folds.final_lag import final_lag, within_bound
from gyre_async.runtime.actor import Actor, ActorRunner
from gyre_async.runtime.loop import run_loop
from gyre_async.ui.run_outputs import write_run_outputs
from schemas import encode
from schemas.topics import POLICY_VERSION, TRAJECTORY_STEP


def test_final_lag_counts_uncommitted_records_and_their_steps(tmp_path):
    async def scenario():
        async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
            await bus.create_topics([TRAJECTORY_STEP, POLICY_VERSION], 1)
            steps = [step("a", i) for i in range(10)]
            await bus.publish(TRAJECTORY_STEP, [(b"a", encode(s)) for s in steps])
            consumer = await bus.consumer("g", [TRAJECTORY_STEP])
            await consumer.commit({(TRAJECTORY_STEP, 0): 7})
            await consumer.close()
            return await final_lag(bus, {"g": [TRAJECTORY_STEP], "idle": [TRAJECTORY_STEP]})

    lags = asyncio.run(scenario())
    assert lags["g"] == {"lag": 3, "steps": 3, "topics": {TRAJECTORY_STEP: 3}}
    assert lags["idle"]["lag"] == 10 and lags["idle"]["steps"] == 10  # never committed
    assert within_bound(lags, batch_steps=10) and not within_bound(lags, batch_steps=9)


@pytest.mark.parametrize("stop", ["final-version", pytest.param("wall-clock", marks=pytest.mark.slow)])
def test_tiny_run_ends_with_every_group_within_one_learner_batch(tiny, stop):
    # stopped by the learner's last version, or mid-training by the wall clock
    cfg = tiny.config() if stop == "final-version" else \
        tiny.config(loop={"max_wall_s": 25.0}, learner={"max_versions": 0})
    summary = write_run_outputs(cfg, asyncio.run(run_loop(cfg)))
    on_disk = json.loads((tiny.tmp_path / "run" / "summary.json").read_text())
    assert on_disk["final_lag"] == summary["final_lag"]
    lags = summary["final_lag"]
    groups = {f"{cfg.run.run_id}.{role}" for role in
              ("sampler", "segmenter", "arbiter", "learner", "evaluator", "keeper")}
    assert groups <= set(lags), lags
    assert summary["final_lag_bound_steps"] == cfg.learner.batch_steps
    assert summary["final_lag_within_bound"] is True, lags
    # the run drains before it ends: the segmenter cuts its open segments and the learner
    # refuses its partial batch (budget-spent), so the core loop holds nothing. The keeper
    # is not drained (it may still publish, e.g. a kept copy after the last evaluation,
    # once the learner has caught up), so the learner is held to its data-flow input
    for role in ("segmenter", "arbiter"):
        assert lags[f"{cfg.run.run_id}.{role}"]["lag"] == 0, lags
    assert lags[f"{cfg.run.run_id}.learner"]["topics"]["scored"] == 0, lags
    assert summary["drain_seconds"] > 0
    assert set(summary["max_unconsumed"]) >= {"segmenter", "arbiter", "learner"}


class _HoldsEverything(Actor):
    """Handles every step but keeps it in memory: never lets the runtime commit past it."""

    role = "holder"
    consumes = (TRAJECTORY_STEP,)

    def commit_floor(self):
        return {(TRAJECTORY_STEP, 0): 0}


def test_caught_up_tells_handled_but_held_input_from_unhandled_input(tmp_path):
    async def scenario():
        async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
            await bus.create_topics([TRAJECTORY_STEP], 1)
            runner = ActorRunner(_HoldsEverything(), bus, run_id="t", partitions=1)
            await bus.publish(TRAJECTORY_STEP, [(b"a", encode(step("a", i))) for i in range(5)])
            assert await runner.unconsumed() == 5  # nothing fetched yet: committed offset 0
            task = asyncio.create_task(runner.run())
            for _ in range(200):
                if await runner.caught_up():
                    break
                await asyncio.sleep(0.05)
            held, unconsumed = await bus.lag(runner.group, [TRAJECTORY_STEP]), \
                await runner.unconsumed()
            runner.stop()
            await task
            return held, unconsumed, runner.processed

    held, unconsumed, processed = asyncio.run(scenario())
    assert (held, unconsumed, processed) == (5, 0, 5)


class _HoldsUntilOtherPartition(Actor):
    """Holds partition 0 back until a record of partition 1 arrives (as a batched write
    that goes out while the batch brought other partitions' records)."""

    role = "holder"
    consumes = (TRAJECTORY_STEP,)

    def __init__(self):
        self.released = False

    async def handle(self, event, record):
        if record.partition == 1:
            self.released = True
        return []

    def commit_floor(self):
        return {} if self.released else {(TRAJECTORY_STEP, 0): 0}


def test_a_held_partition_is_committed_when_its_floor_lifts_in_another_partitions_batch(
        tmp_path):
    from gyre_async.bus.base import partition_for
    keys = [f"k{i}" for i in range(40)]
    on = {p: next(k for k in keys if partition_for(k.encode(), 2) == p) for p in (0, 1)}

    async def scenario():
        async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
            await bus.create_topics([TRAJECTORY_STEP], 2)
            runner = ActorRunner(_HoldsUntilOtherPartition(), bus, run_id="t", partitions=2)
            task = asyncio.create_task(runner.run())

            async def handled(tp, n):
                for _ in range(200):
                    if runner.position.get(tp, 0) >= n:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"{tp} not handled")

            await bus.publish(TRAJECTORY_STEP, [(on[0].encode(), encode(step(on[0], i)))
                                                for i in range(5)])
            await handled((TRAJECTORY_STEP, 0), 5)
            held = await bus.committed(runner.group, TRAJECTORY_STEP)
            await bus.publish(TRAJECTORY_STEP, [(on[1].encode(), encode(step(on[1], 0)))])
            await handled((TRAJECTORY_STEP, 1), 1)
            await asyncio.sleep(0.3)
            after = await bus.committed(runner.group, TRAJECTORY_STEP)
            runner.stop()
            await task
            return held, after

    held, after = asyncio.run(scenario())
    assert held.get(0, 0) == 0  # held back while the floor stood
    assert after == {0: 5, 1: 1}, after  # both: partition 0's floor lifted in partition 1's batch
