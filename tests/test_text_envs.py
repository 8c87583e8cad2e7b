"""Real text games through the Env API, warm-start and export (TextWorldExpress: fast, CI).

Every test drives the real simulator (no fakes): reset, steps, milestones read from game
state, gold demonstrations replayed to success. Generated data goes to a per-session cache
directory ($GYRE_CACHE), never into the repository.
"""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path

import msgspec
import pytest
import textworld_express  # noqa: F401 - the test extra installs the simulator
import torch

from gyre_async.compose import build_context_builder, build_policy, build_tokenizer
from gyre_async.config import load_config
from gyre_async.core.evaluation import evaluate
from gyre_async.core.rollout import Acted, LoggedStep, PolicyHolder, rebuild_episode, run_episode
from gyre_async.envs import game_vocabulary, make_env
from gyre_async.envs.base import EnvFailure, observation_hash
from gyre_async.envs.text_games import HINT_PREFIX, snap_action
from gyre_async.offline.demonstrations import (
    gold_demonstrations,
    read_demonstrations,
    training_pairs,
    training_segments,
    write_demonstrations,
)
from gyre_async.offline.warmstart import (
    CloneProgress,
    action_tokens,
    behaviour_clone,
    behaviour_clone_segments,
    warm_policy,
)
from gyre_async.policy.base import Action
from gyre_async.policy.context import ContextBuilder
from gyre_async.policy.hf_policy import chat_observation
from gyre_async.policy.tokenizer import ByteTokenizer
from schemas.config import SegmenterConfig
from schemas.hint import CHANGES_PREFIX, hint_changes, present_hint, split_hint, split_hint_changes

ROOT = Path(__file__).resolve().parents[1]
TWC = {"game": "twc", "params": "numLocations=1,numItemsToPutAway=1,includeDoors=0",
       "max_steps": 8, "admissible": "snap", "vocab_episodes": 40}


@pytest.fixture(scope="module", autouse=True)
def gyre_cache(tmp_path_factory):
    """A fresh cache per test module: vocabularies and gold paths are built for real."""
    mp = pytest.MonkeyPatch()
    mp.setenv("GYRE_CACHE", str(tmp_path_factory.mktemp("gyre-cache")))
    yield
    mp.undo()


def twx_config(run_dir: Path, **sections):
    cfg = load_config(ROOT / "ops" / "configs" / "twx.toml")
    cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, run_dir=str(run_dir)))
    for name, fields in sections.items():
        cfg = msgspec.structs.replace(cfg, **{name: msgspec.structs.replace(
            getattr(cfg, name), **fields)})
    return cfg


# -- the adapter -----------------------------------------------------------------------------

async def test_twx_reset_steps_milestones_and_gold_replay():
    env = make_env("twx", **{**TWC, "admissible": "off"})
    try:
        first = await env.reset("twx:0", 0)
        assert "Your task is to pick up objects" in first
        assert env.admissible_actions() == []  # admissible off: nothing offered
        # a useless action: no score, no milestone, not over
        idle = await env.step("inventory")
        assert idle.score == 0.0 and idle.milestones == () and not idle.over
        for seed in range(3):
            await env.reset(f"twx:{seed}", seed)
            gold = env.demonstration()
            assert 2 <= len(gold) <= 5
            names = []
            for i, action in enumerate(gold):
                result = await env.step(action)
                for m in result.milestones:
                    assert m.proof.startswith("scoreRaw=")  # proven by the simulator's counter
                    names.append(m.name)
                if i < len(gold) - 1:
                    assert not result.over
            assert result.success and result.done and result.score == 1.0
            assert names == ["points:1", "points:2"]  # each point once, in order
        # the step cap truncates
        await env.reset("twx:5", 5)
        for _ in range(8):
            result = await env.step("inventory")
        assert result.truncated and not result.done and not result.success
    finally:
        await env.close()


async def test_twx_splits_are_disjoint_and_admissible_modes():
    train = make_env("twx", **{**TWC, "admissible": "hint"})
    dev = make_env("twx", **{**TWC, "admissible": "snap", "split": "dev"})
    try:
        t0 = await train.reset("twx:0", 0)
        d0 = await dev.reset("twx:0", 0)
        assert t0.startswith(HINT_PREFIX) and not d0.startswith(HINT_PREFIX)
        assert t0.split(" . ", 1)[1] != d0  # seed 0 of dev is another game than seed 0 of train
        valid = dev.admissible_actions()
        take = [a for a in valid if a.startswith("take ")]
        assert take, valid
        # snap: a partial action becomes the closest valid one, and that is what runs
        result = await dev.step("take " + take[0].split()[-1])
        assert result.info["executed"] == take[0] and result.score > 0
    finally:
        await train.close()
        await dev.close()
    assert snap_action("put bra in drier", ["put bra in basket", "put bra in clothes drier"]) \
        == "put bra in clothes drier"


def test_vocabulary_is_cached_and_covers_the_games():
    vocab = game_vocabulary("twx", TWC)
    again = game_vocabulary("twx", {**TWC, "split": "dev", "admissible": "off"})
    assert again == vocab  # split/admissible do not change the vocabulary (one tokenizer)
    assert {"take", "put", "in"} <= set(vocab.action_words) <= set(vocab.words)
    demos = gold_demonstrations("twx", {**TWC, "split": "test"}, range(10))
    unknown = {w for d in demos for s in d.steps for w in
               (s.observation + " " + s.action).lower().split()
               if w.isalpha() and w not in vocab.words}
    print(f"\ntwx vocabulary: {len(vocab.words)} words, {len(vocab.action_words)} action words; "
          f"unseen words in 10 test episodes: {sorted(unknown)}")
    assert len(unknown) <= 5


# -- demonstrations, warm-start, export -----------------------------------------------------

def test_demonstration_file_round_trip_and_contexts(tmp_path):
    demos = gold_demonstrations("twx", TWC, range(4))
    assert all(d.success and d.source == "gold" for d in demos)
    path = str(tmp_path / "demos.jsonl")
    assert write_demonstrations(path, demos) == 4
    back = read_demonstrations(path)
    assert back == demos
    cfg = twx_config(tmp_path)
    tok = build_tokenizer(cfg)
    builder = ContextBuilder(tok, cfg.policy.context_tokens, cfg.policy.history_turns)
    pairs = training_pairs(back, builder)
    assert len(pairs) == sum(len(d.steps) for d in demos)
    assert all(len(c) <= cfg.policy.context_tokens for c, _ in pairs)
    (tmp_path / "bad.jsonl").write_text('{"env": "twx"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_demonstrations(str(tmp_path / "bad.jsonl"))


#: two objects to put away (two milestones a game), short segments: segments close at
#: milestones, at their length bound and at the end, all three within one game
TWC2 = {**TWC, "params": "numLocations=1,numItemsToPutAway=2,includeDoors=0", "max_steps": 20}


def segment_config(tmp_path):
    return twx_config(tmp_path, task={"env_config": TWC2},
                      policy={"context": "segment", "history_turns": 0, "context_tokens": 400},
                      segmenter={"max_segment_steps": 3})


def test_segment_warm_start_clones_the_sequences_the_sampler_builds(tmp_path):
    """The offline segments of gold demonstrations are, token for token, the contexts the
    sampler's own loop builds when it plays the same actions in the real game."""
    cfg = segment_config(tmp_path)
    tok = build_tokenizer(cfg)
    policy = build_policy(cfg, tok)
    builder = build_context_builder(cfg, tok)
    demos = gold_demonstrations("twx", TWC2, range(4))
    assert all(d.success for d in demos)

    def tokens_of(text):
        return action_tokens(policy, tok, text, cfg.policy.max_action_tokens)

    segments, left_out = training_segments(demos, builder, cfg.segmenter, tokens_of)
    assert left_out == 0

    async def sampler_contexts(demo) -> list[list[int]]:
        moves, seen = iter(demo.steps), []

        async def act(context):
            text = next(moves).action
            tokens = tokens_of(text)
            seen.append(context)
            return Acted(Action(tokens, [0.0] * len(tokens), [0.0] * len(tokens), text), 0)

        env = make_env("twx", **TWC2)
        try:
            await run_episode(env, demo.task_id, demo.seed, act, builder, step_timeout_s=60,
                              segments=cfg.segmenter)
        finally:
            await env.close()
        return seen

    played = [c for demo in demos for c in asyncio.run(sampler_contexts(demo))]
    offline = [s.sequence[:n] for s in segments for n, _ in s.decisions]
    assert offline == played
    assert len(played) == sum(len(d.steps) for d in demos)
    assert len(segments) > len(demos)  # games were cut into several segments
    for s in segments:  # each step's context and action lie in its segment's sequence
        assert 1 <= len(s.decisions) <= cfg.segmenter.max_segment_steps
        assert s.decisions[-1][0] + s.decisions[-1][1] == len(s.sequence)
    with pytest.raises(ValueError, match="window"):
        training_segments(demos, ContextBuilder(tok, 400, 0), cfg.segmenter, tokens_of)


#: CookingWorld, one room, two ingredients: the recipe is read a few steps before the first
#: milestone (an ingredient taken), so every later segment opens after it
COOK = {"game": "cookingworld", "params": "numLocations=1,numIngredients=2,"
        "numDistractorItems=0,includeDoors=0,limitInventorySize=0", "max_steps": 40,
        "admissible": "hint"}


def test_later_segments_open_with_the_task_the_recipe_and_what_the_milestones_took():
    """A segment that opens mid-episode holds the task as the game states it (its
    description, and the recipe once the cookbook was read) and the actions that reached
    the milestones so far; the sampler's loop, a rebuilt episode and the offline warm start
    build those openings token for token alike."""
    tok = ByteTokenizer()
    builder = ContextBuilder(tok, 20_000, 0, mode="segment")
    segments = SegmenterConfig(max_segment_steps=64)
    (demo,) = gold_demonstrations("twx", COOK, [2])
    assert demo.success
    actions = [step.action for step in demo.steps]
    read = actions.index("read cookbook")
    description = demo.steps[0].task
    assert description.startswith("You are hungry!") and description in demo.steps[0].observation
    shown = demo.steps[read + 1].observation  # the valid-action hint first, then the text
    recipe = shown[shown.index("Gather all following ingredients"):]
    assert "Ingredients:" in recipe
    assert [s.task for s in demo.steps[:read + 1]] == [description] * (read + 1)
    assert all(s.task == f"{description} {recipe}" for s in demo.steps[read + 1:])

    def tokens_of(text):
        return [*tok.encode(text), tok.eos_id]

    offline, left_out = training_segments([demo], builder, segments, tokens_of)
    assert left_out == 0 and len(offline) >= 3
    openings = [tok.decode(s.sequence[:s.decisions[0][0]]) for s in offline]
    assert openings[0].count(description) == 1  # the first observation states it already
    proved = [step.action for step in demo.steps if step.milestones]
    for k, opening in enumerate(openings[1:], 1):
        assert description in opening and "Ingredients:" in opening, opening
        assert ": " + ". ".join(proved[max(0, k - 4):k]) in opening, (k, opening)

    played, logged = [], []

    async def play():
        moves = iter(actions)

        async def act(context):
            text = next(moves)
            played.append(context)
            return Acted(Action(tokens_of(text), [0.0] * (len(text) + 1),
                                [0.0] * (len(text) + 1), text), 0)

        async def on_step(record):
            logged.append(LoggedStep(record.acted.action.text,
                                     observation_hash(record.result.observation),
                                     tuple(record.acted.action.tokens)))

        env = make_env("twx", **COOK)
        try:
            await run_episode(env, demo.task_id, demo.seed, act, builder, step_timeout_s=60,
                              on_step=on_step, segments=segments)
        finally:
            await env.close()

    asyncio.run(play())
    assert played == [s.sequence[:n] for s in offline for n, _ in s.decisions]
    after_first_milestone = next(i for i, s in enumerate(demo.steps) if s.milestones) + 1

    async def rebuild():
        env = make_env("twx", **COOK)
        try:
            return await rebuild_episode(env, demo.task_id, demo.seed,
                                         observation_hash(demo.steps[0].observation),
                                         logged[:after_first_milestone], builder,
                                         step_timeout_s=60, segments=segments)
        finally:
            await env.close()

    state = asyncio.run(rebuild())
    assert not isinstance(state, EnvFailure)
    assert recipe in state.task
    assert state.context(builder) == played[after_first_milestone]


def test_simon_says_segments_open_with_the_list_the_first_observation_gave():
    """Simon Says with ``memorization=1`` lists every action once, in its first observation,
    and never again: that list is part of the task, so a segment that opens after it still
    holds it (without it the next action cannot be known)."""
    simon = {"game": "simonsays", "params": "gameLength=6,numDistractors=2,memorization=1",
             "max_steps": 15, "admissible": "hint"}
    tok = ByteTokenizer()
    builder = ContextBuilder(tok, 20_000, 0, mode="segment")
    (demo,) = gold_demonstrations("twx", simon, [1])
    actions = [step.action for step in demo.steps]
    assert demo.success and len(actions) == 6
    listed = "take these actions in order: " + ", ".join(actions)
    assert listed in demo.steps[0].observation
    assert all(listed in step.task for step in demo.steps)

    def tokens_of(text):
        return [*tok.encode(text), tok.eos_id]

    cuts = SegmenterConfig(max_segment_steps=2, milestone_min_steps=2)  # every step scores
    offline, _ = training_segments([demo], builder, cuts, tokens_of)
    openings = [tok.decode(s.sequence[:s.decisions[0][0]]) for s in offline]
    assert len(openings) == 3
    assert all(opening.count(listed) == 1 for opening in openings), openings


def test_segment_contexts_list_valid_commands_once_then_what_changed():
    """``hint="changes"``: a segment's opening lists every valid command, each later step
    only those that became valid or stopped being valid; the list a reader holds from them
    is the game's at every step, the sampler's loop and the offline warm start build the
    same sequences, and they are much shorter than with the whole list at every step."""
    tok = ByteTokenizer()
    full = ContextBuilder(tok, 20_000, 0, mode="segment")
    changes = ContextBuilder(tok, 20_000, 0, mode="segment", hint="changes")
    segments = SegmenterConfig(max_segment_steps=64)
    (demo,) = gold_demonstrations("twx", COOK, [2])
    observations = [step.observation for step in demo.steps]
    held, _ = split_hint(observations[0])
    assert held
    for before, after in zip(observations, observations[1:]):
        stated = hint_changes(before, after)
        added, removed, text = split_hint_changes(stated)
        held = [c for c in held if c not in removed] + added
        valid, game_text = split_hint(after)
        assert sorted(held) == sorted(valid) and text == game_text
        assert len(stated) < len(after) or (not added and not removed)
    assert hint_changes(observations[0], "You eat the meal.") == "You eat the meal."

    def tokens_of(text):
        return [*tok.encode(text), tok.eos_id]

    whole, _ = training_segments([demo], full, segments, tokens_of)
    offline, left_out = training_segments([demo], changes, segments, tokens_of)
    assert left_out == 0 and len(offline) == len(whole)

    def appended(segs):  # what steps after the openings add
        return sum(len(s.sequence) - s.decisions[0][0] for s in segs)

    assert appended(offline) < 0.5 * appended(whole)  # 0.37 on this game, in bytes
    for s in offline:  # an opening lists them all, a later step what changed
        steps = [tok.decode(s.sequence[:n]) for n, _ in s.decisions]
        assert HINT_PREFIX in steps[0] and CHANGES_PREFIX not in steps[0]
        for before, after in zip(steps, steps[1:]):
            assert CHANGES_PREFIX in after[len(before):]
            assert HINT_PREFIX not in after[len(before):]
    played = []

    async def play():
        moves = iter(step.action for step in demo.steps)

        async def act(context):
            text = next(moves)
            played.append(context)
            return Acted(Action(tokens_of(text), [0.0] * (len(text) + 1),
                                [0.0] * (len(text) + 1), text), 0)

        env = make_env("twx", **COOK)
        try:
            await run_episode(env, demo.task_id, demo.seed, act, changes, step_timeout_s=60,
                              segments=segments)
        finally:
            await env.close()

    asyncio.run(play())
    assert played == [s.sequence[:n] for s in offline for n, _ in s.decisions]


def test_a_chat_model_reads_changed_valid_commands_after_the_text():
    """The changed commands as a chat model is shown them: what is no longer valid on one
    line, what became valid one per line right before the answer, as a full list is."""
    common = ["go east", "go west", "inventory", "look", "open fridge"]
    before = present_hint([*common, "take apple"], "Kitchen.")
    after = present_hint(["eat apple", *common], "You take the apple.")
    shown = chat_observation(hint_changes(before, after))
    assert shown == ("You take the apple.\n\nValid actions: as before, but no longer: "
                     "take apple\nNow also valid:\neat apple")
    assert chat_observation(hint_changes(before, before)) == "Kitchen.\n\nValid actions: as before"
    new_room = present_hint(["go north", "take coin"], "Garden.")  # changes longer: whole list
    assert hint_changes(before, new_room) == new_room
    with pytest.raises(ValueError, match="hint"):
        ContextBuilder(ByteTokenizer(), 400, 0, mode="segment", hint="diff")


def test_cloning_passes_hold_segments_of_similar_lengths_within_the_token_budget():
    from gyre_async.offline.demonstrations import SegmentExample
    from gyre_async.offline.warmstart import token_batches

    lengths = [50, 400, 60, 380, 45, 900]
    segs = [SegmentExample(list(range(n)), [(1, 1), (2, 1)]) for n in lengths]
    steps = list(token_batches(segs, list(range(6)), 6, 800))
    assert [sum(len(p) for p in passes) for passes in steps] == [3, 3]
    for passes in steps:
        assert all(len(p) == 1 or max(len(s.sequence) for s in p) * len(p) <= 800
                   for p in passes)
    assert [[len(s.sequence) for s in p] for p in steps[0]] == [[400, 60], [50]]
    assert [[len(s.sequence) for s in p] for p in steps[1]] == [[900], [380, 45]]
    assert list(token_batches(segs, [0, 1], 4, 0)) == [[[segs[0], segs[1]]]]


def test_segment_cloning_takes_the_step_that_cloning_each_context_apart_takes(tmp_path,
                                                                              monkeypatch):
    """One gradient step of behaviour cloning read off whole segments moves the weights as
    the same step on each step's own context does (the slow reference). Plain SGD without
    clipping, so the step is the gradient itself (Adam's first step, about the gradient's
    sign, would hide a gradient off by a factor)."""
    monkeypatch.setattr(torch.optim, "Adam", torch.optim.SGD)
    cfg = segment_config(tmp_path)
    tok = build_tokenizer(cfg)
    builder = build_context_builder(cfg, tok)
    demos = gold_demonstrations("twx", TWC2, range(2))
    policies = [build_policy(cfg, tok) for _ in range(2)]
    policies[1].load_state_dict(policies[0].state_dict())
    segments, _ = training_segments(
        demos, builder, cfg.segmenter,
        lambda text: action_tokens(policies[0], tok, text, cfg.policy.max_action_tokens))
    apart = [(s.sequence[:n], s.sequence[n:n + a]) for s in segments for n, a in s.decisions]
    steps = len(apart)
    before = {k: v.clone() for k, v in policies[0].state_dict().items()}
    calls, shown = [], io.StringIO()
    progress = CloneProgress(1, every_s=3600, out=shown)

    def on_step(*call):
        calls.append(call)
        progress(*call)

    one_pass = behaviour_clone_segments(policies[0], segments, epochs=1, learning_rate=1.0,
                                        batch_steps=steps, micro_tokens=300,
                                        max_grad_norm=1e9, on_step=on_step)
    assert calls == [(1, 1, 1, pytest.approx(one_pass["bc/nll"]))]
    assert "epoch 1/1 step 1/1 nll" in shown.getvalue()
    each = behaviour_clone(policies[1], apart, epochs=1, learning_rate=1.0, batch_size=steps,
                           max_grad_norm=1e9)
    assert one_pass["bc/segments"] > 1 and one_pass["bc/examples"] == steps
    assert one_pass["bc/nll"] == pytest.approx(each["bc/nll"], rel=1e-5)
    moved = 0.0
    for name, value in policies[0].state_dict().items():
        torch.testing.assert_close(value, policies[1].state_dict()[name], atol=1e-5, rtol=1e-4)
        moved = max(moved, float((value - before[name]).abs().max()))
    assert moved > 1e-2  # the step itself is far larger than the tolerance


#: Held-out seeds of the training fold: games the demonstrations (seeds 0-47) never showed,
#: with objects that other training games use (the dev fold's objects are all new).
HELD_OUT = {"seeds": list(range(500, 516)), "env_config": {}}


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
async def test_warm_start_beats_the_initial_policy_on_held_out_seeds(tmp_path):
    cfg = twx_config(tmp_path, evaluator=HELD_OUT)
    tok = build_tokenizer(cfg)
    builder = ContextBuilder(tok, cfg.policy.context_tokens, cfg.policy.history_turns)
    started = time.monotonic()
    warm, stats = await asyncio.to_thread(warm_policy, cfg)
    cloned_s = time.monotonic() - started
    initial = await evaluate(cfg, PolicyHolder(build_policy(cfg, tok), 0), builder, None, True)
    after = await evaluate(cfg, PolicyHolder(warm, 0), builder, None, True)
    print(f"\nwarm-start on {stats['bc/demonstrations']:.0f} gold demos ({stats['bc/examples']:.0f}"
          f" steps, {cloned_s:.0f}s, nll {stats['bc/nll']:.3f}); dev seeds "
          f"{after['validation_seeds'][:3]}...: initial success {initial['success_rate']:.2f} "
          f"score {initial['mean_score']:.2f}; warm success {after['success_rate']:.2f} "
          f"score {after['mean_score']:.2f}")
    assert after["validation_seeds"] == list(range(500, 516))
    assert after["mean_score"] > initial["mean_score"] + 0.2
    assert after["success_rate"] > initial["success_rate"]


# -- gyre warmstart -> gyre run -> gyre export, and evaluation on request --------------------

async def _events(url: str, topic: str):
    from gyre_async.bus import open_bus
    from gyre_async.bus.reading import read_events

    async with open_bus(url) as bus:
        return [e async for _, e in read_events(bus, [topic], on_bad="raise")]


@pytest.mark.slow
async def test_gyre_run_starts_from_the_warm_start_then_exports_and_evaluates_on_request(
        tmp_path):
    import subprocess
    import sys

    from actors.evaluator import Evaluator
    from gyre_async.bus import open_bus
    from gyre_async.config import bus_url
    from gyre_async.offline.export import export_run
    from gyre_async.runtime.actor import ActorRunner
    from gyre_async.runtime.loop import run_loop
    from schemas import encode
    from schemas.events import EvalRequest, EvalResult, PolicyVersion, TrajectoryStep
    from schemas.topics import EVAL, EVAL_REQUEST, POLICY_VERSION, TRAJECTORY_STEP

    cfg = twx_config(tmp_path / "run", evaluator={**HELD_OUT, "every_versions": 100},
                     learner={"max_versions": 2, "batch_steps": 128, "minibatch_steps": 64,
                              "epochs": 1},
                     sampler={"num_envs": 8}, loop={"max_wall_s": 120})
    # gyre warmstart CONFIG: behaviour cloning, published as version 0 of the run (the
    # overrides above concern the online run only; warm-start reads task/policy/warmstart)
    command = [sys.executable, "-m", "gyre_async.cli", "warmstart",
               str(ROOT / "ops" / "configs" / "twx.toml"), "--run-dir", cfg.run.run_dir]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert '"version": 0' in done.stdout
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and "already has policy version 0" in again.stderr

    await run_loop(cfg)
    url = bus_url(cfg)
    versions = [v for v in await _events(url, POLICY_VERSION) if isinstance(v, PolicyVersion)]
    assert [(v.version, v.reason) for v in versions][:2] == [(0, "warmstart"), (1, "update")]
    assert versions[0].producer == "warmstart" and versions[1].parent == 0
    assert "init" not in {v.reason for v in versions}  # the learner started from version 0
    steps = [s for s in await _events(url, TRAJECTORY_STEP) if isinstance(s, TrajectoryStep)]
    assert steps and min(s.policy_version for s in steps) == 0
    evals = [e for e in await _events(url, EVAL) if isinstance(e, EvalResult)]
    v0 = [e for e in evals if e.policy_version == 0]
    assert v0 and v0[0].trigger == "reason:warmstart" and v0[0].decoding == "greedy"
    assert v0[0].mean_score > 0.2  # the warm weights acted (a fresh policy scores 0 here)

    # gyre export: successful online trajectories, replayed and verified, as demonstrations
    out = tmp_path / "exported.jsonl"
    summary = await export_run(cfg, str(out))
    assert summary["written"] >= 1 and summary["replay_mismatches"] == 0, summary
    exported = read_demonstrations(str(out))
    assert all(d.success and d.source == "export:twx" and d.env == "twx" for d in exported)
    assert len(exported) == summary["written"]

    # evaluation on request: version 0 again, sampled this time
    async with open_bus(url) as bus:
        runner = ActorRunner(Evaluator(cfg), bus, run_id=cfg.run.run_id, name="evaluator",
                             partitions=cfg.bus.partitions)
        task = asyncio.create_task(runner.run())
        request = EvalRequest(event_id="req-1", run_id=cfg.run.run_id, producer="test",
                              key="eval", policy_version=0, greedy=False)
        await bus.publish(EVAL_REQUEST, [(b"eval", encode(request))])
        deadline = time.monotonic() + 120
        answered = []
        while not answered and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.5)
            answered = [e for e in await _events(url, EVAL)
                        if isinstance(e, EvalResult) and e.trigger == "request"]
        runner.stop()
        await task
    assert answered and answered[0].policy_version == 0
    assert answered[0].decoding == "sampled" and answered[0].episodes == 16
