"""Where an LLM acting step goes: SmolLM2 acting on cached sessions (segment contexts)
against ``transformers``' own ``generate`` on the same contexts, step by step.

Usage: python ops/bench/act_sessions.py [--batch 16] [--steps 6] [--threads 2]

``--batch`` episodes act together for ``--steps`` steps. Each context starts as a ~240-token
prompt (Gyre's system text and worked example) plus a ~75-token observation, and every step
appends the action written and the observation again: the shape of a segment context.
Each step, side by side on the same contexts:

- **gyre**: ``HFPolicy.act_batch`` with one session per episode (the keys/values of the
  episode's context so far are kept between its steps, so only the new tokens are
  prefilled), its time split into prefill of the new tokens, decoding, and copying cached
  keys/values in and out of the batch;
- **concat**: the same ``act_batch`` (a second copy of the model with sessions of its own,
  the same seed) on transformers' own
  ``DynamicLayer``, which concatenates the whole cache for every generated token, where
  Gyre's layer appends into preallocated room (``HFPolicy.roomy_cache``);
- **raw**: ``model.generate`` on the whole contexts (left-padded, the same new-token cap,
  sampled): what acting costs without a cache across steps.

Last line JSON: per step the two times and the ratio, and the split of Gyre's time.
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any

import torch
from _common import print_result

from gyre_async.policy.base import SamplingParams
from gyre_async.policy.hf_policy import HFPolicy
from gyre_async.policy.smollm2 import ensure_converted

OBSERVATION = (
    "You are in the kitchen. In one part of the room you see a fridge that is closed. There "
    "is also a counter that has a red apple and a knife on it. Valid commands: open fridge, "
    "take red apple, take knife, move north, move east, look around, inventory, examine "
    "cookbook")


def timed(policy: HFPolicy, split: dict[str, float]) -> None:
    """Wrap the policy's forward and cache copies to add their seconds to ``split``."""
    for name in ("_forward", "_past_cache", "_keep"):
        inner = getattr(policy, name)

        def wrapper(*args: Any, _inner=inner, _name=name, **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = _inner(*args, **kwargs)
            spent = time.perf_counter() - started
            if _name == "_forward":
                split["prefill" if args[0].shape[1] > 1 else "decode"] += spent
            else:
                split["cache_copies"] += spent
            return out

        setattr(policy, name, wrapper)


def raw_generate(policy: HFPolicy, contexts: list[list[int]], new_tokens: int) -> float:
    """Seconds for ``transformers``' ``generate`` on the whole contexts."""
    pad = policy.tokenizer.pad_id
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for i, c in enumerate(contexts):
        ids[i, width - len(c):] = torch.tensor(c)
        mask[i, width - len(c):] = 1
    started = time.perf_counter()
    with torch.inference_mode():
        policy.model.lm.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                 temperature=0.7, top_p=1.0, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=pad)
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16, help="episodes acting together")
    ap.add_argument("--steps", type=int, default=6, help="steps per episode")
    ap.add_argument("--new-tokens", type=int, default=12, help="action token cap")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    policy = HFPolicy.from_pretrained(str(ensure_converted()))
    concat_policy = HFPolicy.from_pretrained(str(ensure_converted()))  # sessions of its own
    concat_policy.roomy_cache = False  # transformers' own cache layer
    split: dict[str, float] = collections.defaultdict(float)
    timed(policy, split)
    timed(concat_policy, split)
    tok = policy.tokenizer
    observation = tok.encode(OBSERVATION)
    prompt = tok.encode("You play a text adventure game. Write one command. " * 20)
    contexts = [[*prompt, *observation] for _ in range(args.batch)]
    params = SamplingParams(temperature=0.7, max_action_tokens=args.new_tokens)
    sessions = [f"episode-{i}" for i in range(args.batch)]
    rows = []
    for step in range(args.steps):
        split.clear()
        started = time.perf_counter()
        actions = policy.act_batch(contexts, params, seed=step, sessions=sessions)
        gyre_s = time.perf_counter() - started
        gyre_split = dict(split)
        split.clear()
        started = time.perf_counter()
        concat = concat_policy.act_batch(contexts, params, seed=step, sessions=sessions)
        concat_s = time.perf_counter() - started
        concat_split = dict(split)
        raw_s = raw_generate(policy, contexts, args.new_tokens)
        rows.append({"step": step, "context_tokens": len(contexts[0]),
                     "gyre_s": round(gyre_s, 3), "concat_s": round(concat_s, 3),
                     "raw_s": round(raw_s, 3), "raw_over_gyre": round(raw_s / gyre_s, 3),
                     "concat_over_gyre": round(concat_s / gyre_s, 3),
                     "same_actions": [a.tokens for a in actions] == [a.tokens for a in concat],
                     "gyre_split_s": {k: round(v, 3) for k, v in gyre_split.items()},
                     "concat_split_s": {k: round(v, 3) for k, v in concat_split.items()}})
        print(rows[-1], flush=True)
        contexts = [[*c, *a.tokens, *observation] for c, a in zip(contexts, actions)]
    later = rows[1:] or rows

    def ratio(key: str) -> float:
        return round(sum(r[key] for r in later) / sum(r["gyre_s"] for r in later), 3)

    print_result({"bench": "act_sessions", "batch": args.batch, "threads":
                  torch.get_num_threads(), "steps": rows,
                  "raw_over_gyre_after_first": ratio("raw_s"),
                  "concat_over_gyre_after_first": ratio("concat_s"),
                  "same_actions": all(r["same_actions"] for r in rows)})


if __name__ == "__main__":
    main()
