"""Window contexts vs segment sequences, side by side: the same task, model and starting
policy version, the whole loop run once in each context mode (``policy.context``).

- ``window`` (today's LLM runs): every step's context is rebuilt from the prompt, the
  milestone summary and the observation (``history_turns`` past turns), and computed whole
  by the sampler and again by the learner.
- ``segment``: one append-only sequence per training segment; the sampler keeps each
  episode's keys/values between its steps and computes only what is new, the learner reads
  a segment in one forward pass.

Each mode runs ``gyre run``'s loop for ``--minutes`` in a process of its own (its peak
memory its own), then plays ``--check-episodes`` episodes with the run's first policy
version to compare acting's log-probs with the learner's. Per mode:

- ``prefill_tokens_per_step``: context tokens the sampler's policy computed (not taken from
  its cache) per env step, from the sampler's last heartbeat (``prefill_computed``);
- ``learner_tokens_per_step``: tokens the learner reads per step and pass over the run's
  stored segments (each step's context and action; a one-sequence segment's sequence once);
- ``env_steps_per_s``: the loop's env steps per second (first to last step, the run's
  summary);
- ``logprob_max_abs_diff``: the largest difference between the log-probs acting gave a
  sampled token (raw policy, ``Action.policy_logprobs``) and the learner's for it, on the
  check episodes: the learner's path of the mode (each context apart; one pass per segment)
  against acting's (whole contexts; cached prefixes);
- ``peak_rss_mb``: the mode's process's peak resident memory;
- ``stale_dropped_fraction``: env steps the learner dropped as stale over those sampled;
- ``act_forwards_per_step`` and ``draft_kept_fraction``: the sampler's forward passes per
  env step, and the share of prompt-lookup drafted tokens it kept (``--draft-tokens``,
  both modes; exact, so the log-prob check holds with drafts as without).

``--smoke``: the tiny word policy on the workshop, seconds per mode, in this process (peak
memory then counts both modes); what ``tests/test_llm_sequence.py`` runs. The real one is
SmolLM2-135M-Instruct + LoRA on TextWorldExpress coin, 7 rooms (Run F's task and settings).
Last line, one JSON object: {"bench": "llm_sequence", "prefill_tokens_per_step":
{"window": x, "segment": x}, ..., "ratios": {...}}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

from _common import (
    LONG_TASK_GAME,
    TINY,
    add_pacing_flags,
    apply_preset,
    make_config,
    memory_kb,
    print_result,
    run_summary,
)

from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_events
from gyre_async.compose import build_context_builder, build_policy
from gyre_async.core.resumption import task_id_of
from gyre_async.core.rollout import ActionBatcher, PolicyHolder, StepRecord, run_episode
from gyre_async.core.segmenter import segment_sequence
from gyre_async.envs import make_env
from gyre_async.policy.base import SamplingParams
from gyre_async.storage.segments import SegmentStore
from schemas.config import Config
from schemas.events import Heartbeat
from schemas.topics import TELEMETRY

MODES = ("window", "segment")
FIELDS = ("prefill_tokens_per_step", "learner_tokens_per_step", "env_steps_per_s",
          "logprob_max_abs_diff", "peak_rss_mb", "stale_dropped_fraction")
#: check episodes play seeds from here on (training seeds start at task.train_seed_start)
CHECK_SEED = 9_000_000
#: segment mode: steps whose context the check also evaluates apart (one pass vs apart)
APART_STEPS = 8


#: ``--long-task``: the long task's game, windows that hold its hinted observations, and
#: acting with prompt-lookup drafts in both modes (exact: docs/llm.md, "Drafts")
LONG_TASK_SEQUENCE = {**LONG_TASK_GAME, "window_tokens": 640, "draft_tokens": 8}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny policy, workshop, seconds")
    p.add_argument("--out", default="runs/bench-llm-sequence", help="run directories, result")
    p.add_argument("--minutes", type=float, default=5.0, help="loop wall clock per mode")
    p.add_argument("--modes", default=",".join(MODES), help="which modes, in this order")
    p.add_argument("--long-task", action="store_true",
                   help="the long task of ops/bench/llm.py --long-task (CookingWorld, 64-step "
                   "cap, up to 72 hinted commands) with windows of 640 tokens, which hold a "
                   "hinted observation whole, and --draft-tokens 8; flags given explicitly "
                   "still win")
    p.add_argument("--twx-game", default="coin")
    p.add_argument("--twx-params", default="numLocations=7,includeDoors=0,numDistractorItems=0")
    p.add_argument("--max-steps", type=int, default=20, help="episode cap (Run F: 20)")
    add_pacing_flags(p, ", both modes")
    p.add_argument("--max-hint-actions", type=int, default=24,
                   help="valid commands the hint lists at most (Run F: 24; the long task: 72)")
    p.add_argument("--window-tokens", type=int, default=320,
                   help="window mode: policy.context_tokens (Run F: 320)")
    p.add_argument("--history-turns", type=int, default=0, help="window mode (Run F: 0)")
    p.add_argument("--segment-tokens", type=int, default=2048,
                   help="segment mode: policy.context_tokens, the budget of one segment")
    p.add_argument("--segment-hint", default="full", choices=["full", "changes"],
                   help="segment mode's policy.segment_hint: the whole valid-command list at "
                   "every step, or at a segment's opening and then only what changed")
    p.add_argument("--max-action-tokens", type=int, default=12)
    p.add_argument("--draft-tokens", type=int, default=0,
                   help="policy.draft_tokens, both modes: prompt-lookup drafts read per "
                   "forward pass while acting (0: one token per pass)")
    p.add_argument("--num-envs", type=int, default=8)
    p.add_argument("--batch-steps", type=int, default=32)
    p.add_argument("--minibatch-steps", type=int, default=8)
    p.add_argument("--micro-steps", type=int, default=2, help="window mode's micro-batches")
    p.add_argument("--micro-tokens", type=int, default=2400,
                   help="segment mode's micro-batches (whole segments up to this many tokens)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=2e-4)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--probe-contexts", type=int, default=16,
                   help="keeper.probe_contexts, both modes: the keeper measures every update's "
                   "KL on this many contexts, one pass each per version on the loop's cores "
                   "(64, the default of tiny-policy runs, is ~38 s of SmolLM2 per version "
                   "here: ops/bench/keeper_probe.py)")
    p.add_argument("--check-episodes", type=int, default=2,
                   help="episodes played after the loop to compare acting's log-probs with the "
                   "learner's (0: none; the check's figures are then null)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)  # one mode's process
    return p


def mode_config(args: argparse.Namespace, mode: str) -> Config:
    """The run of one mode: everything the same but ``policy.context`` (and the token
    budget and micro-batching that go with it)."""
    run = {"run_id": f"seq-{mode}", "run_dir": os.path.join(args.out, mode), "seed": args.seed,
           "mode": "async"}
    if args.smoke:
        return make_config(
            TINY, run=run,
            policy={"context": mode, "context_tokens": 64 if mode == "window" else 160,
                    "draft_tokens": args.draft_tokens},
            task={"env_config": {"n_orders": 3, "max_steps": 40}},
            sampler={"num_envs": 4}, segmenter={"max_segment_steps": 8},
            learner={"batch_steps": 64, "minibatch_steps": 32, "max_versions": 1,
                     "micro_tokens": 400 if mode == "segment" else 0},
            evaluator={"every_versions": 0, "seeds": [0]},
            loop={"max_wall_s": 60 * args.minutes})
    segment = mode == "segment"
    return make_config(
        run=run,
        task={"env": "twx", "env_config": {"game": args.twx_game, "params": args.twx_params,
                                           "max_steps": args.max_steps, "admissible": "hint",
                                           "max_hint_actions": args.max_hint_actions}},
        policy={"backend": "hf", "model": "smollm2", "context": mode,
                "segment_hint": args.segment_hint if segment else "full",
                "context_tokens": args.segment_tokens if segment else args.window_tokens,
                "history_turns": 0 if segment else args.history_turns,
                "max_action_tokens": args.max_action_tokens, "draft_tokens": args.draft_tokens,
                "lora": {"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank}},
        sampler={"num_envs": args.num_envs, "temperature": args.temperature, "group_size": 1,
                 "step_timeout_s": 300.0},
        segmenter={"max_segment_steps": args.max_segment_steps or args.max_steps,
                   "milestone_min_steps": args.milestone_min_steps,
                   "cap_ends_episode": True},
        learner={"batch_steps": args.batch_steps, "minibatch_steps": args.minibatch_steps,
                 "epochs": 1, "learning_rate": args.learning_rate, "max_versions": 0,
                 "micro_steps": 0 if segment else args.micro_steps,
                 "micro_tokens": args.micro_tokens if segment else 0, "entropy_coef": 0.0},
        # version 0 and the final version only: an evaluation is a whole episode (64 steps
        # on the long task) on the loop's cores, and "every version" (0 reads as 1) charged
        # the mode that makes more versions more of them
        evaluator={"every_versions": 10_000, "seeds": [0], "temperature": args.temperature,
                   "env_config": {"split": "dev"}},
        keeper={"probe_contexts": args.probe_contexts},
        loop={"max_wall_s": 60 * args.minutes, "max_staleness": args.max_staleness})


# --- the figures of one mode ----------------------------------------------------------------

async def sampler_stats(cfg: Config) -> dict[str, float]:
    """The sampler's last heartbeat (sent as it stopped): its counters."""
    stats: dict[str, float] = {}
    async with open_bus(f"sqlite:///{cfg.run.run_dir}/events.db", reader=True) as bus:
        async for _, event in read_events(bus, [TELEMETRY], on_bad="skip",
                                          run_id=cfg.run.run_id):
            if isinstance(event, Heartbeat) and event.role == "sampler":
                stats = dict(event.stats)
    return stats


def learner_tokens(cfg: Config) -> tuple[int, int]:
    """(tokens, steps) of the run's stored segments as the learner reads them in a pass."""
    store = SegmentStore(f"{cfg.run.run_dir}/segments.zarr", read_only=True)
    tokens = steps = 0
    for sid in store.list_segments():
        arrays = store.read(store.address(sid))
        actions = arrays["action_mask"].sum(axis=1)
        sequence = segment_sequence(arrays)
        tokens += len(sequence) if sequence is not None else int(
            (arrays["context_len"] + actions).sum())
        steps += len(actions)
    return tokens, steps


def logprob_check(cfg: Config, episodes: int) -> dict[str, float]:
    """Acting vs learning with the run's first version (a fresh policy: version 0 of the
    run), on ``episodes`` episodes played as the sampler plays them (segment mode: cached
    prefixes). The max |difference| of each sampled token's log-prob, acting's raw one
    against the learner's (window: each context apart; segment: one pass per segment), and
    in segment mode one pass against each context apart."""
    import torch

    policy = build_policy(cfg)
    builder = build_context_builder(cfg, policy.tokenizer)
    records: dict[str, list[StepRecord]] = {}

    async def play() -> None:
        params = SamplingParams(temperature=cfg.sampler.temperature,
                                max_action_tokens=cfg.policy.max_action_tokens)
        batcher = ActionBatcher(PolicyHolder(policy, 0), params, seed=cfg.run.seed)
        batcher.active = episodes

        async def one(k: int) -> None:
            seed, tid = CHECK_SEED + k, f"check-{k}"
            records[tid] = []
            env = make_env(cfg.task.env, **cfg.task.env_config)

            async def on_step(record: StepRecord) -> None:
                records[tid].append(record)

            async def act(context):
                return await batcher.act(context, session=tid if builder.segments else None)
            try:
                await run_episode(env, task_id_of(cfg.task.env, seed), seed, act, builder,
                                  step_timeout_s=cfg.sampler.step_timeout_s, on_step=on_step,
                                  segments=cfg.segmenter)
            finally:
                batcher.active -= 1
                await env.close()
        try:
            await asyncio.gather(*(one(k) for k in range(episodes)))
        finally:
            batcher.close()

    asyncio.run(play())
    steps = [r for recs in records.values() for r in recs]
    out = {"steps": float(len(steps)),
           "prefill_tokens_per_step": round(policy.prefill_computed / len(steps), 1)}
    acted = torch.zeros(len(steps), max(len(r.acted.action.tokens) for r in steps))
    for i, r in enumerate(steps):
        acted[i, :len(r.acted.action.tokens)] = torch.tensor(r.acted.action.policy_logprobs)
    with torch.no_grad():
        # each context apart: all steps in window mode (what its learner does), at most
        # APART_STEPS spread over the episodes in segment mode (the reference is quadratic)
        pick = range(len(steps)) if not builder.segments else sorted(
            {round(i * (len(steps) - 1) / max(APART_STEPS - 1, 1))
             for i in range(min(APART_STEPS, len(steps)))})
        apart = torch.zeros_like(acted)
        for chunk in [list(pick)[k:k + 4] for k in range(0, len(pick), 4)]:
            logp = policy.evaluate([steps[i].context for i in chunk],
                                   [steps[i].acted.action.tokens for i in chunk]).logprobs
            apart[torch.tensor(chunk), :logp.shape[1]] = logp
        if not builder.segments:
            out["acting_vs_learner"] = float((acted - apart).abs().max())
            out["learner_tokens_per_step"] = round(sum(
                len(r.context) + len(r.acted.action.tokens) for r in steps) / len(steps), 1)
            return out
        sequences, decisions, current = [], [], []
        for recs in records.values():
            for r in recs:
                current.append(r)
                if r.boundary is not None or r is recs[-1]:
                    sequences.append(current[-1].context + current[-1].acted.action.tokens)
                    decisions.append([(len(s.context), len(s.acted.action.tokens))
                                      for s in current])
                    current = []
        one = policy.evaluate_sequences(sequences, decisions).logprobs
    out["acting_vs_learner"] = float((acted - one).abs().max())
    rows = torch.tensor(list(pick))
    out["one_pass_vs_apart"] = float((one[rows] - apart[rows]).abs().max())
    out["learner_tokens_per_step"] = round(sum(map(len, sequences)) / len(steps), 1)
    return out


def measure(args: argparse.Namespace, mode: str) -> dict:
    """One mode: the loop, then its figures."""
    cfg = mode_config(args, mode)
    started = time.monotonic()
    summary = run_summary(cfg)
    loop_s = time.monotonic() - started
    stats = asyncio.run(sampler_stats(cfg))
    tokens, stored_steps = learner_tokens(cfg)
    check = logprob_check(cfg, args.check_episodes) if args.check_episodes > 0 else {
        "steps": 0.0, "acting_vs_learner": None, "prefill_tokens_per_step": None,
        "learner_tokens_per_step": None}  # --check-episodes 0: no check, no figures
    sampled = max(stats.get("steps", 0.0), 1.0)
    return {
        "prefill_tokens_per_step": round(stats.get("prefill_computed", 0.0) / sampled, 1),
        "prefill_reused_per_step": round(stats.get("prefill_reused", 0.0) / sampled, 1),
        "act_forwards_per_step": round(stats.get("act_forwards", 0.0) / sampled, 2),
        "draft_kept_fraction": round(stats.get("accepted_tokens", 0.0) / max(
            stats.get("drafted_tokens", 0.0), 1.0), 3),
        "learner_tokens_per_step": round(tokens / max(stored_steps, 1), 1),
        "env_steps_per_s": summary["env_steps_per_s"],
        "logprob_max_abs_diff": check["acting_vs_learner"],
        "one_pass_vs_apart_max_abs_diff": check.get("one_pass_vs_apart"),
        "peak_rss_mb": round(memory_kb()[0] / 1024, 1),
        "stale_dropped_fraction": summary["stale_dropped_fraction"],
        # slot-seconds the staleness gate held the sampler's slots, over all its slots' time
        "sampler_paused_fraction": round(stats.get("paused_s", 0.0) / max(
            summary["wall_seconds"] * cfg.sampler.num_envs, 1e-9), 3),
        "env_steps": summary["env_steps"], "stored_steps": stored_steps,
        "policy_versions": summary["policy_versions"], "loop_s": round(loop_s, 1),
        # the check episodes' own figures (the same policy version in both modes)
        "check_steps": check["steps"],
        "check_prefill_tokens_per_step": check["prefill_tokens_per_step"],
        "check_learner_tokens_per_step": check["learner_tokens_per_step"],
    }


def in_child(args: argparse.Namespace, argv: list[str], mode: str) -> dict:
    """``measure`` in a process of its own (its peak memory, no state shared)."""
    env = {**os.environ, "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2")}
    out = subprocess.run([sys.executable, __file__, *argv, "--child", mode], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"mode {mode} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def result_of(args: argparse.Namespace, per_mode: dict[str, dict]) -> dict:
    modes = list(per_mode)
    result: dict = {"bench": "llm_sequence", "smoke": args.smoke}
    for name in (*FIELDS, "prefill_reused_per_step", "act_forwards_per_step",
                 "draft_kept_fraction", "one_pass_vs_apart_max_abs_diff",
                 "sampler_paused_fraction", "env_steps", "policy_versions", "loop_s",
                 "check_steps",
                 "check_prefill_tokens_per_step", "check_learner_tokens_per_step"):
        result[name] = {mode: per_mode[mode].get(name) for mode in modes}
    if set(modes) == set(MODES):
        w, s = per_mode["window"], per_mode["segment"]
        result["ratios"] = {  # segment / window (targets: <= 0.35, <= 0.35, >= 2.5)
            name: round(s[name] / w[name], 3) if w[name] else None
            for name in ("prefill_tokens_per_step", "learner_tokens_per_step",
                         "env_steps_per_s", "check_prefill_tokens_per_step",
                         "check_learner_tokens_per_step")}
    result["settings"] = {k: v for k, v in vars(args).items() if k not in ("child", "out")}
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.long_task:
        apply_preset(args, argv, LONG_TASK_SEQUENCE)
    if args.child:
        print_result(measure(args, args.child))  # the parent reads this last line
        return 0
    os.makedirs(args.out, exist_ok=True)
    per_mode = {}
    for mode in args.modes.split(","):
        per_mode[mode] = measure(args, mode) if args.smoke else in_child(args, argv, mode)
        print(f"{mode}: {json.dumps(per_mode[mode])}", file=sys.stderr, flush=True)
    print_result(result_of(args, per_mode), os.path.join(args.out, "result.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
