"""The long task of ``ops/bench/llm.py --long-task``: a TextWorldExpress CookingWorld whose
gold paths are three times coin-7's, with milestones the simulator proves; and the flags
that set it (the headline configuration as one flag, the outcome-only baseline as another).
"""

from __future__ import annotations

import statistics

from conftest import load_script

from gyre_async.envs import make_env

COIN_7 = "numLocations=7,includeDoors=0,numDistractorItems=0"


def _gold_lengths(game: str, params: str, games: int = 48) -> list[int]:
    env = make_env("twx", game=game, params=params, split="dev", max_steps=200)
    lengths = []
    for seed in range(games):
        env.reset_sync(f"dev-{seed}", seed)
        lengths.append(len(env.demonstration()))
    return lengths


def test_the_long_task_is_three_times_coin_7_and_its_cap_leaves_room():
    bench = load_script("ops/bench/llm.py")
    task = bench.LONG_TASK
    long_median = statistics.median(_gold_lengths(task["twx_game"], task["twx_params"]))
    coin_median = statistics.median(_gold_lengths("coin", COIN_7))
    assert long_median >= 22 and long_median >= 3 * coin_median, (long_median, coin_median)
    assert task["max_steps"] >= 2.5 * long_median


def test_the_long_task_flag_sets_what_the_command_line_leaves_alone():
    bench = load_script("ops/bench/llm.py")
    argv = ["--long-task", "--max-steps", "70", "--out", "x"]
    p = bench.parser()
    args = p.parse_args(argv)
    bench.apply_long_task(p, args, argv)
    assert args.max_steps == 70  # given: kept
    assert (args.env, args.twx_game, args.context) == ("twx", "cookingworld", "segment")
    assert args.test_episodes == 96 and args.warmstart_demos == 0
    cfg = bench.bench_config(args)
    assert cfg.task.env_config["params"] == bench.LONG_TASK["twx_params"]
    assert cfg.policy.context == "segment" and cfg.run.mode == "async"
    assert cfg.learner.credit == "fusion"


def test_the_outcome_only_baseline_differs_in_credit_alone():
    bench = load_script("ops/bench/llm.py")
    p = bench.parser()
    fusion = bench.bench_config(p.parse_args(["--long-task"]))
    outcome = bench.bench_config(p.parse_args(["--long-task", "--credit", "outcome"]))
    assert outcome.learner.credit == "outcome" and outcome.run.mode == "sync"
    assert outcome.arbiter.milestone_reward == 0.0
    assert not outcome.segmenter.close_on_milestone
    assert fusion.arbiter.milestone_reward > 0 and fusion.segmenter.close_on_milestone
    assert outcome.task == fusion.task and outcome.policy == fusion.policy
