"""Episodes survive a sampler crash: a restarted sampler rebuilds and continues them.

The sampler runs through a real embedded bus; it is stopped mid-episode (every slot in the
middle of a 200-step episode), a new incarnation with the same name starts on the same log,
and each open trajectory must go on as the same trajectory: same id and task, step indices
contiguous, nothing published twice, the context the original would have had. When the
environment does not replay the same (a nondeterministic one that claims to be
rebuildable, or a tampered hash), the episode ends with an ``env-error`` naming the step.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_events
from gyre_async.core.resumption import UnfinishedTrajectories
from gyre_async.core.rollout import LoggedStep, rebuild_episode
from gyre_async.core.segment_context import resolve_trajectory
from gyre_async.envs import register_env
from gyre_async.envs.base import EnvFailure, StepResult, observation_hash
from gyre_async.envs.workshop import WorkshopEnv
from gyre_async.policy.context import ContextBuilder
from gyre_async.policy.tokenizer import WordTokenizer
from schemas import encode, event_id
from schemas.events import EnvError, PolicyVersion, TrajectoryStep
from schemas.topics import ALL_TOPICS, POLICY_VERSION, TRAJECTORY_STEP

MAX_STEPS = 200


class DriftingWorkshop(WorkshopEnv):
    """The workshop, except that from step 4 on its observations carry the generation of
    the process that built it: it claims to be rebuildable, but a restarted sampler's
    replay differs from the log at step 3 (the fourth step)."""

    generation = 0

    def __init__(self, **config):
        super().__init__(**config)
        self.born = DriftingWorkshop.generation
        self.t = 0

    async def reset(self, task_id: str, seed: int) -> str:
        self.t = 0
        return await super().reset(task_id, seed)

    async def step(self, action: str) -> StepResult:
        self.t += 1
        result = await super().step(action)
        if self.t >= 4 and self.born:
            return StepResult(**{**result.__dict__, "observation": result.observation + " ."})
        return result


register_env("drifting-workshop", DriftingWorkshop)


def _version(cfg, tmp_path, version: int, consumed: int) -> PolicyVersion:
    from gyre_async.compose import build_policy, build_tokenizer, save_weights
    from gyre_async.storage.checkpoints import CheckpointStore

    ref = save_weights(CheckpointStore(str(tmp_path / "checkpoints")),
                       build_policy(cfg, build_tokenizer(cfg)), version)
    return PolicyVersion(event_id=event_id("pv", version), run_id=cfg.run.run_id,
                         producer="learner", key="policy", version=version,
                         checkpoint=ref.address, checkpoint_hash=ref.sha256,
                         reason="init" if version == 0 else "update", consumed_steps=consumed)


async def _steps_of(bus) -> list[TrajectoryStep | EnvError]:
    return [e async for _, e in read_events(bus, [TRAJECTORY_STEP], on_bad="raise")]


async def _incarnation(cfg, bus, *, until, timeout_s: float = 300.0):
    """Run one sampler incarnation named ``sampler`` until ``until(core)`` holds; stop it
    at once (its slots are cancelled mid-episode, its outbox flushed) and return its core."""
    from actors.sampler import Sampler
    from gyre_async.runtime.actor import ActorRunner

    sampler = Sampler(cfg)
    runner = ActorRunner(sampler, bus, run_id=cfg.run.run_id, name="sampler", partitions=1,
                         heartbeat_s=30, stop_grace_s=0.0)
    task = asyncio.create_task(runner.run())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await until(sampler.core) and not task.done() and loop.time() < deadline:
        await asyncio.sleep(0.02)
    runner.stop()
    await task
    return sampler.core


def _by_trajectory(events) -> dict[str, list[TrajectoryStep]]:
    out: dict[str, list[TrajectoryStep]] = defaultdict(list)
    for e in events:
        if isinstance(e, TrajectoryStep):
            out[e.trajectory_id].append(e)
    return out


@pytest.mark.parametrize("context", ["window", "segment"])
def test_a_restarted_sampler_continues_the_episodes_its_predecessor_left_open(tmp_path, tiny,
                                                                              context):
    policy = ({"history_turns": 2} if context == "window" else
              {"context": "segment", "context_tokens": 160})  # segment contexts: one per segment
    cfg = tiny.config(run={"run_dir": str(tmp_path)}, policy=policy,
                      sampler={"num_envs": 3, "flush_interval_s": 0.05},
                      task={"env_config": {"n_orders": 40, "max_steps": MAX_STEPS}})

    async def go():
        async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
            await bus.create_topics(ALL_TOPICS, 1)
            v0 = _version(cfg, tmp_path, 0, consumed=0)
            await bus.publish(POLICY_VERSION, [(v0.key.encode(), encode(v0))])

            async def mid_episode(core):  # every slot ~10 steps into its first episode, in
                # the log: the stop has no grace, so what the outbox still held may be lost
                return len(await _steps_of(bus)) >= 3 * 10

            first = await _incarnation(cfg, bus, until=mid_episode)
            before = await _steps_of(bus)
            # the learner moved on: the gate opens wide for the new incarnation
            v1 = _version(cfg, tmp_path, 1, consumed=100_000)
            await bus.publish(POLICY_VERSION, [(v1.key.encode(), encode(v1))])
            open_ids = set(_by_trajectory(before))

            async def resumed_all_ended(core):  # ... and one episode of its own begun
                steps = await _steps_of(bus)
                ended = {e.trajectory_id for e in steps
                         if isinstance(e, EnvError)
                         or (isinstance(e, TrajectoryStep) and (e.done or e.truncated))}
                own = any(isinstance(e, TrajectoryStep) and e.trajectory_id not in open_ids
                          for e in steps if e.trajectory_id.split("-")[1] == core.incarnation)
                return open_ids <= ended and own

            second = await _incarnation(cfg, bus, until=resumed_all_ended)
            return first, second, before, await _steps_of(bus)

    first, second, before, after = asyncio.run(go())
    open_before = _by_trajectory(before)
    assert len(open_before) == 3 and first.episodes == 3, "every slot mid-episode at the stop"
    assert all(not s.done and not s.truncated for steps in open_before.values() for s in steps)
    assert second.rebuilt_episodes == 3 and second.rebuild_mismatches == 0
    assert second.abandoned_episodes == 0
    assert not [e for e in after if isinstance(e, EnvError)]
    # nothing published twice: one event per (trajectory, step index), one per event id
    ids = [e.event_id for e in after]
    assert len(ids) == len(set(ids))
    all_steps = _by_trajectory(after)
    for tid, old in open_before.items():
        steps = sorted(all_steps[tid], key=lambda s: s.step_index)
        indices = [s.step_index for s in steps]
        assert indices == list(range(len(steps))), f"{tid}: step indices {indices[:5]}.."
        assert steps[-1].truncated and len(steps) == MAX_STEPS  # played on to the cap
        assert {s.task_id for s in steps} == {old[0].task_id}  # same task, same GRPO group
        assert {s.producer for s in steps} == {"sampler"}
        assert steps[0].reset_hash and all(s.observation_hash for s in steps)
        last_old = max(old, key=lambda s: s.step_index)
        first_new = steps[last_old.step_index + 1]
        # the continuation acts on the context the original would have had next
        assert first_new.context_tokens == last_old.next_context_tokens
        assert first_new.context_prefix == last_old.next_context_prefix
        # ... whole: every step's context resolves against the one before it, across the
        # restart too (a segment context rebuilt token for token)
        resolved = resolve_trajectory(steps)
        assert len(resolved) == len(steps)
        assert resolved[last_old.step_index + 1].context_tokens == \
            resolved[last_old.step_index].next_context_tokens
        assert first_new.policy_version == 1 and last_old.policy_version == 0
    # segment contexts grow by appending (window contexts never do); whether the first step
    # after the restart continues one or opens a new one depends on where the stop fell,
    # and either way it matches what the original would have done (asserted above)
    grew = any(s.context_prefix > 0 for steps in all_steps.values() for s in steps)
    assert grew == (context == "segment")
    # the new incarnation's own episodes start after the rebuilt ones, under new ids
    assert {tid.split("-")[1] for tid in all_steps} == {first.incarnation, second.incarnation}
    assert second.stats()["rebuilt_episodes"] == 3.0


def test_a_replay_that_differs_from_the_log_ends_the_episode_naming_the_step(tmp_path, tiny):
    cfg = tiny.config(run={"run_dir": str(tmp_path)},
                      sampler={"num_envs": 2, "flush_interval_s": 0.05},
                      task={"env": "drifting-workshop",
                            "env_config": {"n_orders": 40, "max_steps": MAX_STEPS}})

    async def go():
        async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
            await bus.create_topics(ALL_TOPICS, 1)
            v0 = _version(cfg, tmp_path, 0, consumed=100_000)
            await bus.publish(POLICY_VERSION, [(v0.key.encode(), encode(v0))])

            async def mid_episode(core):  # in the log (see the test above)
                return len(await _steps_of(bus)) >= 2 * 10

            DriftingWorkshop.generation = 0
            await _incarnation(cfg, bus, until=mid_episode)
            before = await _steps_of(bus)
            DriftingWorkshop.generation = 1  # "another process": the replay drifts

            async def ended(core):
                return core.rebuild_mismatches + core.rebuilt_episodes >= 2

            second = await _incarnation(cfg, bus, until=ended)
            return second, before, await _steps_of(bus)

    second, before, after = asyncio.run(go())
    open_before = _by_trajectory(before)
    assert len(open_before) == 2
    assert second.rebuild_mismatches == 2 and second.rebuilt_episodes == 0
    errors = {e.trajectory_id: e for e in after if isinstance(e, EnvError)}
    assert set(errors) == set(open_before)
    for tid, error in errors.items():
        assert error.reason == "rebuild-mismatch"
        assert error.message.startswith("rebuild-mismatch at step 3:"), error.message
        assert error.step_index == len(open_before[tid])  # ends where the log stops
    # nothing was published for them after the mismatch
    assert {tid: len(s) for tid, s in _by_trajectory(after).items() if tid in open_before} \
        == {tid: len(s) for tid, s in open_before.items()}


def _replay_log(seed: int, actions: list[str]):
    async def play():
        env = WorkshopEnv(n_orders=5, max_steps=50)
        first = await env.reset("workshop:1", seed)
        logged = []
        for action in actions:
            result = await env.step(action)
            logged.append(LoggedStep(action, observation_hash(result.observation)))
        return observation_hash(first), logged

    return asyncio.run(play())


@pytest.fixture
def builder():
    from gyre_async.envs.workshop import VOCAB

    return ContextBuilder(WordTokenizer(VOCAB), 64, 2)


def test_rebuild_replays_the_log_and_names_the_first_step_that_differs(builder):
    actions = ["chop tree", "mine rock", "smelt ore", "wait", "cut stone", "craft"]
    reset_hash, logged = _replay_log(7, actions)

    def rebuild(reset, steps):
        return asyncio.run(rebuild_episode(WorkshopEnv(n_orders=5, max_steps=50), "workshop:1",
                                           7, reset, steps, builder, step_timeout_s=5))

    state = rebuild(reset_hash, logged)
    assert not isinstance(state, EnvFailure)
    assert state.next_step == len(actions)
    assert [a for _, a in state.history] == actions[-2:]  # the recent turns, as played
    tampered = [*logged[:2], LoggedStep(logged[2].action_text, "0" * 16), *logged[3:]]
    failure = rebuild(reset_hash, tampered)
    assert isinstance(failure, EnvFailure) and failure.reason == "rebuild-mismatch"
    assert failure.message.startswith("rebuild-mismatch at step 2:")
    at_reset = rebuild("f" * 16, logged)
    assert isinstance(at_reset, EnvFailure) and "at reset" in at_reset.message
    # another seed is another episode: its first observation already differs
    other_seed = asyncio.run(rebuild_episode(WorkshopEnv(n_orders=5, max_steps=50),
                                             "workshop:1", 8, reset_hash, logged, builder,
                                             step_timeout_s=5))
    assert isinstance(other_seed, EnvFailure) and other_seed.reason == "rebuild-mismatch"


def _step(tid: str, i: int, *, hashed: bool = True, task: str = "workshop:5", **kw):
    return TrajectoryStep(event_id=event_id("s", tid, i), run_id="t", producer="sampler",
                          key=tid, trajectory_id=tid, task_id=task, step_index=i,
                          policy_version=0, context_tokens=[1], action_tokens=[2],
                          action_logprobs=[-0.1], action_text=f"a{i}",
                          observation_hash=f"h{i}" if hashed else "",
                          reset_hash="r" if hashed and i == 0 else "", **kw)


def test_open_episodes_say_what_rebuilding_needs_or_why_it_cannot_be_done():
    unfinished = UnfinishedTrajectories()
    for event in [_step("ok", 0), _step("ok", 1), _step("ok", 1),         # redelivered
                  _step("gap", 0), _step("gap", 2),                        # step 1 lost
                  _step("old", 0, hashed=False), _step("old", 1, hashed=False),
                  _step("other", 0, task="gym:CartPole-v1:3"),
                  _step("ended", 0), _step("ended", 1, truncated=True)]:
        unfinished.fold(event)
    episodes = {e.trajectory_id: e for e in unfinished.open_episodes("workshop")}
    assert set(episodes) == {"ok", "gap", "old", "other"}
    ok = episodes["ok"]
    assert (ok.seed, ok.reset_hash, ok.next_step, ok.unrebuildable) == (5, "r", 2, "")
    assert [s.action_text for s in ok.steps] == ["a0", "a1"]
    assert episodes["gap"].unrebuildable == "step 1 is not in the log"
    assert "no observation hashes" in episodes["old"].unrebuildable
    assert "not one of environment 'workshop'" in episodes["other"].unrebuildable
    ending = episodes["gap"].abandoned("t", "sampler")
    assert (ending.step_index, ending.reason) == (3, "abandoned")
    assert ending.message.startswith("abandoned: the sampler restarted mid-episode (step 1")
    assert unfinished.steps == 2 + 3 + 2 + 1 + 2


def test_macro_steps_are_replayed_at_the_level_they_were_logged(builder):
    """A logged step that called a macro is replayed by calling the macro again (the
    wrapper expands it as it did: a sequence, or a script reading the observations)."""
    from gyre_async.envs.macros import MacroEnv
    from gyre_async.envs.workshop_macros import workshop_macros

    def env():
        return MacroEnv(WorkshopEnv(n_orders=5, max_steps=80), workshop_macros(), 16)

    actions = ["gather_axe", "smelt ore", "wait_furnace", "craft", "gather_lamp", "chop tree"]

    async def play():
        played = env()
        assert played.rebuildable
        first = await played.reset("workshop:2", 2)
        logged, primitives = [], 0
        for action in actions:
            result = await played.step(action)
            logged.append(LoggedStep(action, observation_hash(result.observation)))
            primitives += len(result.info.get("primitives", ())) or 1
        assert primitives > len(actions)  # the macros expanded into several env steps
        return observation_hash(first), logged

    reset_hash, logged = asyncio.run(play())
    state = asyncio.run(rebuild_episode(env(), "workshop:2", 2, reset_hash, logged, builder,
                                        step_timeout_s=5))
    assert not isinstance(state, EnvFailure) and state.next_step == len(actions)


class FrozenWorkshop(WorkshopEnv):
    """The workshop, declared not rebuildable (as an env with hidden randomness would be)."""

    rebuildable = False


register_env("frozen-workshop", FrozenWorkshop)


def test_an_env_that_cannot_be_rebuilt_keeps_the_visible_abandoned_ending(tiny):
    from gyre_async.core.rollout import ActionBatcher
    from gyre_async.core.sampler import SamplerCore, _Run

    cfg = tiny.config(task={"env": "frozen-workshop"})
    unfinished = UnfinishedTrajectories()
    for i in range(3):
        unfinished.fold(_step("sampler-x-0", i, task="frozen-workshop:5"))
    [episode] = unfinished.open_episodes("frozen-workshop")
    assert episode.unrebuildable == ""  # the log would do: the environment will not

    async def go():
        core = SamplerCore.from_config(cfg)
        published = []
        shared = _Run("sampler", published.append, asyncio.Event(),
                      ActionBatcher(core.holder, None))
        await core._resume(FrozenWorkshop(), shared, episode)
        return core, published

    core, published = asyncio.run(go())
    [ending] = published
    assert isinstance(ending, EnvError) and ending.reason == "abandoned"
    assert (ending.trajectory_id, ending.step_index) == ("sampler-x-0", 3)
    assert "'frozen-workshop' is not rebuildable" in ending.message
    assert (core.abandoned_episodes, core.rebuilt_episodes) == (1, 0)
