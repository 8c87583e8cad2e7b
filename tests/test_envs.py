"""Environment API, guards, the workshop task family and the Gymnasium adapter."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import random
import re
import time
from collections import deque

import pytest

from gyre_async.envs import (
    ACTIONS,
    VOCAB,
    Env,
    EnvFailure,
    StepResult,
    WorkshopConfig,
    WorkshopEnv,
    guarded_reset,
    guarded_step,
    lower_bound_steps,
    make_env,
    oracle_action,
)
from gyre_async.envs.workshop import make_orders


async def run_episode(env: Env, policy, task_id: str = "t", seed: int = 0):
    obs = await env.reset(task_id, seed)
    trace = [obs]
    results: list[StepResult] = []
    while True:
        result = await env.step(policy(obs))
        results.append(result)
        obs = result.observation
        trace.append(obs)
        if result.over:
            return results, trace


# -- the workshop: long, solvable, not solvable by chance -----------------------------------

async def test_oracle_solves_default_config_and_it_is_long():
    cfg = WorkshopConfig()
    assert cfg.max_steps >= 200
    lengths, bounds = [], []
    for seed in range(30):
        results, trace = await run_episode(WorkshopEnv(cfg), oracle_action, seed=seed)
        assert results[-1].success and results[-1].done and results[-1].score == 1.0
        bound = lower_bound_steps(cfg, "t", seed)
        assert len(results) >= bound  # the bound is proven (see its docstring)
        lengths.append(len(results))
        bounds.append(bound)
        assert max(len(o.split()) for o in trace) <= 40
    print(f"\nworkshop default: oracle steps min {min(lengths)} mean "
          f"{sum(lengths) / len(lengths):.1f} max {max(lengths)}; proven lower bound min "
          f"{min(bounds)}; cap {cfg.max_steps}")
    assert min(bounds) >= 50, "every solution of the default config must take >= 50 steps"


def _clone(env: WorkshopEnv) -> WorkshopEnv:
    twin = copy.copy(env)
    s = env._state
    twin._state = dataclasses.replace(
        s, orders=[dataclasses.replace(o) for o in s.orders], inventory=dict(s.inventory),
        furnace=list(s.furnace), emitted=set(s.emitted))
    return twin


def _bfs_shortest(env: WorkshopEnv) -> int:
    """Exhaustive search over every admissible action: the true shortest solution."""
    def key(e: WorkshopEnv):
        s = e._state
        return (tuple(sorted(s.inventory.items())), tuple(t - s.step for t in s.furnace),
                tuple(o.made for o in s.orders))
    frontier, seen = deque([(env, 0)]), {key(env)}
    while frontier:
        node, depth = frontier.popleft()
        for action in ACTIONS:
            child = _clone(node)
            result = child.step_sync(action)
            if result.success:
                return depth + 1
            if not result.over and key(child) not in seen:
                seen.add(key(child))
                frontier.append((child, depth + 1))
    raise AssertionError("no solution found")


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
async def test_oracle_is_exactly_shortest_on_single_orders():
    cfg = WorkshopConfig(n_orders=1, max_count=2, noise_prob=0.0, max_steps=40)
    covered = set()
    for seed in range(40):
        order = make_orders(cfg, "t", seed)[0]
        if (order.item, order.count) in covered:
            continue
        covered.add((order.item, order.count))
        env = WorkshopEnv(cfg)
        await env.reset("t", seed)
        shortest = _bfs_shortest(env)
        results, _ = await run_episode(WorkshopEnv(cfg), oracle_action, seed=seed)
        assert results[-1].success and len(results) == shortest, (order, shortest, len(results))
    assert len(covered) >= 10


async def test_uniform_random_policy_rarely_succeeds():
    cfg = WorkshopConfig()  # latency is off by default
    assert cfg.latency_mean_s == 0.0
    episodes, successes, scores = 200, 0, []
    for seed in range(episodes):
        env = WorkshopEnv(cfg)
        rng = random.Random(seed)
        results, _ = await run_episode(
            env, lambda _obs, rng=rng, env=env: rng.choice(env.admissible_actions()), seed=1000 + seed)
        successes += results[-1].success
        scores.append(results[-1].score)
    rate = successes / episodes
    print(f"\nuniform random policy over admissible actions: success {rate:.1%} "
          f"({successes}/{episodes}), mean score {sum(scores) / episodes:.3f}")
    assert rate < 0.02, f"random success rate {rate:.1%} over {episodes} episodes (need < 2%)"
    assert sum(scores) > 0, "random play should still reach some milestones (RL needs signal)"


async def test_vocab_covers_every_word_and_actions():
    words = set(VOCAB)
    assert all(set(a.split()) <= words for a in ACTIONS)
    env = WorkshopEnv(WorkshopConfig(noise_prob=1.0))
    rng = random.Random(3)
    _, trace = await run_episode(env, lambda o: rng.choice(ACTIONS + ("jump", "")), seed=3)
    for obs in trace:
        assert set(obs.split()) <= words, set(obs.split()) - words


async def test_deterministic_per_seed():
    async def play(seed: int):
        env = WorkshopEnv(WorkshopConfig(latency_mean_s=1e-4))
        rng = random.Random(42)
        obs = await env.reset("task-a", seed)
        out = [obs]
        for _ in range(60):
            r = await env.step(rng.choice(ACTIONS))
            out.append((r.observation, r.feedback, r.score, r.milestones, r.info["latency_s"]))
        return out
    assert await play(7) == await play(7)
    assert await play(7) != await play(8)


async def test_milestones_once_and_proven_by_state():
    cfg = WorkshopConfig(n_orders=4)
    env = WorkshopEnv(cfg)
    obs = await env.reset("t", 5)
    names = []
    while True:
        result = await env.step(oracle_action(obs))
        obs = result.observation
        for m in result.milestones:
            names.append(m.name)
            match = re.fullmatch(r"orders\[(\d+)\]\.made=(\d+)/(\d+) inventory\.(\w+)=(\d+) "
                                 r"at step (\d+)", m.proof)
            assert match, m.proof
            i, made, count = int(match[1]), int(match[2]), int(match[3])
            order = env._state.orders[i]
            assert (order.made, order.count) == (made, count) and made == count
            assert m.name == f"craft:{order.item}#{i + 1}" and int(match[6]) == env._state.step
            assert result.info["action"] == "craft" and result.state_changed
        if result.over:
            break
    assert len(names) == len(set(names)) == cfg.n_orders
    # Read from state, not from the action: a state that proves an order pays on the next step.
    env = WorkshopEnv(cfg)
    await env.reset("t", 5)
    env._state.orders[2].made = env._state.orders[2].count
    first = await env.step("wait")
    assert [m.name for m in first.milestones] == [f"craft:{env._state.orders[2].item}#3"]
    assert (await env.step("wait")).milestones == ()


async def test_farming_pays_feedback_but_never_progress():
    cfg = WorkshopConfig(noise_prob=0.0)
    env = WorkshopEnv(cfg)
    await env.reset("t", 1)
    for _ in range(3):
        await env.step("chop tree")
    needs, score = env.needs(), 0.0
    for action in ("polish tools", "sweep floor") * 5:
        r = await env.step(action)
        assert r.feedback == pytest.approx(cfg.farm_feedback) and r.score == score
        assert env.needs() == needs and not r.milestones
    wood = env._state.inventory["wood"]
    r = await env.step("sell wood")
    assert r.feedback > 0 and env._state.inventory["wood"] == wood - 1 and r.score == score


async def test_delayed_effect_lands_after_n_steps():
    cfg = WorkshopConfig(smelt_delay=4, noise_prob=0.0)
    env = WorkshopEnv(cfg)
    await env.reset("t", 0)
    await env.step("mine rock")
    r = await env.step("smelt ore")
    assert "furnace 1" in r.observation and env._state.inventory["ingot"] == 0
    for _ in range(cfg.smelt_delay - 1):
        r = await env.step("wait")
        assert env._state.inventory["ingot"] == 0 and "furnace 1" in r.observation
    r = await env.step("wait")
    assert env._state.inventory["ingot"] == 1 and "furnace 0" in r.observation


async def test_invalid_actions_cost_a_step_and_do_nothing():
    env = WorkshopEnv(WorkshopConfig(noise_prob=0.0, max_steps=3))
    await env.reset("t", 0)
    needs = env.needs()
    r = await env.step("dance wildly")
    assert "unknown action" in r.observation and r.info["step"] == 1 and not r.info["valid"]
    assert env.needs() == needs and r.feedback == 0.0
    assert (await env.step("sell")).info["valid"] is False
    r = await env.step("chop")  # lenient parse: the verb names the action
    assert r.info["action"] == "chop tree" and r.truncated and not r.done and not r.success
    with pytest.raises(RuntimeError):
        await env.step("wait")


def test_latency_is_lognormal_and_seeded():
    cfg = WorkshopConfig(latency_mean_s=0.2, latency_sigma=1.0)
    a, b = WorkshopEnv(cfg), WorkshopEnv(cfg)
    asyncio.run(a.reset("t", 3))
    asyncio.run(b.reset("t", 3))
    draws = [a._draw_latency() for _ in range(4000)]
    assert draws[:50] == [b._draw_latency() for _ in range(50)]
    mean = sum(draws) / len(draws)
    assert 0.15 < mean < 0.25 and max(draws) > 5 * sorted(draws)[len(draws) // 2]  # long tail
    with pytest.raises(ValueError, match="n_orders"):
        WorkshopConfig(n_orders=0)


def test_registry():
    env = make_env("workshop", n_orders=3)
    assert isinstance(env, WorkshopEnv) and env.config.n_orders == 3
    with pytest.raises(ValueError, match="unknown environment"):
        make_env("nope")


# -- guards -----------------------------------------------------------------------------------

class FaultyEnv(Env):
    max_steps = 10

    def __init__(self, mode: str):
        self.mode = mode

    async def reset(self, task_id: str, seed: int) -> str:
        if self.mode == "raise-reset":
            raise RuntimeError("reset exploded")
        return "hello"

    async def step(self, action: str) -> StepResult:
        if self.mode == "hang":
            await asyncio.Event().wait()  # never set: sleeps forever
        if self.mode == "raise":
            raise ValueError("tool crashed: disk full")
        return StepResult(observation="x" * 100_000, feedback=0.0, done=False,
                          truncated=False, success=False, score=0.0)


async def test_hung_env_times_out_while_another_env_proceeds():
    hung = FaultyEnv("hang")
    good = WorkshopEnv(WorkshopConfig(latency_mean_s=0.05, latency_sigma=0.1))
    await good.reset("t", 0)
    finished: dict[str, float] = {}
    start = time.monotonic()

    async def timed(name, coro):
        out = await coro
        finished[name] = time.monotonic() - start
        return out

    bad, ok = await asyncio.gather(timed("hung", guarded_step(hung, "wait", timeout_s=0.5)),
                                   timed("good", guarded_step(good, "chop tree", timeout_s=5)))
    assert isinstance(bad, EnvFailure) and bad.kind == "timeout" and "0.5s" in bad.message
    assert isinstance(ok, StepResult) and ok.info["valid"]
    assert finished["good"] < 0.4 < finished["hung"] < 1.5


async def test_a_cancel_that_comes_as_the_step_finishes_is_not_swallowed():
    """The caller of a step that has just finished is cancelled (a sampler being stopped):
    the cancellation ends it. (Python 3.11's ``asyncio.wait_for`` returned the step's
    result and dropped the cancellation; a slot then played on to its staleness gate and
    its sampler never stopped.)"""
    gate = asyncio.Event()  # never opens: only the cancellation ends the slot

    async def slot() -> None:
        await guarded_step(FaultyEnv("ok"), "wait", timeout_s=5)
        await gate.wait()

    task = asyncio.create_task(slot())
    for _ in range(2):  # the slot starts its step, the step finishes
        await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=1)
    assert done and task.cancelled()


async def test_exception_and_oversized_observation_are_reported():
    failure = await guarded_step(FaultyEnv("raise"), "wait", timeout_s=1)
    assert failure == EnvFailure("exception", "step raised ValueError: tool crashed: disk full")
    failure = await guarded_step(FaultyEnv("big"), "wait", timeout_s=1)
    assert failure.kind == "oversized-observation" and "100000" in failure.message
    failure = await guarded_reset(FaultyEnv("raise-reset"), "t", 0, timeout_s=1)
    assert failure.kind == "exception" and "reset exploded" in failure.message
    assert await guarded_reset(FaultyEnv("ok"), "t", 0, timeout_s=1) == "hello"


# -- Gymnasium adapter ------------------------------------------------------------------------

def _corridor_class(gym):
    class Corridor(gym.Env):
        """Walk right from cell 0 or 1 to cell 3; text observations, named Discrete actions."""

        def __init__(self):
            self.observation_space = gym.spaces.Text(max_length=64, charset="acehlt0123 ")
            self.action_space = gym.spaces.Discrete(3)
            self.pos = 0

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.pos = int(self.np_random.integers(0, 2))
            return f"at cell {self.pos}", {}

        def step(self, action):
            self.pos = max(0, self.pos + (-1, 1, 0)[action])
            done = self.pos == 3
            return f"at cell {self.pos}", float(done), done, False, {"is_success": done}

    return Corridor


async def test_gym_adapter_text_env():
    import gymnasium as gym  # a test dependency: missing it must fail, not skip

    from schemas.events import Milestone

    gym.register(id="GyreCorridor-v0", entry_point=_corridor_class(gym), max_episode_steps=20)
    env = make_env("gym:GyreCorridor-v0", action_names=["left", "right", "stay"],
                   milestone_fn=lambda e, info: [Milestone(name=f"cell:{c}", proof=f"pos={c}")
                                                for c in (2,) if e.unwrapped.pos >= c])
    assert env.max_steps == 20 and env.admissible_actions() == ["left", "right", "stay"]
    obs = await env.reset("corridor", seed=0)
    assert obs.startswith("at cell")
    bad = await env.step("fly")
    assert not bad.info["valid"] and bad.observation == obs and bad.feedback == 0.0
    milestones = []
    for _ in range(5):
        r = await guarded_step(env, " Right ", timeout_s=5)
        milestones += [m.name for m in r.milestones]
        if r.over:
            break
    assert r.done and r.success and r.feedback == 1.0 and milestones == ["cell:2"]
    await env.close()
    with pytest.raises(ValueError, match="parse_action"):
        from gyre_async.envs.gym_adapter import GymTextEnv

        box_env = gym.make("GyreCorridor-v0")
        box_env.unwrapped.action_space = gym.spaces.Box(0, 1, (1,))
        GymTextEnv(box_env.unwrapped)


def _signals_class(gym):
    class Signals(gym.Env):
        """Atari-style names (``get_action_meanings``), milestones read from its state."""

        def __init__(self):
            self.observation_space = gym.spaces.Text(max_length=64, charset="abcdeghilnorstuw ")
            self.action_space = gym.spaces.Discrete(3)
            self.presses = 0

        def get_action_meanings(self):
            return ["NOOP", "Go-Left", "FIRE"]

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.presses = 0
            return "the light is on", {}

        def step(self, action):
            self.presses += int(action == 2)
            return "the light is on", 0.0, self.presses >= 2, False, {}

        def milestones(self):
            return {"fired": f"presses={self.presses}"} if self.presses else {}

    return Signals


def first_name(info, terminated):  # a "module:function" success_fn for the test below
    return bool(terminated)


async def test_gym_adapter_names_from_env_snap_hint_and_state_milestones():
    import gymnasium as gym

    gym.register(id="GyreSignals-v0", entry_point=_signals_class(gym), max_episode_steps=10)
    env = make_env("gym:GyreSignals-v0", admissible="snap",
                   success_fn="tests.test_envs:first_name")
    assert env.admissible_actions() == ["noop", "go - left", "fire"]  # as the word policy writes
    await env.reset("signals", seed=0)
    r = await env.step("fire fire")  # snapped to the valid action sharing most words
    assert r.info["executed"] == "fire" and [m.name for m in r.milestones] == ["fired"]
    r = await env.step("go-left")
    assert r.info["valid"] and r.info["executed"] == "go - left" and not r.milestones
    r = await env.step("FIRE")
    assert r.done and r.success and not r.milestones  # each milestone once per episode
    hinted = make_env("gym:GyreSignals-v0", admissible="hint")
    assert (await hinted.reset("signals", seed=0)).startswith("valid actions : noop | go - left")
    assert not (await hinted.step("jump")).info["valid"]  # hint does not snap
    with pytest.raises(ValueError, match="admissible"):
        make_env("gym:GyreSignals-v0", admissible="sometimes")


def test_gym_vocabulary_and_toml_action_names(tmp_path):
    import gymnasium as gym

    from gyre_async.compose import build_policy, build_tokenizer
    from gyre_async.config import load_config
    from gyre_async.envs import env_vocabulary

    gym.register(id="GyreCorridorVocab-v0", entry_point=_corridor_class(gym), max_episode_steps=20)
    path = tmp_path / "corridor.toml"
    path.write_text('[task]\nenv = "gym:GyreCorridorVocab-v0"\n'
                    'env_config = { action_names = ["left", "right", "stay"], '
                    'vocabulary = ["exit"], vocab_episodes = 2 }\n')
    cfg = load_config(path)
    assert cfg.task.env_config["action_names"] == ["left", "right", "stay"]
    vocab = env_vocabulary(cfg.task.env, cfg.task.env_config)
    assert vocab.action_words == ("left", "right", "stay")
    assert {"at", "cell", "exit", "0"} <= set(vocab.words)  # probed, and declared
    assert list(vocab.words) == sorted(vocab.words)  # ids do not depend on visiting order
    tokenizer = build_tokenizer(cfg)
    assert tokenizer.decode(tokenizer.encode("at cell 1 right")) == "at cell 1 right"
    policy = build_policy(cfg, tokenizer)
    allowed = {tokenizer.decode([i]) for i in policy.config.action_token_ids}
    assert allowed == {"left", "right", "stay"}
    unnamed = env_vocabulary("gym:GyreCorridorVocab-v0", {"vocab_episodes": 1})
    assert unnamed.action_words == ("0", "1", "2")  # decimal indices
