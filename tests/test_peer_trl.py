"""The TRL peer (``ops/peer/trl_grpo.py``) still runs on the installed TRL.

``ops/bench/peer.py`` compares Gyre with TRL's GRPOTrainer; that comparison is only as good
as the peer's code path, which leans on TRL's experimental multi-turn hook (``rollout_func``
with ``env_mask``) and on the trainer's own per-turn generation. So this fast test drives the
real path on real TextWorldExpress games: two tiny games (one room), two steps each, played
twice each (GRPO groups of two) by a 2-layer model built from config with SmolLM2's tokenizer
(SmolLM2 itself is too slow for the fast tier), through the trainer's ``rollout_func``; then
one optimizer step of ``trainer.train()`` and the adapter it saves, loaded into the judge's
torch policy. It checks that:

- every game's sequence is the segment context Gyre's evaluator builds for the same commands
  (``EpisodeState`` with a ``segment`` context builder), so the judge plays the form TRL
  trained on; the model's tokens are the ones ``env_mask`` marks, the game's answers are not;
- the update ran and saved a version with its clock and counts;
- the saved peft adapter loads into Gyre's ``HFPolicy`` (same rank, targets, names).

Without TRL this test fails (it is the peer extra's check, not an optional one): install it
with ``pip install -e .[peer]`` (``ops/install.sh --test`` does).
"""

from __future__ import annotations

import json

import pytest
import textworld_express  # noqa: F401 - the test extra installs the simulator
import torch
from conftest import load_script

INSTALL = "pip install -e '.[peer]'  (ops/install.sh --test installs it)"
GAME = "numLocations=1,includeDoors=0,numDistractorItems=0"


def need_trl():
    try:
        import trl
    except ImportError as exc:  # a skip would pass silently: the comparison would rot
        pytest.fail(f"TRL is not installed, so the peer cannot be checked: {INSTALL} ({exc})")
    return trl


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from gyre_async.policy.smollm2 import ensure_converted

    directory = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(ensure_converted())
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def assert_sequences_are_gyre_contexts(rollouts, seeds, played, cap):
    """Each game's sequence is the segment context Gyre's evaluator builds when fed the same
    commands (the model's tokens are the runs of env_mask 1, the game's answers the runs of
    0), and its outcome the game's."""
    from gyre_async.core.rollout import EpisodeState
    from gyre_async.envs import make_env
    from schemas.config import SegmenterConfig

    tokenizer = rollouts.tokenizer
    for k, seed in enumerate(seeds):
        completion, mask = played["completion_ids"][k], played["env_mask"][k]
        assert len(completion) == len(mask) and mask[0] == 1
        # the model's commands: the runs of env_mask 1; the game's answers: the runs of 0
        actions, run = [], []
        for token, m in zip(completion, mask):
            if m:
                run.append(token)
            elif run:
                actions.append(run)
                run = []
        if run:
            actions.append(run)
        assert len(actions) == played["env_steps"][k] <= cap
        # Gyre's evaluator, fed the same commands, builds exactly this sequence
        env = make_env("twx", **rollouts.env_config)
        state = EpisodeState.first(env.reset_sync(f"twx:{seed}", seed), rollouts.builder,
                                   SegmenterConfig(max_segment_steps=cap, close_on_milestone=False,
                                                   close_on_state_change=False))
        whole = played["prompt_ids"][k] + completion
        assert state.context(rollouts.builder) == played["prompt_ids"][k]
        for tokens in actions:
            result = env.step_sync(tokenizer.decode(tokens).strip())
            state.advance(rollouts.builder, tokenizer.decode(tokens).strip(), tokens, result)
            if result.over:
                break
            context = state.context(rollouts.builder)
            assert whole[:len(context)] == context
        assert played["outcome"][k] == float(result.success)



def test_trl_is_installed():
    trl = need_trl()
    assert trl.GRPOTrainer is not None


def test_peer_rollout_and_update(tmp_path, tiny_model):
    need_trl()

    peer = load_script("ops/peer/trl_grpo.py")
    out = tmp_path / "trl"
    out.mkdir()
    args = peer.parser().parse_args([
        "--out", str(out), "--model-dir", tiny_model, "--twx-params", GAME, "--max-steps", "2",
        "--num-generations", "2", "--games-per-update", "2", "--micro-batch", "2",
        "--max-updates", "1", "--train-seeds", "0,1", "--threads", "1"])
    tally = peer.Tally()
    trainer, rollouts = peer.build(args, tally)

    # the rollout, as GRPOTrainer calls it: prompts of one generation batch, the trainer
    seeds = [0, 0, 1, 1]
    played = rollouts([f"game:{s}" for s in seeds], trainer)
    assert set(played) >= {"prompt_ids", "completion_ids", "logprobs", "env_mask", "outcome"}
    assert len(played["completion_ids"]) == len(seeds)
    assert tally.episodes == 4 and 4 <= tally.env_steps <= 8
    assert_sequences_are_gyre_contexts(rollouts, seeds, played, 2)

    # one optimizer step through the trainer, and the version it saved
    tally.log = open(out / "episodes.jsonl", "a")
    trainer.train()
    tally.log.close()
    versions = peer.versions_of(out)
    assert [v["version"] for v in versions] == [1]
    assert versions[0]["env_steps"] >= 8 and versions[0]["episodes"] >= 8
    assert len((out / "episodes.jsonl").read_text().splitlines()) == 4

    # the judge loads it into Gyre's torch policy: same adapter names, rank and targets
    from gyre_async.core.rollout import PolicyHolder
    from gyre_async.policy.hf_policy import HFPolicy
    from schemas.config import LoraSection

    bench = load_script("ops/bench/peer.py")
    policy = HFPolicy.from_pretrained(tiny_model, lora=LoraSection(rank=8, alpha=16.0))
    holder = PolicyHolder(policy, 0)
    bench.load_trl_adapter(holder, versions[0]["path"], 1)
    from safetensors.torch import load_file

    saved = load_file(f"{versions[0]['path']}/adapter_model.safetensors")
    mine = policy.state_dict()
    assert holder.version == 1 and saved
    for name, tensor in saved.items():
        assert torch.equal(mine[name], tensor), name
    meta = json.loads((out / "versions" / "v00001" / "meta.json").read_text())
    assert meta["wall_s"] > 0 and not meta["over_budget"]


def long_task_preset(name):
    """The game settings ``llm.py`` runs a long task with (``--long-task cooking|simon``)."""
    llm = load_script("ops/bench/llm.py")
    preset = llm.LONG_TASKS[{"cooking-long": "cooking", "simon-long": "simon"}[name]]
    return {k: preset[k] for k in ("twx_game", "twx_params", "max_steps", "max_hint_actions",
                                   "segment_hint") if k in preset}


@pytest.mark.parametrize("task", ["cooking-long", "simon-long"])
def test_the_long_task_plays_with_its_own_hint(tmp_path, tiny_model, task):
    """``--task cooking-long`` / ``simon-long``: the games of ``llm.py --long-task`` (a
    CookingWorld with 24-step gold paths) and ``--long-task simon`` (Simon Says with memory),
    each with its hint of up to 72 valid commands listed once per game and then what changed;
    the sequences are still Gyre's evaluator's contexts, token for token."""
    need_trl()
    peer = load_script("ops/peer/trl_grpo.py")
    game, params, cap = peer.TASKS[task]
    preset = long_task_preset(task)
    assert {"twx_game": game, "twx_params": params, "max_steps": cap, "max_hint_actions": 72,
            "segment_hint": "changes"} == {"segment_hint": "changes", **preset}
    args = peer.parser().parse_args([
        "--out", str(tmp_path), "--task", task, "--model-dir", tiny_model,
        "--max-steps", "3", "--num-generations", "2", "--micro-batch", "2",
        "--max-updates", "1", "--train-seeds", "0", "--threads", "1"])
    assert peer.hint_settings(args) == (72, "changes")
    trainer, rollouts = peer.build(args, peer.Tally())
    assert rollouts.env_config["max_hint_actions"] == 72 and rollouts.builder.hint == "changes"
    assert rollouts.env_config["game"] == game
    played = rollouts(["game:0", "game:0"], trainer)
    assert_sequences_are_gyre_contexts(rollouts, [0, 0], played, 3)


def warm_judge_config(bench, warm, argv):
    """The config TRL's judge plays with, its adapters on ``warm`` (Gyre's version 0)."""
    return bench.trl_eval_config(bench.parser().parse_args(
        ["--judge-trl-child", "--judge-model", warm, "--llm-argv", *argv]))


def test_the_long_task_pair_starts_both_sides_from_gyres_warm_start(tmp_path):
    """``peer.py --task cooking-long``: Gyre's side is ``llm.py --long-task`` (its warm start
    is version 0, not skipped as run F's is), TRL's judge plays TRL's adapters on Gyre's
    version 0 merged (``--judge-model``) with the long task's hint, in TRL's context form
    (one sequence per game), and the sides cannot run at once (TRL needs Gyre's version 0)."""
    bench = load_script("ops/bench/peer.py")
    args = bench.parser().parse_args(["--task", "cooking-long", "--minutes", "75"])
    argv = bench.llm_argv(str(tmp_path / "g"), bench.task_spec("cooking-long", args), args,
                          "cooking-long")
    assert "--long-task" in argv and "--warmstart-demos" not in argv
    coin = bench.llm_argv(str(tmp_path / "c"), bench.task_spec("coin7", args), args, "coin7")
    assert coin[coin.index("--warmstart-demos") + 1] == "0"
    warm = str(tmp_path / "warm-v0")
    cfg = warm_judge_config(bench, warm, argv)
    assert cfg.policy.model == warm and cfg.policy.segment_hint == "changes"
    assert cfg.task.env_config["max_hint_actions"] == 72
    assert cfg.policy.context == "segment" and cfg.policy.context_tokens == 8192
    assert cfg.segmenter.max_segment_steps == 64 and not cfg.segmenter.close_on_milestone
    run_f = bench.trl_eval_config(bench.parser().parse_args(["--judge-trl-child",
                                                             "--llm-argv", *coin]))
    assert run_f.policy.model == "smollm2" and run_f.policy.segment_hint == "full"
    with pytest.raises(SystemExit, match="one after the other"):
        bench.main(["--task", "cooking-long", "--together", "--out", str(tmp_path / "o")])


def test_the_simon_pair_judges_trl_on_simons_games_and_warm_start(tmp_path):
    """``peer.py --task simon-long``: Gyre's side is ``llm.py --long-task simon`` in sync
    groups of 8; TRL's judge plays Simon Says (60-step cap, one segment per game, its hint)
    on Gyre's version 0, and ``--trl-minutes`` sets TRL's clock."""
    bench = load_script("ops/bench/peer.py")
    args = bench.parser().parse_args(["--task", "simon-long", "--trl-minutes", "60"])
    argv = bench.llm_argv(str(tmp_path / "g"), bench.task_spec("simon-long", args), args,
                          "simon-long")
    assert argv[argv.index("--long-task") + 1] == "simon" and args.trl_minutes == 60
    assert argv[argv.index("--group-size") + 1] == "8"
    warm = str(tmp_path / "warm-v0")
    cfg = warm_judge_config(bench, warm, argv)
    assert cfg.policy.model == warm and cfg.policy.segment_hint == "changes"
    assert cfg.task.env_config["game"] == "simonsays"
    assert cfg.task.env_config["max_hint_actions"] == 72 and cfg.task.env_config["max_steps"] == 60
    assert cfg.segmenter.max_segment_steps == 60 and not cfg.segmenter.close_on_milestone
    # the judge reads TRL's versions through the contexts TRL's rollouts built
    peer = load_script("ops/peer/trl_grpo.py")
    from gyre_async.policy.hf_policy import HFTokenizer
    from gyre_async.policy.smollm2 import ensure_converted

    tokenizer = HFTokenizer.from_pretrained(str(ensure_converted()))
    judged = bench.trl_judge_builder(cfg, tokenizer)
    rollouts = peer.GameRollouts(tokenizer, {"game": "simonsays", "max_steps": 60}, peer.Tally(),
                                 hint="changes")
    for field in ("hint", "mode", "max_tokens", "history_turns", "summary_max_tokens"):
        assert getattr(judged, field) == getattr(rollouts.builder, field), field


def test_a_longer_trl_clock_adds_candidates_from_gyres_clock():
    """``--trl-minutes`` above Gyre's clock: TRL's candidates are evenly spaced over its whole
    run and again over the versions it had saved by Gyre's clock (the last of those
    included), so a same-clock version can be chosen on dev games."""
    bench = load_script("ops/bench/peer.py")
    versions = [{"version": v, "wall_s": 100.0 * v, "over_budget": v > 30} for v in range(1, 33)]
    whole = [v["version"] for v in bench.trl_candidates(versions, 4)]
    assert whole == [8, 16, 24, 30]
    both = [v["version"] for v in bench.trl_candidates(versions, 4, clock_s=1350.0)]
    assert both == [4, 8, 12, 13, 16, 24, 30]


def test_a_given_warm_start_is_both_sides_start_and_gyres_side_runs_the_preset(tmp_path):
    """``peer.py --task simon-long --warm-model DIR``: Gyre's side is ``llm.py --long-task
    simon`` itself (sync groups of 8, the critic on its own head: the preset reaches the
    child's config, which parsed flags alone did not) from DIR with no warm start of its own
    and the clock, not the preset's env steps, ending it; TRL's judge plays on DIR; the
    sides may then train at once; a folder that is not a model is refused by name."""
    llm = load_script("ops/bench/llm.py")
    bench = load_script("ops/bench/peer.py")
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "config.json").write_text("{}")
    args = bench.parser().parse_args(["--task", "simon-long", "--warm-model", str(warm),
                                      "--minutes", "60", "--together"])
    argv = bench.llm_argv(str(tmp_path / "g"), bench.task_spec("simon-long", args), args,
                          "simon-long")
    gyre = llm.parse_args(argv)
    assert (gyre.mode, gyre.group_size, gyre.critic_head_only) == ("sync", 8, True)
    assert (gyre.model, gyre.warmstart_demos, gyre.env_steps, gyre.minutes) == (str(warm), 0, 0, 60)
    cfg = llm.bench_config(gyre)
    assert cfg.policy.model == str(warm) and cfg.loop.max_env_steps == 0
    assert cfg.run.mode == "sync" and cfg.learner.value_trunk_gradient is False
    assert warm_judge_config(bench, str(warm), argv).policy.model == str(warm)
    with pytest.raises(SystemExit, match="not a model folder"):
        bench.main(["--task", "simon-long", "--warm-model", str(tmp_path), "--together",
                    "--out", str(tmp_path / "o")])
