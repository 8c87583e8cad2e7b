"""The long task of ``ops/bench/llm.py --long-task``: a TextWorldExpress CookingWorld whose
gold paths are three times coin-7's, with milestones the simulator proves; and the flags
that set it (the headline configuration as one flag, the outcome-only baseline as another).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
from conftest import ROOT, load_script

from gyre_async.errors import ConfigError

GOLD = """
import json, sys
from gyre_async.envs import make_env
game, params, games = sys.argv[1], sys.argv[2], int(sys.argv[3])
env = make_env("twx", game=game, params=params, split="dev", max_steps=200)
lengths = []
for seed in range(games):
    env.reset_sync(f"dev-{seed}", seed)
    lengths.append(len(env.demonstration()))
print(json.dumps(lengths))
"""


def _gold_lengths(game: str, params: str, games: int = 48) -> list[int]:
    """Gold path lengths of the first ``games`` dev games, in a process of its own (a fresh
    JVM: nothing generated before can touch them)."""
    done = subprocess.run([sys.executable, "-c", GOLD, game, params, str(games)], cwd=ROOT,
                          capture_output=True, text=True, check=True, timeout=300)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_long_task_is_at_least_22_steps_and_its_cap_leaves_room():
    """The issue's bar: a median gold path of at least 22 steps (three times coin-7's ~7).
    Coin's own gold path is the simulator's search for the coin, which is not the same
    from one process to the next (medians of 5.5 to 9.5 over the same 48 dev games), so the
    bar is the fixed number; CookingWorld's gold paths are the same every time (24)."""
    bench = load_script("ops/bench/llm.py")
    task = bench.LONG_TASK
    lengths = _gold_lengths(task["twx_game"], task["twx_params"])
    assert lengths == _gold_lengths(task["twx_game"], task["twx_params"])  # deterministic
    long_median = statistics.median(lengths)
    assert long_median >= 22, long_median
    assert task["max_steps"] >= 2.5 * long_median


def test_the_long_task_flag_sets_what_the_command_line_leaves_alone():
    bench = load_script("ops/bench/llm.py")
    argv = ["--long-task", "--max-steps", "70", "--out", "x"]
    p = bench.parser()
    args = p.parse_args(argv)
    bench.apply_long_task(args, argv)
    assert args.max_steps == 70  # given: kept
    assert (args.env, args.twx_game, args.context) == ("twx", "cookingworld", "segment")
    assert args.test_episodes == 96
    assert (args.warmstart_demos, args.warmstart_epochs) == (16, 2)
    cfg = bench.bench_config(args)
    assert cfg.task.env_config["params"] == bench.LONG_TASK["twx_params"]
    assert cfg.task.env_config["max_hint_actions"] == 72
    assert cfg.policy.context == "segment" and cfg.run.mode == "async"
    assert cfg.learner.credit == "fusion"
    assert cfg.policy.draft_tokens == 0  # a warm start's short commands gain nothing
    assert bench.bench_config(p.parse_args(["--draft-tokens", "8"])).policy.draft_tokens == 8


def test_simon_says_with_memory_is_a_24_step_task_played_as_one_segment():
    """``--long-task simon``: every game's gold path is its 24 listed actions, the cap
    leaves 2.5x that, and a game is one segment (every step scores, so a milestone would
    otherwise close a segment at every step); the bare flag is still CookingWorld."""
    bench = load_script("ops/bench/llm.py")
    p = bench.parser()
    argv = ["--long-task", "simon", "--out", "x"]
    args = p.parse_args(argv)
    bench.apply_long_task(args, argv)
    assert (args.twx_game, args.max_steps, args.segment_hint) == ("simonsays", 60, "changes")
    assert (args.milestone_min_steps, args.max_segment_steps) == (60, 60)
    assert (args.warmstart_demos, args.warmstart_epochs, args.test_episodes) == (64, 3, 96)
    lengths = _gold_lengths(args.twx_game, args.twx_params, games=16)
    assert set(lengths) == {24} and args.max_steps >= 2.5 * 24
    cfg = bench.bench_config(args)
    assert cfg.segmenter.milestone_min_steps == 60 and cfg.policy.context == "segment"
    assert cfg.segmenter.max_segment_steps == args.max_steps
    assert (cfg.run.mode, cfg.sampler.group_size) == ("sync", 8)  # the headline RL run
    assert cfg.learner.value_trunk_gradient is False and cfg.loop.max_env_steps == 2362
    bare = p.parse_args(["--long-task", "--out", "x"])
    bench.apply_long_task(bare, ["--long-task", "--out", "x"])
    assert bare.twx_game == "cookingworld"


def test_a_switch_given_off_wins_over_the_preset():
    """``--no-critic-head-only`` beside ``--long-task simon`` shares the LoRA with the
    critic again; other explicit flags win as before."""
    bench = load_script("ops/bench/llm.py")
    p = bench.parser()
    argv = ["--long-task", "simon", "--no-critic-head-only", "--mode", "async",
            "--group-size", "1", "--out", "x"]
    args = p.parse_args(argv)
    bench.apply_long_task(args, argv)
    cfg = bench.bench_config(args)
    assert cfg.learner.value_trunk_gradient is True
    assert (cfg.run.mode, cfg.sampler.group_size) == ("async", 1)


def test_the_acting_temperature_moves_the_training_plays_alone():
    """``--acting-temperature`` sets the sampler's temperature; validation, and with it the
    held-out judging that reads the run's evaluator, keeps ``--temperature``."""
    bench = load_script("ops/bench/llm.py")
    cfg = bench.bench_config(bench.parse_args(["--long-task", "simon", "--acting-temperature",
                                               "1.0", "--out", "x"]))
    assert (cfg.sampler.temperature, cfg.evaluator.temperature) == (1.0, 0.7)
    plain = bench.bench_config(bench.parse_args(["--long-task", "simon", "--out", "x"]))
    assert (plain.sampler.temperature, plain.evaluator.temperature) == (0.7, 0.7)


def test_the_judge_engine_follows_the_sampler_unless_given():
    bench = load_script("ops/bench/llm.py")
    p = bench.parser()
    assert bench.judge_engine(p.parse_args(["--out", "x"])) == "torch"
    assert bench.judge_engine(p.parse_args(["--sampler", "vllm"])) == "vllm"
    assert bench.judge_engine(p.parse_args(["--judge-engine", "vllm"])) == "vllm"
    assert bench.judge_engine(p.parse_args(["--sampler", "vllm", "--judge-engine", "torch"])
                              ) == "torch"


def test_the_sequence_bench_plays_the_same_long_task():
    """``llm_sequence.py --long-task``: the game, cap and hint of ``llm.py --long-task``, in
    both modes' configs, with windows that hold a hinted observation; given flags win."""
    llm = load_script("ops/bench/llm.py")
    bench = load_script("ops/bench/llm_sequence.py")
    argv = ["--long-task", "--max-segment-steps", "16", "--segment-hint", "changes",
            "--window-tokens", "700"]
    args = bench.parser().parse_args(argv)
    bench.apply_preset(args, argv, bench.LONG_TASK_SEQUENCE)
    assert args.window_tokens == 700  # given: kept
    for mode in ("window", "segment"):
        cfg = bench.mode_config(args, mode)
        env = cfg.task.env_config
        assert (env["game"], env["params"]) == (llm.LONG_TASK["twx_game"],
                                                llm.LONG_TASK["twx_params"])
        assert (env["max_steps"], env["max_hint_actions"]) == (64, 72)
        assert cfg.segmenter.max_segment_steps == 16
        assert cfg.policy.segment_hint == ("changes" if mode == "segment" else "full")
        assert cfg.policy.draft_tokens == 8  # both modes act with the same drafts
    plain = bench.parser().parse_args([])
    assert (plain.twx_game, plain.max_steps, plain.window_tokens) == ("coin", 20, 320)


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


def test_pacing_and_the_env_step_budget_reach_the_config():
    """``--max-staleness`` / ``--max-segment-steps`` set pacing's room; ``--env-steps``
    holds a baseline to another run's env steps (and only then may --minutes pass 75)."""
    bench = load_script("ops/bench/llm.py")
    p = bench.parser()

    def config(argv: list[str]):
        args = p.parse_args(argv)
        bench.apply_long_task(args, argv)
        return bench.bench_config(args)

    plain = config(["--long-task"])
    assert (plain.loop.max_staleness, plain.segmenter.max_segment_steps) == (2, 64)  # the cap
    assert plain.loop.max_env_steps == 0
    cfg = config(["--long-task", "--max-staleness", "4", "--max-segment-steps", "24",
                  "--env-steps", "1500", "--credit", "outcome"])
    assert (cfg.loop.max_staleness, cfg.segmenter.max_segment_steps) == (4, 24)
    assert cfg.loop.max_env_steps == 1500 and cfg.learner.credit == "outcome"
    assert plain.arbiter.outcome_lost is None
    assert config(["--long-task", "--outcome-lost", "-1"]).arbiter.outcome_lost == -1.0
    too_long = subprocess.run([sys.executable, str(ROOT / "ops/bench/llm.py"), "--minutes",
                               "120", "--out", "/nonexistent/x"], capture_output=True,
                              text=True, timeout=60)
    assert too_long.returncode == 2 and "--env-steps" in too_long.stderr


def test_sync_mode_with_groups_reaches_the_config_with_gyres_own_credit():
    bench = load_script("ops/bench/llm.py")
    p = bench.parser()
    cfg = bench.bench_config(p.parse_args(["--long-task", "--mode", "sync", "--group-size", "8"]))
    assert cfg.run.mode == "sync" and cfg.sampler.group_size == 8 == cfg.sampler.num_envs
    assert cfg.learner.credit == "fusion" and cfg.arbiter.milestone_reward > 0
    assert bench.bench_config(p.parse_args(["--long-task"])).run.mode == "async"


def test_anchored_credit_keeps_milestone_pay_and_runs_whole_groups():
    bench = load_script("ops/bench/llm.py")
    p = bench.parser()
    cfg = bench.bench_config(p.parse_args(["--long-task", "simon", "--credit", "anchored",
                                           "--group-size", "8"]))
    assert cfg.learner.credit == "anchored" and cfg.run.mode == "sync"
    assert cfg.sampler.group_size == 8 == cfg.sampler.num_envs
    assert cfg.arbiter.milestone_reward > 0  # the step returns it compares include milestones
    with pytest.raises(ConfigError, match="group_size >= 2"):  # alone, no group to compare
        bench.bench_config(p.parse_args(["--long-task", "simon", "--credit", "anchored"]))
