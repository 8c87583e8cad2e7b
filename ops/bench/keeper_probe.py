"""What the keeper's measure of one update costs with an LLM: its KL on the probe set.

Usage: python ops/bench/keeper_probe.py [--contexts 64] [--rounds 3] [--threads 2] [--smoke]

The keeper calls an update large when the mean KL of next-token distributions, parent vs
new, on a fixed probe set (``keeper.probe_contexts``, 64) is above ``large_update_kl``. On
the long task (SmolLM2-135M-Instruct + LoRA, CookingWorld's hinted observations, the
probe set the keeper of ``ops/bench/llm_sequence.py --long-task`` builds) two ways, side
by side in each round on the same contexts and weights:

- **two_whole**: ``policy_kl`` as the keeper ran it before: both versions' log-probs, each
  context computed whole (``shared_prefix_min`` set out of reach);
- **one_shared**: the keeper now: the parent's log-probs kept from its own measure, the new
  version's computed once, the prompt every probe context shares computed once.

Both give the same KL (to float32 rounding; ``kl_abs_diff``). Last line JSON: per round
the seconds of each, the median ratio, the probe set's tokens and shared prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from _common import alternate, print_result
from llm_sequence import mode_config
from llm_sequence import parser as sequence_parser

from gyre_async.compose import build_policy
from gyre_async.core.probes import probe_contexts
from gyre_async.policy.torch_policy import _common_prefix
from gyre_async.rl.policy_distance import mean_kl, policy_kl, probe_logprobs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, default=64, help="probe contexts (keeper default)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="the tiny word policy, seconds")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    flags = ["--smoke"] if args.smoke else ["--long-task"]
    seq_args = sequence_parser().parse_args(flags)
    if not args.smoke:
        from _common import apply_preset
        from llm_sequence import LONG_TASK_SEQUENCE

        apply_preset(seq_args, flags, LONG_TASK_SEQUENCE)
    cfg = mode_config(seq_args, "segment")
    policy = build_policy(cfg)
    probe = asyncio.run(probe_contexts(cfg, policy.tokenizer, args.contexts,
                                       cfg.keeper.probe_seed_start))
    parent = {k: v.clone() for k, v in policy.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    new = {k: v + 1e-3 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
           for k, v in parent.items()}
    kept = probe_logprobs(policy, parent, probe)  # what the keeper holds from the last measure
    readings: dict[str, float] = {}
    default_min = policy.shared_prefix_min

    def two_whole() -> float:
        policy.shared_prefix_min = 10**9
        started = time.perf_counter()
        readings["two_whole"] = policy_kl(policy, parent, new, probe)
        return time.perf_counter() - started

    def one_shared() -> float:
        policy.shared_prefix_min = default_min
        started = time.perf_counter()
        readings["one_shared"] = mean_kl(kept, probe_logprobs(policy, new, probe))
        return time.perf_counter() - started

    side = alternate({"two_whole": two_whole, "one_shared": one_shared}, args.rounds)
    print_result({
        "bench": "keeper_probe", "smoke": args.smoke, "contexts": len(probe),
        "tokens_per_context": round(sum(map(len, probe)) / len(probe), 1),
        "shared_prefix_tokens": _common_prefix(probe),
        "rounds_s": side.table(3), "two_whole_s": round(side.median("two_whole"), 3),
        "one_shared_s": round(side.median("one_shared"), 3),
        "two_whole_over_one_shared": round(side.ratio("two_whole", "one_shared"), 2),
        "kl": readings["one_shared"],
        "kl_abs_diff": abs(readings["two_whole"] - readings["one_shared"]),
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
