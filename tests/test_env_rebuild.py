"""Environments that declare ``rebuildable`` replay the same, in another process.

A restarted sampler rebuilds an open episode by replaying its logged actions into a fresh
environment in a *new process*; that is only sound if ``reset(task, seed)`` and the same
actions give the same observations there. Each check plays an episode in one process
(actions drawn at random from the admissible ones, seeded), replays its actions in a
second process with another ``PYTHONHASHSEED``, and compares every observation's hash.
The text-game adapters start real simulators (a JVM, a Z-machine), so their checks are in
the slow tier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gyre_async.envs import make_env

ROOT = Path(__file__).resolve().parents[1]

PLAYER = r"""
import asyncio, json, random, sys
from gyre_async.envs import make_env
from gyre_async.envs.base import observation_hash

name, config, task, seed, steps, actions = json.loads(sys.argv[1])

async def main():
    env = make_env(name, **config)
    rng = random.Random(seed)
    try:
        hashes = [observation_hash(await env.reset(task, seed))]
        taken = []
        for i in range(steps if actions is None else len(actions)):
            if actions is None:
                # not "focus on": in ScienceWorld it ends the episode unless it is right
                choices = sorted(a for a in env.admissible_actions()
                                 if not a.startswith("focus")) or ["look"]
                action = rng.choice(choices)
            else:
                action = actions[i]
            result = await env.step(action)
            taken.append(action)
            hashes.append(observation_hash(result.observation))
            if result.over:
                break
        print(json.dumps({"actions": taken, "hashes": hashes}))
    finally:
        await env.close()

asyncio.run(main())
"""


def _play(name: str, config: dict, task: str, seed: int, steps: int,
          actions: list[str] | None, hash_seed: str, cache: Path) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, GYRE_CACHE=str(cache),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", PLAYER,
                          json.dumps([name, config, task, seed, steps, actions])],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def replays_the_same(name: str, config: dict, task: str, seed: int, steps: int,
                     cache: Path, tries: int = 1) -> tuple[bool, int]:
    """(a replay's observations all match, steps played), over up to ``tries`` replays.

    A replay that differs is reported (first differing step, its action) on stderr, which
    pytest shows with a failure."""
    first = _play(name, config, task, seed, steps, None, "1", cache)
    for attempt in range(tries):
        again = _play(name, config, task, seed, steps, first["actions"], str(2 + attempt), cache)
        if first["hashes"] == again["hashes"]:
            return True, len(first["actions"])
        at = next(i for i, (a, b) in enumerate(zip(first["hashes"], again["hashes"])) if a != b)
        print(f"{name} seed {seed}: replay {attempt + 1} differs at observation {at} "
              f"(after action {first['actions'][at - 1] if at else 'reset'!r})", file=sys.stderr)
    return False, len(first["actions"])


def test_the_workshop_replays_the_same_in_another_process(tmp_path):
    config = {"n_orders": 8, "max_steps": 200, "latency_mean_s": 0.0}
    assert make_env("workshop", **config).rebuildable
    same, played = replays_the_same("workshop", config, "workshop:11", 11, 200, tmp_path)
    assert same and played == 200


@pytest.mark.slow
@pytest.mark.parametrize("name, config, task", [
    ("twx", {"game": "cookingworld", "params": "numLocations=3,numIngredients=2,"
             "numDistractorItems=2,includeDoors=1", "admissible": "snap", "max_steps": 60},
     "twx:cookingworld"),
    ("textworld", {"admissible": "snap", "max_steps": 40, "games": 2}, "textworld:1"),
])
def test_text_games_declared_rebuildable_replay_the_same(name, config, task, tmp_path):
    pytest.importorskip({"twx": "textworld_express"}.get(name, name))
    env = make_env(name, **config)
    try:
        declared = env.rebuildable
    finally:
        import asyncio

        asyncio.run(env.close())
    assert declared, f"{name} no longer declares rebuildable (issue 15 checks these two)"
    for seed in (3, 4):
        same, played = replays_the_same(name, config, task, seed, config["max_steps"],
                                        tmp_path)
        # a game may end early (solved or lost); a handful of hash-checked steps is a replay
        assert same and played >= 5, (seed, played)


def test_scienceworld_is_not_declared_rebuildable():
    """ScienceWorld's replays differed from the original play in about one run in six
    (find-plant seed 3: the simulator's "which one did you mean?" list at 'look at water'),
    so a restarted sampler abandons its open episodes visibly instead of replaying them."""
    pytest.importorskip("scienceworld")
    from gyre_async.envs.scienceworld import ScienceWorldEnv

    assert ScienceWorldEnv.rebuildable is False
