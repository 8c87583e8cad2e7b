"""How fast the tiny policy samples a batch of actions (the sampler's inner call).

Usage: python ops/bench/act_batch.py [--batch 64] [--repeats 10]

Samples one batch of ``--batch`` workshop-vocabulary contexts of 56-64 tokens, up to 4
action tokens each, ``--repeats`` times after a warm-up, and prints best and median
latency and the per-context cost. Last line JSON.
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import print_result

from gyre_async.compose import tokenizer_for_env
from gyre_async.envs import ACTION_WORDS
from gyre_async.policy import ModelConfig, SamplingParams, TorchPolicy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64, help="contexts per act_batch call")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls after one warm-up")
    args = ap.parse_args()
    tok = tokenizer_for_env("workshop")
    ids = tuple(tok.token_id(w) for w in ACTION_WORDS)
    policy = TorchPolicy(ModelConfig(vocab_size=tok.vocab_size, action_token_ids=ids), tok, seed=0)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(56, 65, (args.batch,), generator=gen).tolist()
    contexts = [[tok.bos_id, *torch.randint(8, tok.vocab_size, (n - 2,), generator=gen).tolist(),
                 tok.act_id] for n in lengths]
    params = SamplingParams(max_action_tokens=4)
    policy.act_batch(contexts, params, seed=0)
    times = []
    for i in range(args.repeats):
        start = time.perf_counter()
        policy.act_batch(contexts, params, seed=i + 1)
        times.append(time.perf_counter() - start)
    best, median = min(times) * 1000, sorted(times)[len(times) // 2] * 1000
    print(f"act_batch: {args.batch} contexts of 56-64 tokens, up to 4 action tokens: "
          f"best {best:.1f} ms, median {median:.1f} ms on {torch.get_num_threads()} threads")
    print_result({"bench": "act_batch", "batch": args.batch, "best_ms": round(best, 2),
                  "median_ms": round(median, 2), "per_context_ms": round(median / args.batch, 3),
                  "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
