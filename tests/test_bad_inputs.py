"""Rows of the bad-input matrix that no other test file covers.

Each row ends in a clear error or a dead letter / announced drop with the reason, and the
actor goes on (or stops cleanly, saying how to fix it):

- an unknown event type on a topic -> dead letter naming the type;
- NaN/inf in rewards, log-probs or values -> never reaches ``optimizer.step``: NaN rewards
  are dead-lettered at decode; NaN log-probs read from the segment store and NaN values
  from a diverged policy make the learner refuse the batch with ``segment-dropped`` events
  whose reason names the field, the weights untouched;
- a full disk -> the segment and checkpoint writers raise an error naming the path and the
  fix, and nothing half-written is visible to readers.

The full matrix, row by row, is in ``docs/RELIABILITY.md``.
"""

from __future__ import annotations

import asyncio
import math
import time

import msgspec
import numpy as np
import pytest
import torch
from conftest import TinyConfig
from scratch import run_until

from actors.echo import EchoActor
from actors.learner import Learner
from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_topics
from gyre_async.core.learner import LearnerCore
from gyre_async.core.segmenter import ClosedSegment, segment_arrays
from gyre_async.rl.finite import NonFiniteBatch
from gyre_async.runtime.actor import ActorRunner
from gyre_async.storage.segments import SegmentStore
from schemas import decode, encode, event_id
from schemas.config import EchoConfig
from schemas.events import PolicyVersion, Scored, SegmentDropped, TrajectoryStep
from schemas.topics import (
    DEAD_LETTER,
    POLICY_VERSION,
    PROBE_IN,
    PROBE_OUT,
    SCORED,
    TELEMETRY,
)

# -- unknown event type ----------------------------------------------------------------------

async def test_unknown_event_type_is_dead_lettered_naming_it(tmp_path):
    async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
        await bus.create_topics([PROBE_IN, PROBE_OUT, DEAD_LETTER], 1)
        unknown = msgspec.msgpack.encode({"type": "teleport", "schema_version": 1,
                                          "event_id": "x1", "run_id": "t", "producer": "p"})
        await bus.publish(PROBE_IN, [(b"k", unknown)])
        runner = ActorRunner(EchoActor(EchoConfig()), bus, run_id="t", heartbeat_s=30)
        task = asyncio.create_task(runner.run())
        deadline = time.monotonic() + 30
        while runner.dead_letters < 1 and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.05)
        runner.stop()
        await task
        dead = [decode(DEAD_LETTER, r.value) for r in await read_topics(bus, [DEAD_LETTER])]
    assert len(dead) == 1 and dead[0].original == unknown
    assert "teleport" in dead[0].reason and "$.type" in dead[0].reason, dead[0].reason


# -- NaN / inf never reach the optimizer -----------------------------------------------------

def tiny_learner_config(tiny: TinyConfig, batch_steps: int = 8):
    """The tiny config with its run directory at the test's own folder and small batches."""
    return tiny.config(run={"run_dir": str(tiny.tmp_path)},
                       learner={"batch_steps": batch_steps, "minibatch_steps": batch_steps,
                                "max_versions": 0})


def make_steps(tid: str, n: int) -> tuple[TrajectoryStep, ...]:
    return tuple(TrajectoryStep(
        event_id=event_id("s", tid, i), run_id="tiny", producer="test", key=tid,
        trajectory_id=tid, task_id="task", step_index=i, policy_version=0,
        context_tokens=[1 + (i + j) % 7 for j in range(6)], action_tokens=[25, 26],
        action_logprobs=[-1.2, -0.7], next_context_tokens=[2, 3, 4]) for i in range(n))


def store_segment(store: SegmentStore, tid: str, n: int = 4, nan_logprob: bool = False
                  ) -> Scored:
    arrays = segment_arrays(ClosedSegment(tid, make_steps(tid, n), "max-length", False))
    if nan_logprob:
        arrays["action_logprobs"][1, 0] = np.nan
    sid = event_id("segment", tid)
    ref = store.write(sid, arrays)
    return Scored(event_id=event_id("scored", sid), run_id="tiny", producer="arbiter",
                  key=tid, segment_id=sid, trajectory_id=tid, task_id="task",
                  address=ref.address, content_hash=ref.content_hash, step_start=0,
                  step_end=n, min_policy_version=0, trajectory_done=False, success=False,
                  components={"outcome": 0.0}, step_rewards=[0.5] * n, total=0.5 * n,
                  decided_by="outcome")


async def test_nan_rewards_and_logprobs_are_refused_visibly_and_learner_goes_on(tmp_path, tiny):
    cfg = tiny_learner_config(tiny)
    store = SegmentStore(str(tmp_path / "segments.zarr"))
    clean_a = store_segment(store, "traj-a")
    poisoned = store_segment(store, "traj-b", nan_logprob=True)
    clean_c, clean_d = store_segment(store, "traj-c"), store_segment(store, "traj-d")
    nan_reward = msgspec.to_builtins(store_segment(store, "traj-e"))
    nan_reward["step_rewards"][2] = math.nan
    async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
        await bus.create_topics([SCORED], 1)
        await bus.publish(SCORED, [(b"k", msgspec.msgpack.encode(nan_reward))]
                          + [(b"k", encode(s)) for s in (clean_a, poisoned, clean_c, clean_d)])
        learner = Learner(cfg)
        before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
        runner = ActorRunner(learner, bus, run_id="tiny", heartbeat_s=30, partitions=1)
        task = asyncio.create_task(runner.run())
        deadline = time.monotonic() + 60
        while learner.core.version < 1 and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.1)
        trained_weights = {k: v.clone() for k, v in learner.policy.state_dict().items()}
        runner.stop()
        await task
        dead = [decode(DEAD_LETTER, r.value) for r in await read_topics(bus, [DEAD_LETTER])]
        dropped = [e for r in await read_topics(bus, [TELEMETRY])
                   if isinstance(e := decode(TELEMETRY, r.value), SegmentDropped)]
        versions = [decode(POLICY_VERSION, r.value) for r in
                    await read_topics(bus, [POLICY_VERSION])]
    # NaN reward: refused at decode, dead-lettered with the field named
    assert len(dead) == 1 and "step_rewards" in dead[0].reason, [d.reason for d in dead]
    # NaN log-prob: the whole batch it was in is refused, announced per segment, with why
    assert {d.segment_id for d in dropped} == {clean_a.segment_id, poisoned.segment_id}, [
        (d.segment_id, d.reason[:60]) for d in dropped] or [
        d.reason for d in dropped]
    for d in dropped:
        assert "non-finite" in d.reason and "action_logprobs" in d.reason, d.reason
        assert poisoned.segment_id in d.reason and "fix:" in d.reason
    # ... and the learner went on: the next clean batch trained into version 1
    assert [v.version for v in versions if isinstance(v, PolicyVersion)] == [0, 1]
    assert versions[-1].trained_segments == [clean_c.segment_id, clean_d.segment_id]
    changed = [k for k in before if not torch.equal(before[k], trained_weights[k])]
    assert changed, "the clean batch should have moved the weights"


def test_non_finite_values_refused_before_any_optimizer_step(tmp_path, tiny):
    cfg = tiny_learner_config(tiny)
    learner = Learner(cfg)
    core: LearnerCore = learner.core
    store = SegmentStore(str(tmp_path / "segments.zarr"))
    for offset, tid in enumerate(("traj-a", "traj-b")):
        assert core.add(store_segment(store, tid), (0, offset)) is None
    core.attach_arrays(store.read_many(core.buffered_addresses()))
    with torch.no_grad():  # a diverged critic: its bias went to inf
        learner.policy._model.value_head.bias.fill_(math.inf)
    before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    steps = []
    original_step = core.optimizer.step
    core.optimizer.step = lambda *a, **k: steps.append(1) or original_step(*a, **k)
    with pytest.raises(NonFiniteBatch) as info:
        core.train()
    assert "values" in info.value.reason and "fix:" in info.value.reason
    assert sorted(info.value.segment_ids) == sorted(
        event_id("segment", t) for t in ("traj-a", "traj-b"))
    assert steps == []  # optimizer.step never ran
    after = learner.policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# -- a corrupted Zarr chunk, a checkpoint with a wrong hash ------------------------------------

async def test_corrupt_segment_is_refused_and_the_rest_of_its_batch_trains(tmp_path, tiny,
                                                                           scratch_bus):
    cfg = tiny_learner_config(tiny, batch_steps=12)
    store = SegmentStore(str(tmp_path / "segments.zarr"))
    clean = [store_segment(store, t) for t in ("traj-a", "traj-b")]
    # a segment alone in its own arrays (wider context), whose chunks then rot on disk
    steps = make_steps("traj-x", 4)
    wide = tuple(msgspec.structs.replace(s, context_tokens=[1 + j % 7 for j in range(40)])
                 for s in steps)
    ref = store.write(event_id("segment", "traj-x"),
                      segment_arrays(ClosedSegment("traj-x", wide, "max-length", False)))
    rotten = msgspec.structs.replace(clean[0], event_id="x", segment_id=event_id("segment", "traj-x"),
                                     trajectory_id="traj-x", address=ref.address,
                                     content_hash=ref.content_hash)
    chunks = list((tmp_path / "segments.zarr" / "arrays" / "context_tokens").glob("int32_64/c/**/*"))
    assert chunks
    for chunk in (c for c in chunks if c.is_file()):
        chunk.write_bytes(b"\x00garbage" * 8)
    more = store_segment(store, "traj-c")
    await scratch_bus.publish(SCORED, *clean, rotten, more, key=b"k")
    learner = Learner(cfg)
    await scratch_bus.run(learner, lambda: learner.core.version >= 1)
    dropped = [e for e in await scratch_bus.events(TELEMETRY) if isinstance(e, SegmentDropped)]
    versions = await scratch_bus.events(POLICY_VERSION)
    assert [d.segment_id for d in dropped] == [rotten.segment_id]
    assert rotten.segment_id in dropped[0].reason and "unreadable" in dropped[0].reason
    assert "corrupt" in dropped[0].reason, dropped[0].reason
    assert versions[-1].version == 1
    assert versions[-1].trained_segments == [s.segment_id for s in (*clean, more)]


async def test_policy_version_with_wrong_hash_is_dead_lettered_by_the_sampler(tmp_path, tiny,
                                                                             scratch_bus):
    from actors.sampler import Sampler
    from gyre_async.policy.factory import save_weights
    from gyre_async.storage.checkpoints import CheckpointStore

    cfg = tiny_learner_config(tiny)
    sampler = Sampler(cfg)
    ref = save_weights(CheckpointStore(str(tmp_path / "checkpoints")), sampler.holder.policy, 0,
                       {"run_id": "tiny"})
    bad = PolicyVersion(event_id=event_id("pv", 0), run_id="tiny", producer="learner",
                        key="policy", version=0, checkpoint=ref.address,
                        checkpoint_hash="0" * 64, reason="init")
    runner = scratch_bus.runner(sampler)
    task = asyncio.create_task(run_until(runner, lambda: runner.dead_letters >= 1, 30))
    await asyncio.sleep(1.0)  # running, waiting for a policy
    await scratch_bus.publish(POLICY_VERSION, bad)
    await task
    dead = await scratch_bus.dead_letters()
    assert len(dead) == 1 and "does not match expected" in dead[0].reason, dead
    assert "0" * 64 in dead[0].reason and "fix:" in dead[0].reason
    assert sampler.holder.version == -1  # it never acted with the unverified weights


# -- redelivery after a lost commit (Kafka's publish-then-commit window) -----------------------

async def test_restarted_learner_does_not_train_redelivered_segments_again(tmp_path, tiny):
    """A learner that published version 1 and died before committing its inputs gets them
    again; it must not put them in a second batch. The lost commit is made real by
    deleting the group's committed offsets from the embedded log."""
    import sqlite3

    cfg = tiny_learner_config(tiny)
    store = SegmentStore(str(tmp_path / "segments.zarr"))
    first = [store_segment(store, t) for t in ("traj-a", "traj-b")]
    url = f"sqlite:///{tmp_path}/events.db"
    async with open_bus(url) as bus:
        await bus.create_topics([SCORED], 1)
        await bus.publish(SCORED, [(b"k", encode(s)) for s in first])
        learner = Learner(cfg)
        runner = ActorRunner(learner, bus, run_id="tiny", heartbeat_s=30, partitions=1)
        await run_until(runner, lambda: learner.core.version >= 1)
    with sqlite3.connect(tmp_path / "events.db") as db:
        assert db.execute("DELETE FROM commits WHERE grp = 'tiny.learner'").rowcount > 0
    later = [store_segment(store, t) for t in ("traj-c", "traj-d")]
    async with open_bus(url) as bus:
        await bus.publish(SCORED, [(b"k", encode(s)) for s in later])
        learner = Learner(cfg)
        runner = ActorRunner(learner, bus, run_id="tiny", heartbeat_s=30, partitions=1)
        await run_until(runner, lambda: learner.core.version >= 2, timeout=60)
        versions = [decode(POLICY_VERSION, r.value) for r in await read_topics(bus, [POLICY_VERSION])]
    assert [v.version for v in versions] == [0, 1, 2]
    assert versions[1].trained_segments == [s.segment_id for s in first]
    assert versions[2].trained_segments == [s.segment_id for s in later]
