"""The truly long workshop settings: provably long, solved by the oracle, not by chance."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gyre_async.config import load_config
from gyre_async.envs import ACTIONS, env_vocabulary, lower_bound_steps, make_env, oracle_action
from gyre_async.envs.workshop import SETTINGS, WorkshopConfig, WorkshopEnv, make_orders

ROOT = Path(__file__).resolve().parents[1]
#: (setting, fewest steps any seed may need, smallest allowed cap)
LONG = [("workshop-long", 300, 1000), ("workshop-xl", 1000, 3000)]


async def play(env: WorkshopEnv, choose, seed: int) -> tuple[bool, int, float, int]:
    """(success, steps, score, longest observation in words) of one episode, no latency."""
    observation = await env.reset(f"t:{seed}", seed)
    longest = len(observation.split())
    steps = 0
    while True:
        result = env.step_sync(choose(observation))
        steps += 1
        longest = max(longest, len(result.observation.split()))
        if result.over:
            return result.success, steps, result.score, longest
        observation = result.observation


@pytest.mark.parametrize("name,floor,cap", LONG)
def test_every_seed_is_provably_long_and_capped_generously(name, floor, cap):
    config = SETTINGS[name]
    assert config.max_steps >= cap
    bounds = [lower_bound_steps(config, f"t:{seed}", seed) for seed in range(300)]
    assert min(bounds) >= floor
    # the floor is reached by extending the chain, not by a few giant orders: it stays tight
    assert max(bounds) < floor + 20
    assert config.max_steps >= 3 * max(bounds) - 100


@pytest.mark.parametrize("name,floor,cap", LONG)
async def test_oracle_solves_every_sampled_seed_within_the_cap(name, floor, cap):
    env = make_env(name)
    config = SETTINGS[name]
    for seed in (0, 1, 7):
        success, steps, score, longest = await play(env, oracle_action, seed)
        assert success and score == 1.0, (name, seed)
        assert lower_bound_steps(config, f"t:{seed}", seed) <= steps <= floor * 1.15
        assert longest <= 44  # order numbers gain digits; the observation stays short


@pytest.mark.parametrize("name,episodes", [("workshop-long", 12), ("workshop-xl", 3)])
async def test_uniformly_random_actions_do_not_finish(name, episodes):
    """Seeded, so deterministic. 200 episodes each finished none (docs/environments.md);
    here a small sample must finish none and complete well under half of the orders."""
    rng = random.Random(12345)
    env = make_env(name)
    outcomes = [await play(env, lambda _obs: rng.choice(ACTIONS), 10_000 + i)
                for i in range(episodes)]
    assert not any(success for success, *_ in outcomes)
    assert all(steps == SETTINGS[name].max_steps for _, steps, _, _ in outcomes)
    assert max(score for _, _, score, _ in outcomes) < 0.5


def test_extension_keeps_the_drawn_chain_and_leaves_the_quickstart_as_it_was():
    long = SETTINGS["workshop-long"]
    base = WorkshopConfig(n_orders=long.n_orders, max_steps=long.max_steps)
    for seed in range(20):
        short = make_orders(base, "t", seed)
        extended = make_orders(long, "t", seed)
        assert len(short) == long.n_orders and len(extended) > len(short)
        assert [(o.item, o.count) for o in extended[:len(short)]] == \
            [(o.item, o.count) for o in short]
    assert len(make_orders(WorkshopConfig(), "t", 3)) == 10
    assert SETTINGS["workshop"] == WorkshopConfig()


def test_long_settings_take_overrides_and_share_the_workshop_vocabulary():
    env = make_env("workshop-long", max_steps=1500, noise_prob=0.0)
    assert env.config.max_steps == 1500 and env.config.min_solution_steps == 300
    assert env_vocabulary("workshop-xl") == env_vocabulary("workshop")
    with pytest.raises(ValueError, match="min_solution_steps"):
        WorkshopConfig(min_solution_steps=-1)


@pytest.mark.parametrize("path,env", [("ops/configs/long300.toml", "workshop-long"),
                                      ("ops/configs/long1000.toml", "workshop-xl")])
def test_long_configs_keep_context_bounded_and_close_segments_at_milestones(path, env):
    cfg = load_config(str(ROOT / path))
    assert cfg.task.env == env
    assert cfg.policy.history_turns == 0 and cfg.policy.context_tokens <= 128
    assert cfg.segmenter.close_on_milestone and cfg.segmenter.max_segment_steps <= 64
