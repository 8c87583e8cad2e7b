"""The learner's core without a bus: admission, the update's result, elite mixing, the
injected learning-rate fault, rollback and restart (``gyre_async.core.learner``)."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch
from test_critic import config, make_batch

from gyre_async.compose import build_policy
from gyre_async.core.learner import Dropped, LearnerCore, TrainResult
from gyre_async.experience.elite import ElitePool
from gyre_async.rl.fusion import OutcomeBook
from gyre_async.storage.checkpoints import CheckpointRef
from gyre_async.storage.segments import SegmentStore
from schemas import event_id
from schemas.events import PolicyVersion, Rollback

replace = msgspec.structs.replace
REF = CheckpointRef(address="file:///nowhere/v.safetensors", sha256="0" * 64, version=0)


def fresh_core(tmp_path, elite: ElitePool | None = None, **learner) -> LearnerCore:
    cfg = config(tmp_path)
    cfg = replace(cfg, learner=replace(cfg.learner, **learner))
    core = LearnerCore(cfg, build_policy(cfg), elite)
    core.publish("init", REF, "learner", {})  # version 0, as the actor does on start
    return core


def fill(core: LearnerCore, store: SegmentStore, batch: int, partition: int = 0):
    """Buffer one batch of real segments at offsets 10, 11, ... and attach their arrays."""
    scored = make_batch(core.cfg, core.policy, store, batch)
    for offset, segment in enumerate(scored, start=10):
        assert core.add(segment, (partition, offset)) is None
    core.attach_arrays(store.read_many(core.buffered_addresses()))
    return scored


def rollback_order(sequence: int = 1, lr: float = 1e-4) -> Rollback:
    return Rollback(event_id=event_id("rollback", sequence), run_id="spike", producer="keeper",
                    key="policy", sequence=sequence, regressed_version=2, restore_version=0,
                    slot="best", checkpoint="file:///c", checkpoint_hash="0" * 64,
                    learning_rate=lr, previous_learning_rate=3e-3, why="test")


def test_update_returns_a_typed_frozen_result_for_the_fresh_segments(tmp_path):
    core = fresh_core(tmp_path)
    store = SegmentStore(f"{tmp_path}/segments.zarr", durable=False)
    scored = fill(core, store, 1)
    assert core.batch_ready() and core.commit_floor() == {0: 10}
    result = core.update()
    assert isinstance(result, TrainResult) and not result.skipped
    assert result.trained_segments == [s.segment_id for s in scored]
    assert len(result.fusion_weights) == len(scored)
    assert len(result.advantage_digest) == 32 and int(result.advantage_digest, 16) >= 0
    assert all(isinstance(v, float) for v in result.metrics.values())
    assert result.metrics["charts/batch_segments"] == len(scored)
    assert result.metrics["charts/max_staleness_seen"] == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.skipped = True  # frozen: the update is a record, not a mutable dict
    assert core.buffer == [] and core.commit_floor() == {}
    assert core.trained_steps == sum(s.step_end - s.step_start for s in scored)
    event = core.publish("update", REF, "learner", result.metrics, result)
    assert isinstance(event, PolicyVersion) and event.version == 1 and event.parent == 0
    assert event.trained_segments == result.trained_segments
    assert event.advantage_digest == result.advantage_digest
    assert event.fusion_weights == result.fusion_weights


def test_elite_segments_join_the_batch_but_never_the_buffer_or_the_commit_floor(tmp_path):
    pool = ElitePool(f"{tmp_path}/elite.zarr", capacity=8, jump_threshold=1e-3, mix_share=0.5)
    core = fresh_core(tmp_path, pool)
    store = SegmentStore(f"{tmp_path}/segments.zarr", durable=False)
    fill(core, store, 1)
    first = core.update()
    assert isinstance(first, TrainResult) and pool.entries, "the first batch seeds the pool"
    core.publish("update", REF, "learner", first.metrics, first)
    scored = fill(core, store, 2, partition=3)
    assert core.commit_floor() == {3: 10}  # the fresh segments' own offsets, nothing else
    second = core.update()
    assert isinstance(second, TrainResult)
    mixed = second.metrics["charts/batch_segments"] - len(scored)
    assert mixed > 0 and second.metrics["elite/mixed_steps"] > 0
    assert second.trained_segments == [s.segment_id for s in scored]  # elite ones not listed
    assert len(second.fusion_weights) == len(scored)
    assert core.buffer == [] and core.commit_floor() == {}


def test_fault_spike_applies_to_its_version_only_and_is_undone(tmp_path):
    core = fresh_core(tmp_path, fault_lr_spike_version=2, fault_lr_spike_factor=10.0)
    store = SegmentStore(f"{tmp_path}/segments.zarr", durable=False)
    seen: list[float] = []
    step = core.optimizer.step
    core.optimizer.step = lambda *a, **k: seen.append(core.learning_rate) or step(*a, **k)
    base = core.learning_rate
    for batch in (1, 2):
        fill(core, store, batch)
        result = core.update()
        assert isinstance(result, TrainResult)
        core.publish("update", REF, "learner", result.metrics, result)
        assert core.learning_rate == pytest.approx(base)
        expected = base * (10.0 if batch == 2 else 1.0)
        assert seen and all(lr == pytest.approx(expected) for lr in seen)
        seen.clear()


def test_non_finite_batch_is_refused_whole_and_counted(tmp_path):
    core = fresh_core(tmp_path)
    store = SegmentStore(f"{tmp_path}/segments.zarr", durable=False)
    scored = fill(core, store, 1)
    with torch.no_grad():
        core.policy._model.value_head.bias.fill_(float("inf"))
    dropped = core.update()
    assert isinstance(dropped, list) and {d.scored.segment_id for d in dropped} == {
        s.segment_id for s in scored}
    assert all("values" in d.reason for d in dropped)
    assert core.buffer == [] and core.trained_steps == 0
    assert core.dropped_steps == sum(s.step_end - s.step_start for s in scored)


def test_rollback_gives_a_fresh_optimizer_drops_the_buffer_and_refuses_older_samples(tmp_path):
    core = fresh_core(tmp_path)
    store = SegmentStore(f"{tmp_path}/segments.zarr", durable=False)
    fill(core, store, 1)
    result = core.update()
    assert isinstance(result, TrainResult) and core.optimizer.state  # Adam moments exist
    core.publish("update", REF, "learner", result.metrics, result)
    buffered = fill(core, store, 2)
    old_optimizer = core.optimizer
    assert core.follows(rollback_order(1)) and not core.follows(rollback_order(0))
    dropped = core.rollback(rollback_order(1, lr=1e-4))
    assert [d.scored.segment_id for d in dropped] == [s.segment_id for s in buffered]
    assert {d.reason for d in dropped} == {"rolled-back"}
    assert core.optimizer is not old_optimizer and not core.optimizer.state
    assert core.learning_rate == pytest.approx(1e-4)
    assert core.buffer == [] and core.commit_floor() == {} and not core.batch_ready()
    assert core.rollbacks_applied == 1 and not core.follows(rollback_order(1))
    late = buffered[0]  # sampled by version 1, below the rollback floor (version 2)
    dropped_late = core.add(late, (0, 99))
    assert dropped_late == Dropped(late, "rolled-back", 0, dropped_late.consumed_steps)
    # consumed: everything trained, the buffer dropped by the rollback, and this late one
    assert dropped_late.consumed_steps == core.trained_steps + core.dropped_steps == (
        core.trained_steps + sum(b.step_end - b.step_start for b in buffered)
        + late.step_end - late.step_start)
    event = core.publish("rollback", REF, "learner", {})
    assert event.reason == "rollback" and event.learning_rate == pytest.approx(1e-4)
    assert event.metrics["keeper/rollbacks_applied"] == 1.0


def test_admission_refusals_are_counted(tmp_path):
    spent, running = fresh_core(tmp_path, max_versions=3), fresh_core(tmp_path)
    store = SegmentStore(f"{tmp_path}/segments.zarr", durable=False)
    scored = make_batch(running.cfg, running.policy, store, 1)  # sampled by version 0
    for core in (spent, running):
        for _ in range(5):  # now at version 5: version-0 samples are stale (max_staleness 2)
            core.publish("update", REF, "learner", {})
    steps = scored[0].step_end - scored[0].step_start
    # each refusal carries the learner's consumed count (0 trained + this drop's steps)
    assert spent.add(scored[0], (0, 0)) == Dropped(scored[0], "budget-spent", 5, steps)
    stale = running.add(scored[1], (0, 1))
    assert stale == Dropped(scored[1], "stale", 5, steps)
    assert (spent.dropped, running.dropped) == (0, 1)  # only stale drops count there
    assert spent.dropped_steps == running.dropped_steps == steps
    # ... and so does its event: the sampler's staleness gate follows it at once
    event = stale.event("learner")
    assert (event.steps, event.consumed_steps) == (steps, steps)
    assert spent.buffer == running.buffer == []


def test_restore_resumes_counters_learning_rate_and_the_checkpoint_critic(tmp_path):
    core = fresh_core(tmp_path)
    latest = PolicyVersion(event_id="pv-7", run_id="spike", producer="learner", key="policy",
                           version=7, checkpoint="file:///c", checkpoint_hash="0" * 64,
                           parent=6, learning_rate=5e-4, env_steps=900, consumed_steps=1000,
                           metrics={"keeper/rollbacks_applied": 2.0})
    book = OutcomeBook(core.cfg.sampler.group_size)
    core.restore(latest, book, {"seg-a"})
    assert (core.version, core.trained_steps, core.dropped_steps) == (7, 900, 100)
    assert core.learning_rate == pytest.approx(5e-4) and core.rollbacks_applied == 2
    assert core.outcomes is book and core.critic.initialised
    store = SegmentStore(f"{tmp_path}/segments.zarr", durable=False)
    redelivered = replace(make_batch(core.cfg, core.policy, store, 1)[0], segment_id="seg-a")
    assert core.already_trained(redelivered)
