"""A segment the arbiter withholds (a reward component failed) is never trained, but it
still ends its trajectory: in sync mode the learner's one-episode-per-slot count must not
wait for a verdict that will never come."""

from __future__ import annotations

import msgspec
from scratch import run_until
from test_bad_inputs import store_segment, tiny_learner_config

from actors.learner import Learner
from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_topics
from gyre_async.runtime.actor import ActorRunner
from gyre_async.storage.segments import SegmentStore
from schemas import decode, encode, event_id
from schemas.events import PolicyVersion, RewardFailed
from schemas.topics import POLICY_VERSION, SCORED


async def test_withheld_final_segment_ends_its_episode_in_sync_mode(tmp_path, tiny):
    cfg = tiny_learner_config(tiny, batch_steps=10_000)  # only episode ends can trigger
    r = msgspec.structs.replace
    cfg = r(cfg, run=r(cfg.run, mode="sync"), sampler=r(cfg.sampler, num_envs=2))
    store = SegmentStore(str(tmp_path / "segments.zarr"))
    finished = r(store_segment(store, "traj-a"), trajectory_done=True)
    withheld = store_segment(store, "traj-b")
    failed = RewardFailed(event_id=event_id("reward-failed", withheld.segment_id, "prm"),
                          run_id="tiny", producer="arbiter", key="traj-b",
                          segment_id=withheld.segment_id, component="prm",
                          reason="model file missing", trajectory_id="traj-b",
                          trajectory_done=True)
    async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
        await bus.create_topics([SCORED], 1)
        await bus.publish(SCORED, [(b"a", encode(finished)), (b"b", encode(failed))])
        learner = Learner(cfg)
        runner = ActorRunner(learner, bus, run_id="tiny", heartbeat_s=30, partitions=1)
        await run_until(runner, lambda: learner.core.version >= 1, timeout=60)
        versions = [e for rec in await read_topics(bus, [POLICY_VERSION])
                    if isinstance(e := decode(POLICY_VERSION, rec.value), PolicyVersion)]
    assert [v.version for v in versions] == [0, 1]
    assert versions[-1].trained_segments == [finished.segment_id]  # the withheld one never
