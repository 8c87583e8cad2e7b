"""Prompt-lookup drafts while acting: SmolLM2 on the long task's segment contexts.

Usage: python ops/bench/act_drafts.py [--steps 24] [--draft-tokens 8] [--seed 1] [--model DIR]

One episode of the long task (CookingWorld, 4 rooms, 3 ingredients; by default the valid
commands at the segment's opening, then what changed: ``policy.segment_hint = "changes"``)
is played with segment contexts by SmolLM2-135M-Instruct (``--model``: or a warm start of
it, which writes commands where the base model often writes prose), sampled at 0.7. At every step, on that
step's context, side by side (each once per step, in turn):

- ``gyre_draft`` / ``gyre_plain``: ``HFPolicy.act_batch`` with the episode's session (only
  the tokens past its cached prefix are computed), with prompt-lookup drafts of up to
  ``--draft-tokens`` tokens and with one token per forward pass; two policies, each with
  sessions of its own. The drafted one's action moves the episode on.
- ``gyre_draft_whole`` / ``gyre_plain_whole``: the same without a session: the whole
  context computed, as ``generate`` computes it.
- ``hf_lookup`` / ``hf_plain``: transformers' own ``generate`` on the whole context, with
  ``prompt_lookup_num_tokens`` (its prompt-lookup decoding, batch of one) and without.

Every variant samples at the same temperature, so actions differ between variants; the
seconds and forward passes are per action. Last line JSON: per variant the mean seconds,
forwards and tokens per action, and the ratios drafted/plain for Gyre and for
transformers, and Gyre's drafted acting over transformers' prompt lookup on whole contexts.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import LONG_TASK_GAME, make_config, print_result

from gyre_async.compose import build_context_builder, build_policy
from gyre_async.core.resumption import task_id_of
from gyre_async.core.rollout import Acted, run_episode
from gyre_async.envs import make_env
from gyre_async.policy.base import Action, SamplingParams
from gyre_async.policy.hf_policy import HFPolicy

VARIANTS = ("gyre_draft", "gyre_plain", "gyre_draft_whole", "gyre_plain_whole",
            "hf_lookup", "hf_plain")


def forward_counter(policy: HFPolicy) -> list[int]:
    """A one-element list counting the decoder's forward passes (a hook: any caller)."""
    count = [0]
    policy.model.lm.get_decoder().register_forward_pre_hook(
        lambda *_: count.__setitem__(0, count[0] + 1))
    return count


def hf_generate(policy: HFPolicy, context: list[int], params: SamplingParams,
                lookup: int) -> int:
    """transformers' ``generate`` on the whole context; the new tokens' count."""
    ids = torch.tensor([context])
    extra: dict[str, Any] = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    with torch.inference_mode():
        out = policy.model.lm.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
            temperature=params.temperature, top_p=1.0, top_k=0,
            max_new_tokens=params.max_action_tokens,
            eos_token_id=sorted(policy.tokenizer.stop_ids), pad_token_id=policy.tokenizer.pad_id,
            **extra)
    return out.shape[1] - ids.shape[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24, help="steps of the episode measured")
    ap.add_argument("--draft-tokens", type=int, default=8, help="drafted tokens per pass")
    ap.add_argument("--seed", type=int, default=1, help="the game and the sampling")
    ap.add_argument("--model", default="smollm2",
                    help="policy.model: smollm2 (the base model), or a local model directory, "
                    "e.g. a warm start saved by ops/bench/llm.py --save-warm")
    ap.add_argument("--segment-hint", default="changes", choices=["full", "changes"],
                    help="policy.segment_hint (a warm start plays best with the hint it was "
                    "cloned with)")
    args = ap.parse_args()
    cfg = make_config(
        run={"seed": args.seed},
        task={"env": "twx", "env_config": {
            "game": LONG_TASK_GAME["twx_game"], "params": LONG_TASK_GAME["twx_params"],
            "max_steps": args.steps, "admissible": "hint",
            "max_hint_actions": LONG_TASK_GAME["max_hint_actions"]}},
        policy={"backend": "hf", "model": args.model, "context": "segment",
                "segment_hint": args.segment_hint, "context_tokens": 4096,
                "max_action_tokens": 12,
                "lora": {"rank": 0}},
        segmenter={"max_segment_steps": args.steps})
    policies = {name: build_policy(cfg) for name in ("draft", "plain")}
    policies["draft"].draft_tokens = args.draft_tokens
    assert isinstance(policies["draft"], HFPolicy) and isinstance(policies["plain"], HFPolicy)
    forwards = {name: forward_counter(p) for name, p in policies.items()}
    builder = build_context_builder(cfg, policies["draft"].tokenizer)
    params = SamplingParams(temperature=0.7, max_action_tokens=12)
    rows: dict[str, list[tuple[float, int, int]]] = {v: [] for v in VARIANTS}

    def timed(variant: str, policy: str, call: Callable[[], int]) -> None:
        before = forwards[policy][0]
        started = time.perf_counter()
        tokens = call()
        rows[variant].append((time.perf_counter() - started,
                              forwards[policy][0] - before, tokens))

    step = [0]

    async def act(context: list[int]) -> Acted:
        step[0] += 1
        seed = args.seed * 1000 + step[0]
        out: list[Action] = []

        def gyre(policy: str, session: str | None) -> Callable[[], int]:
            def call() -> int:
                out.append(policies[policy].act_batch(
                    [context], params, seed=seed,
                    sessions=[session] if session else None)[0])
                return len(out[-1].tokens)
            return call

        timed("gyre_draft", "draft", gyre("draft", "episode"))
        action = out[0]
        timed("gyre_plain", "plain", gyre("plain", "episode"))
        timed("gyre_draft_whole", "draft", gyre("draft", None))
        timed("gyre_plain_whole", "plain", gyre("plain", None))
        for variant, lookup in (("hf_lookup", args.draft_tokens), ("hf_plain", 0)):
            torch.manual_seed(seed)
            timed(variant, "plain", lambda lookup=lookup: hf_generate(
                policies["plain"], context, params, lookup))
        print({v: [round(x, 3) for x in rows[v][-1]] for v in VARIANTS},
              f"context {len(context)} tokens", flush=True)
        return Acted(action, 0)

    async def play() -> None:
        env = make_env(cfg.task.env, **cfg.task.env_config)
        try:
            await run_episode(env, task_id_of(cfg.task.env, args.seed), args.seed, act, builder,
                              step_timeout_s=600.0, segments=cfg.segmenter)
        finally:
            await env.close()

    asyncio.run(play())
    mean = {v: {"seconds": round(statistics.fmean(r[0] for r in rows[v]), 4),
                "forwards": round(statistics.fmean(r[1] for r in rows[v]), 2),
                "tokens": round(statistics.fmean(r[2] for r in rows[v]), 2)}
            for v in VARIANTS}
    later = {v: rows[v][1:] or rows[v] for v in VARIANTS}  # the opening prefills the prompt

    def ratio(a: str, b: str, rows_of: dict = later) -> float:
        return round(sum(r[0] for r in rows_of[a]) / sum(r[0] for r in rows_of[b]), 3)

    print_result({
        "bench": "act_drafts", "model": args.model, "segment_hint": args.segment_hint,
        "steps": step[0], "draft_tokens": args.draft_tokens,
        "threads": torch.get_num_threads(), "per_action": mean,
        "draft_kept_fraction": round(policies["draft"].accepted_tokens
                                     / max(policies["draft"].drafted_tokens, 1), 3),
        # seconds, drafted over plain, steps after the first
        "gyre_sessions_draft_over_plain": ratio("gyre_draft", "gyre_plain"),
        "gyre_whole_draft_over_plain": ratio("gyre_draft_whole", "gyre_plain_whole"),
        "hf_lookup_over_plain": ratio("hf_lookup", "hf_plain"),
        "gyre_whole_draft_over_hf_lookup": ratio("gyre_draft_whole", "hf_lookup"),
        "gyre_sessions_draft_over_hf_lookup": ratio("gyre_draft", "hf_lookup")})


if __name__ == "__main__":
    main()
