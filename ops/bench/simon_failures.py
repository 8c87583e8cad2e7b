"""Where a model loses Simon Says with memory (``llm.py --long-task simon``): it plays games
(dev by default, ``--split``) with the run's contexts and segments and prints, for each
game, the step it lost at, what it wrote, what the list asked for, and whether that step
opened a segment; then how many losses came at an opening. A segment opening must find its
place in the list from the summary of the last milestones, which is where the
8-step-segment warm start of docs/training.md ("Simon Says with memory") lost most of its
games.

    python ops/bench/simon_failures.py --model runs/warm-simon6 --episodes 16

Flags it does not know are passed to ``llm.py``'s parser after ``--long-task simon``, so a
variant is played as its run would be (e.g. ``--max-segment-steps 60``: one segment a game).

Last line: one JSON object with the counts.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json

import llm
from _common import print_result

from gyre_async.compose import build_context_builder, build_policy, build_tokenizer
from gyre_async.core.rollout import ActionBatcher, PolicyHolder, StepRecord, run_episode
from gyre_async.envs import make_env
from gyre_async.policy.base import SamplingParams


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="a model directory, e.g. a warm start saved by llm.py --save-warm, or "
                        "a run's version from `gyre export-model`")
    p.add_argument("--episodes", type=int, default=16, help="games of --split, from --first-game")
    p.add_argument("--temperature", type=float, default=llm.TEMPERATURE,
                   help="sampling temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--split", default="dev", choices=["train", "dev", "test"],
                   help="the fold the games come from (each fold has its own objects)")
    p.add_argument("--first-game", type=int, default=0,
                   help="index of the first game in the fold (the warm start clones the "
                        "train fold's first --warmstart-demos games)")
    return p


async def play(args: argparse.Namespace) -> list[dict]:
    argv = ["--long-task", "simon", "--model", args.model, "--warmstart-demos", "0",
            "--out", "/nonexistent-unused", *args.llm_flags]
    bench_args = llm.parse_args(argv)
    cfg = llm.bench_config(bench_args)
    tokenizer = build_tokenizer(cfg)
    builder = build_context_builder(cfg, tokenizer)
    holder = PolicyHolder(build_policy(cfg, tokenizer), 0)
    params = SamplingParams(temperature=args.temperature,
                            max_action_tokens=cfg.policy.max_action_tokens,
                            greedy=args.temperature == 0)
    plan = [(f"twx:{seed}", seed)
            for seed in range(args.first_game, args.first_game + args.episodes)]
    batcher = ActionBatcher(holder, params, wait_s=0.02, seed=args.seed)
    batcher.active = len(plan)
    env_config = {**cfg.task.env_config, **cfg.evaluator.env_config, "split": args.split}

    async def one(index: int, task_id: str, seed: int) -> dict:
        steps: list[tuple[int, str, bool]] = []

        async def on_step(record: StepRecord) -> None:
            steps.append((record.step_index, record.acted.action.text,
                          record.context_prefix == 0))

        env = make_env(cfg.task.env, **env_config)
        session = f"simon-{index}"
        try:
            summary = await run_episode(
                env, task_id, seed, functools.partial(batcher.act, session=session), builder,
                step_timeout_s=cfg.sampler.step_timeout_s, on_step=on_step,
                segments=cfg.segmenter)
            listed = env.demonstration()  # the game's gold path: its list, in order
        finally:
            holder.policy.forget_session(session)
            await env.close()
        last, wrote, opened = steps[-1]
        return {"task_id": task_id, "won": summary.success, "steps": len(steps),
                "lost_at": None if summary.success else last, "wrote": wrote,
                "wanted": listed[last] if last < len(listed) else None,
                "opened_segment": opened}

    try:
        return list(await asyncio.gather(*(one(i, t, s) for i, (t, s) in enumerate(plan))))
    finally:
        batcher.close()


def main(argv: list[str] | None = None) -> int:
    args, args.llm_flags = parser().parse_known_args(argv)
    games = asyncio.run(play(args))
    for game in games:
        print(json.dumps(game))
    lost = [g for g in games if not g["won"]]
    print_result({"bench": "simon_failures", "model": args.model, "games": len(games),
                  "won": len(games) - len(lost),
                  "lost_at": sorted(g["lost_at"] for g in lost),
                  "lost_at_an_opening": sum(g["opened_segment"] for g in lost),
                  "split": args.split, "first_game": args.first_game,
                  "temperature": args.temperature, "llm_flags": args.llm_flags})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
