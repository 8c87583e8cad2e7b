"""What the held-out judge's engine costs: the same games played by torch and by vLLM.

The judge (``ops/bench/llm_heldout.py``) plays hundreds of games per run (the base model and
the chosen version on 96 test games, candidates on dev games); on the long task that is most
of the issue's 150-minute budget. This plays ``--episodes`` games of a finished run's task
with the run's starting weights (version 0, the fresh policy: the base model, or the
``policy.model`` a run started from) twice, one engine after the other in this process:
torch (``HFPolicy`` with each game's keys/values kept between its steps, what the judge
uses for a torch run) and a vLLM engine (automatic prefix caching; a torch run's versions
merged into its weights, :func:`llm_heldout.vllm_judged`), with the same contexts, games,
decoding and sampling seed. Run it with the vLLM virtualenv:

    source ops/vllm_venv.sh; $PY ops/bench/judge_engines.py --run-dir RUN --episodes 16

Last line, one JSON object: {"bench": "judge_engines", "torch": {"env_steps", "seconds",
"steps_per_s", "success", "score"}, "vllm": {...}, "vllm_vs_torch": x} (env steps per
second, vLLM's over torch's). The two engines sample different actions (their log-probs
agree to ~1e-4, not bit for bit), so their games, and so their lengths, differ: the ratio is
per env step, the figures of play are not a comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from _common import make_config, print_result
from llm_heldout import env_overrides, split_config, vllm_judged
from llm_heldout import play as played

from gyre_async.compose import build_context_builder, build_tokenizer
from gyre_async.core.evaluation import validation_policy
from gyre_async.core.rollout import PolicyHolder


async def play(run_dir: str, engine: str, split: str, episodes: int,
               overrides: dict[str, str | int | float]) -> dict:
    cfg = vllm_judged(make_config(os.path.join(run_dir, "config.json")), engine)
    games = split_config(cfg, split, episodes, engine, overrides)
    tokenizer = build_tokenizer(games)
    holder = PolicyHolder(validation_policy(games, tokenizer), 0)
    builder = build_context_builder(games, tokenizer)
    try:
        r = await played(games, holder, builder, f"{engine}, version 0, {split} games")
    finally:
        holder.close()
    steps = round(r["length"] * r["episodes"])
    return {"env_steps": steps, "seconds": r["seconds"],
            "steps_per_s": round(steps / r["seconds"], 3), "success": r["success"],
            "score": r["score"], "episodes": r["episodes"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, help="a finished run (its config.json)")
    p.add_argument("--episodes", type=int, default=16, help="games per engine")
    p.add_argument("--split", default="dev", choices=["train", "dev", "test"])
    p.add_argument("--env-param", action="append", default=[], metavar="KEY=VALUE",
                   help="change the games (repeatable), e.g. max_steps=24")
    p.add_argument("--out", default="", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.episodes < 1:
        p.error("--episodes must be at least 1")
    overrides = env_overrides(args.env_param)
    result: dict = {"bench": "judge_engines", "run_dir": args.run_dir,
                    "episodes": args.episodes, "split": args.split}
    for engine in ("torch", "vllm"):
        result[engine] = asyncio.run(play(args.run_dir, engine, args.split, args.episodes,
                                          overrides))
        print(f"[judge_engines] {engine}: {result[engine]}", flush=True)
    result["vllm_vs_torch"] = round(result["vllm"]["steps_per_s"]
                                    / result["torch"]["steps_per_s"], 3)
    print_result(result, args.out or None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
