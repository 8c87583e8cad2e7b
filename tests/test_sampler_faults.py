"""A hung or failing environment ends only its own trajectory, visibly (env-error)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_topics
from gyre_async.envs import register_env
from gyre_async.envs.base import MAX_OBSERVATION_CHARS, Env, StepResult
from gyre_async.envs.workshop import WorkshopEnv
from gyre_async.runtime.loop import run_loop
from schemas import decode
from schemas.events import EnvError, SegmentClosed, TrajectoryStep
from schemas.topics import SEGMENT_CLOSED, TRAJECTORY_STEP


class FaultyWorkshop(Env):
    """The workshop, except that some seeds hang at step 5, others raise at step 3, and
    others answer step 4 with an over-long observation."""

    def __init__(self, **config):
        self.inner = WorkshopEnv(**config)
        self.max_steps = self.inner.max_steps
        self.seed = 0
        self.t = 0

    async def reset(self, task_id: str, seed: int) -> str:
        self.seed, self.t = seed, 0
        return await self.inner.reset(task_id, seed)

    async def step(self, action: str) -> StepResult:
        self.t += 1
        if self.seed % 3 == 0 and self.t == 5:
            await asyncio.sleep(3600)  # a hung tool call
        if self.seed % 3 == 1 and self.t == 3:
            raise RuntimeError("tool crashed")
        result = await self.inner.step(action)
        if self.seed % 6 == 2 and self.t == 4:
            return dataclasses.replace(result, observation="x" * (MAX_OBSERVATION_CHARS + 1))
        return result


register_env("faulty-workshop", FaultyWorkshop)


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_hung_and_crashing_envs_end_only_their_trajectory(tmp_path, tiny):
    cfg = tiny.config(run={"run_dir": str(tmp_path)}, task={"env": "faulty-workshop"},
                      sampler={"step_timeout_s": 0.3},
                      loop={"max_env_steps": 640, "max_wall_s": 90},  # steps, not seconds: load-proof
                      learner={"max_versions": 0})
    asyncio.run(run_loop(cfg,
                         roles=("sampler", "segmenter", "arbiter", "learner")))

    async def read():
        async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
            done = await bus.committed("tiny.segmenter", TRAJECTORY_STEP)
            return [(r, decode(r.topic, r.value)) for r in
                    await read_topics(bus, [TRAJECTORY_STEP, SEGMENT_CLOSED])], done

    records, done = asyncio.run(read())
    events = [e for _, e in records]
    errors = [e for _, e in records if isinstance(e, EnvError)]
    consumed_errors = [e for r, e in records if isinstance(e, EnvError)
                       and r.offset < done.get(r.partition, 0)]
    steps = [e for e in events if isinstance(e, TrajectoryStep)]
    segments = [e for e in events if isinstance(e, SegmentClosed)]
    kinds = {e.kind for e in errors}
    assert {"timeout", "exception", "oversized-observation"} <= kinds, kinds
    assert any("observation of" in e.message and "limit" in e.message for e in errors
               if e.kind == "oversized-observation")
    assert any("tool crashed" in e.message for e in errors)
    # healthy trajectories kept going well past the faulty ones' failure points
    assert max(s.step_index for s in steps) > 20
    # each failed trajectory was closed as ended (truncated), none left dangling
    assert consumed_errors
    for err in consumed_errors:
        mine = [s for s in segments if s.trajectory_id == err.trajectory_id]
        if any(s.trajectory_id == err.trajectory_id for s in steps):
            assert mine and mine[-1].boundary == "trajectory-end" and not mine[-1].success


async def test_restarted_sampler_ends_trajectories_its_predecessor_left_open(tmp_path, tiny,
                                                                              scratch_bus):
    from actors.sampler import Sampler
    from schemas import event_id
    from schemas.topics import TRAJECTORY_STEP as TOPIC

    cfg = tiny.config(run={"run_dir": str(tmp_path)})

    def step(tid, i, done=False):
        return TrajectoryStep(event_id=event_id("s", tid, i), run_id="tiny", producer="sampler",
                              key=tid, trajectory_id=tid, task_id="t", step_index=i,
                              policy_version=0, context_tokens=[1], action_tokens=[2],
                              action_logprobs=[-0.1], done=done)

    events = [step("sampler-old-0", 0), step("sampler-old-0", 1),   # left open
              step("sampler-old-1", 0), step("sampler-old-1", 1, done=True),
              step("other-x-0", 0)]                                  # not ours
    scratch_bus.partitions = 4  # as a run has them (the bus's and the runner's default)
    await scratch_bus.publish(TOPIC, *events)
    await scratch_bus.run(Sampler(cfg), lambda: False, 3, name="sampler")  # for 3 s
    errors = [e for e in await scratch_bus.events(TOPIC) if isinstance(e, EnvError)]
    assert [(e.trajectory_id, e.step_index) for e in errors] == [("sampler-old-0", 2)]
    assert "abandoned" in errors[0].message


def test_a_sampler_stopped_at_the_staleness_gate_leaves_no_exception_unretrieved(tmp_path, tiny):
    """Stopping a sampler whose slots all wait at the staleness gate cancels them; every task
    (and gather) it started must be awaited to its end, or asyncio reports "exception was
    never retrieved" with a CancelledError traceback (once at the end of every ``gyre run``)."""
    import gc

    from actors.sampler import Sampler
    from gyre_async.compose import build_policy, build_tokenizer, save_weights
    from gyre_async.runtime.actor import ActorRunner
    from gyre_async.storage.checkpoints import CheckpointStore
    from schemas import encode, event_id
    from schemas.events import PolicyVersion
    from schemas.topics import ALL_TOPICS, POLICY_VERSION

    cfg = tiny.config(run={"run_dir": str(tmp_path)})
    ref = save_weights(CheckpointStore(str(tmp_path / "checkpoints")),
                       build_policy(cfg, build_tokenizer(cfg)), 0)
    v0 = PolicyVersion(event_id=event_id("pv", 0), run_id="tiny", producer="learner",
                       key="policy", version=0, checkpoint=ref.address,
                       checkpoint_hash=ref.sha256, reason="init")

    async def go() -> tuple[list[str], bool]:
        reported: list[str] = []
        asyncio.get_running_loop().set_exception_handler(
            lambda _, context: reported.append(str(context.get("message"))))
        async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
            await bus.create_topics(ALL_TOPICS, 1)
            await bus.publish(POLICY_VERSION, [(v0.key.encode(), encode(v0))])
            sampler = Sampler(cfg)
            runner = ActorRunner(sampler, bus, run_id="tiny", name="sampler", partitions=1,
                                 heartbeat_s=30, stop_grace_s=0.2)
            task = asyncio.create_task(runner.run())
            core = sampler.core

            def every_slot_at_the_gate() -> bool:  # no learner progress: the gate closes
                return core.at_gate == cfg.sampler.num_envs

            for _ in range(600):
                if every_slot_at_the_gate() or task.done():
                    break
                await asyncio.sleep(0.1)
            gate_closed = every_slot_at_the_gate()
            await asyncio.sleep(0.3)
            runner.stop()
            await task
            gc.collect()
            await asyncio.sleep(0)
        return reported, gate_closed

    reported, gate_closed = asyncio.run(go())
    assert gate_closed, "the sampler never filled the staleness gate"
    assert reported == []
