"""Elite pool (dedup, eviction, persistence, mixing) and retention of ordinary segments."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_async.bus import open_bus
from gyre_async.experience.elite import (
    KIND_SUCCESS,
    KIND_TURNING,
    EliteEntry,
    ElitePool,
    evictions,
    offer_trained,
    value_jump,
)
from gyre_async.experience.retention import Retention, disk_use, incoming_bytes
from gyre_async.storage.segments import SegmentStore
from schemas import encode
from schemas.events import PolicyVersion, Scored, SegmentDropped
from schemas.topics import ALL_TOPICS, POLICY_VERSION, TELEMETRY


def segment(seed: int, steps: int = 8) -> dict[str, np.ndarray]:
    """Arrays shaped like the segmenter's (what the learner and the pool read)."""
    rng = np.random.default_rng(seed)
    return {
        "context_tokens": rng.integers(1, 70, (steps, 64)).astype(np.int32),
        "context_len": np.full(steps, 64, np.int32),
        "action_tokens": rng.integers(8, 70, (steps, 3)).astype(np.int32),
        "action_logprobs": -rng.random((steps, 3)).astype(np.float32),
        "action_mask": np.ones((steps, 3), np.uint8),
        "policy_version": np.full(steps, seed % 5, np.int32),
        "feedback": np.zeros(steps, np.float32),
        "step_index": np.arange(steps, dtype=np.int64),
        "bootstrap_context": rng.integers(1, 70, (1, 64)).astype(np.int32),
        "bootstrap_len": np.array([64], np.int32),
        "terminal": np.array([1], np.uint8),
    }


def scored_for(sid: str, arrays, content_hash: str, success: bool) -> Scored:
    n = len(arrays["step_index"])
    rewards = [0.0] * (n - 1) + [1.0 if success else 0.0]
    return Scored(event_id=f"s-{sid}", run_id="t", producer="arbiter", segment_id=sid,
                  trajectory_id=f"traj-{sid}", task_id="workshop:1", address=f"x#{sid}",
                  content_hash=content_hash, step_start=0, step_end=n, min_policy_version=0,
                  trajectory_done=True, success=success, components={}, step_rewards=rewards,
                  total=sum(rewards), decided_by="outcome")


class Item:  # what the learner hands the pool: .scored, .arrays, .steps
    def __init__(self, scored, arrays):
        self.scored, self.arrays, self.steps = scored, arrays, len(arrays["step_index"])


def offered(store: SegmentStore, seeds, success=True, flat_values=True):
    items = []
    for s in seeds:
        arrays = segment(s)
        ref = store.write(f"seg-{s}", arrays)
        items.append(Item(scored_for(f"seg-{s}", arrays, ref.content_hash, success), arrays))
    values = []
    for it in items:
        values += [0.0] * it.steps if flat_values else [0.0, 0.5] * (it.steps // 2)
    return items, values


# -- elite pool -----------------------------------------------------------------------------
def test_elite_pool_dedups_bounds_and_survives_restart(tmp_path):
    source = SegmentStore(str(tmp_path / "segments.zarr"), durable=False)
    url = str(tmp_path / "elite.zarr")
    pool = ElitePool(url, capacity=4, jump_threshold=0.25, mix_share=0.5, seed=3)
    items, values = offered(source, range(3))
    assert len(offer_trained(pool, items, values)) == 3
    # The same content offered again, under another segment id too: stored once.
    dup = Item(scored_for("other-id", items[0].arrays, items[0].scored.content_hash, True),
               items[0].arrays)
    assert offer_trained(pool, [*items, dup], values + values[:8]) == []
    assert len(pool.store.list_segments()) == 3
    # Flat values and a failed trajectory: neither a success nor a turning point.
    boring, flat = offered(source, [10], success=False)
    assert offer_trained(pool, boring, flat) == []
    # A failed segment whose value jumps by 0.5 between steps is a turning point.
    turning, jumpy = offered(source, [11], success=False, flat_values=False)
    assert offer_trained(pool, turning, jumpy) == [turning[0].scored.content_hash]
    assert pool.entries[turning[0].scored.content_hash].kind == KIND_TURNING
    # Two more successes overflow capacity 4: the turning point goes first, then the oldest.
    more, more_values = offered(source, [20, 21])
    offer_trained(pool, more, more_values)
    kept = {i.scored.content_hash for i in items[1:] + more}
    assert set(pool.hashes()) == kept and pool.evicted == 2
    assert set(pool.store.list_segments()) == kept  # evictions reach the store
    # Restart: a new pool on the same store has the same entries, kinds and order.
    again = ElitePool(url, capacity=4, jump_threshold=0.25, mix_share=0.5, seed=3)
    assert again.hashes() == pool.hashes() and again.entries == pool.entries
    # Mixing: about mix_share of the fresh steps, rewards and behaviour log-probs as stored,
    # never an entry whose content is in the fresh batch.
    fresh = more[:1]
    picks = again.sample(16, version=7, exclude={more[0].scored.content_hash})
    assert picks and sum(s.step_end - s.step_start for s, _ in picks) >= 8
    for scored, arrays in picks:
        assert scored.content_hash != fresh[0].scored.content_hash
        assert scored.segment_id.startswith("elite:") and scored.success
        src = next(i for i in items + more if i.scored.content_hash == scored.content_hash)
        assert scored.step_rewards == src.scored.step_rewards
        np.testing.assert_array_equal(arrays["action_logprobs"], src.arrays["action_logprobs"])
    assert [s.segment_id for s, _ in again.sample(16, 7)] == \
        [s.segment_id for s, _ in again.sample(16, 7)]


def slow_evictions(entries, capacity):
    out, left = [], list(entries)
    while len(left) > capacity:
        for kind in (KIND_TURNING, KIND_SUCCESS):
            of_kind = [e for e in left if e.kind == kind]
            if of_kind:
                oldest = min(of_kind, key=lambda e: e.seq)
                out.append(oldest)
                left.remove(oldest)
                break
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([KIND_TURNING, KIND_SUCCESS]), st.booleans()),
                max_size=20), st.integers(1, 8))
def test_evictions_match_slow_rule(kinds, capacity):
    entries = [EliteEntry(f"h{i}", k, i, 0.0, 4) for i, (k, _) in enumerate(kinds)]
    random.Random(len(entries)).shuffle(entries)
    assert sorted(e.seq for e in evictions(entries, capacity)) == \
        sorted(e.seq for e in slow_evictions(entries, capacity))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-5, 5), max_size=30))
def test_value_jump_matches_loop(values):
    slow = max((abs(values[t + 1] - values[t]) for t in range(len(values) - 1)), default=0.0)
    assert abs(value_jump(values) - slow) < 1e-9


# -- retention --------------------------------------------------------------------------------
async def publish(bus, topic, event):
    await bus.publish(topic, [(event.key.encode(), encode(event))])


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_retention_keeps_disk_under_bound_and_never_deletes_needed(tmp_path):
    """Rounds of writes far beyond the bound; the learner consumes with a lag of two rounds
    (buffered, unscored), drops some segments, and never trains others."""
    store = SegmentStore(str(tmp_path / "segments.zarr"), durable=False)
    control = SegmentStore(str(tmp_path / "control.zarr"), durable=False)  # no retention

    async def run():
        async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
            await bus.create_topics(ALL_TOPICS, 2)
            bound = 800_000
            retention = Retention(store, bound)
            written, peak, rounds = 0, 0, []
            never_consumed = set()
            for r in range(50):
                batch = [(f"seg-{r}-{i}", segment(r * 100 + i, steps=32)) for i in range(8)]
                await retention.follow(bus)
                retention.make_room(incoming_bytes(batch))
                store.write_many(batch)
                control.write_many(batch)
                written += incoming_bytes(batch)
                peak = max(peak, disk_use(store))
                ids = [sid for sid, _ in batch]
                if r < 3:  # e.g. segments of a trajectory that never gets scored
                    never_consumed.add(ids[-1])
                    ids = ids[:-1]
                rounds.append(ids)
                if r >= 2:  # the learner trains round r-2 (rounds r-1, r are still needed)
                    trained, dropped = rounds[r - 2][:-1], rounds[r - 2][-1]
                    await publish(bus, TELEMETRY, SegmentDropped(
                        event_id=f"d{r}", run_id="t", producer="learner", key=dropped,
                        segment_id=dropped, reason="stale", staleness=3))
                    await publish(bus, POLICY_VERSION, PolicyVersion(
                        event_id=f"v{r}", run_id="t", producer="learner", key="policy",
                        version=r - 1, checkpoint="c", checkpoint_hash="h",
                        trained_segments=trained))
                needed = set(rounds[-1]) | set(rounds[-2] if len(rounds) > 1 else []) \
                    | set(rounds[-3] if len(rounds) > 2 else []) | never_consumed
                live = set(store.list_segments())
                assert needed <= live, f"round {r}: deleted {needed - live}"
            return written, peak, retention

    written, peak, retention = asyncio.run(run())
    assert disk_use(control) > 2 * 800_000  # without retention: twice the bound ...
    assert peak <= 800_000  # ... and the store never held more
    assert retention.stats.deleted > 0 and retention.stats.over_bound == 0
    for sid in store.list_segments():  # whatever is left reads back intact
        store.read(store.address(sid))


def test_retention_refuses_to_delete_what_is_needed(tmp_path):
    """A bound smaller than the unconsumed data: nothing is deleted, the shortfall counted."""
    store = SegmentStore(str(tmp_path / "segments.zarr"), durable=False)

    async def run():
        async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
            await bus.create_topics(ALL_TOPICS, 2)
            retention = Retention(store, 10_000)
            for r in range(3):
                batch = [(f"seg-{r}", segment(r, steps=16))]
                await retention.follow(bus)
                retention.make_room(incoming_bytes(batch))
                store.write_many(batch)
            return retention

    retention = asyncio.run(run())
    assert len(store.list_segments()) == 3 and retention.stats.deleted == 0
    assert retention.stats.over_bound >= 1
