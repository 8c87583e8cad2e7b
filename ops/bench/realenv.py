"""Real environments: initial policy vs warm-start vs warm-start + online RL, on dev data.

Three benchmarks, each trained on its training split and evaluated on held-out data:
ScienceWorld grow-fruit and mendelian-genetics-known-plant (train variations for training,
dev variations for evaluation) and TextWorld cooking games (train split for training, valid
split for evaluation). For each, with the tiny from-scratch word-level policy:

(a) the initial policy, (b) after ``gyre warmstart`` on gold paths / walkthroughs of training
episodes, (c) after warm-start plus online RL (``gyre run`` from version 0 for ``--minutes``),

all evaluated greedily on the same dev episodes. Prints the dev score (normalised: 1.0 = full
task score) and success of each, env steps and steps/s of the online phase, writes
``realenv.png`` (dev score per policy version) into ``--out``. Last line:
{"bench": "realenv", "results": {name: {"initial": {...}, "warmstart": {...}, "online": {...},
 "env_steps": N, "steps_per_s": x, "online_beats_warmstart": bool}}, "targets_met": k}
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

from _common import make_config, print_result, run_summary

from gyre_async.compose import build_policy, build_tokenizer
from gyre_async.core.evaluation import evaluate
from gyre_async.core.rollout import PolicyHolder
from gyre_async.offline.warmstart import publish_warmstart, warm_policy
from gyre_async.policy.context import ContextBuilder
from schemas.config import Config

BENCHES = {
    "sw-grow-fruit": dict(
        env="scienceworld", train={"task": "grow-fruit", "max_steps": 100},
        dev={"split": "dev"}, gold=8, dev_seeds=8, max_action_tokens=12),
    "sw-mendelian-known": dict(
        env="scienceworld", train={"task": "mendelian-genetics-known-plant", "max_steps": 180},
        dev={"split": "dev"}, gold=6, dev_seeds=8, max_action_tokens=12),
    "tw-cooking": dict(
        env="textworld", train={"recipe": 1, "take": 1, "go": 1, "games": 16, "max_steps": 30},
        dev={"split": "valid", "games": 8}, gold=16, dev_seeds=8, max_action_tokens=8),
}


def bench_config(name: str, spec: dict, run_dir: str, minutes: float, admissible: str) -> Config:
    return make_config(
        run={"run_id": f"realenv-{name}", "run_dir": run_dir, "seed": 1},
        task={"env": spec["env"],
              "env_config": {**spec["train"], "admissible": admissible, "vocab_episodes": 2}},
        policy={"d_model": 48, "n_layers": 2, "n_heads": 4, "context_tokens": 192,
                "history_turns": 1, "max_action_tokens": spec["max_action_tokens"]},
        sampler={"num_envs": 8, "step_timeout_s": 120.0},
        learner={"batch_steps": 256, "minibatch_steps": 128, "epochs": 2,
                 "learning_rate": 1e-4, "max_versions": 0},
        evaluator={"every_versions": 4, "seeds": list(range(spec["dev_seeds"])),
                   "env_config": spec["dev"]},
        loop={"max_wall_s": minutes * 60},
        warmstart={"gold_episodes": spec["gold"], "epochs": 40, "learning_rate": 3e-3,
                   "batch_steps": 32},
    )


async def dev_eval(cfg: Config, policy) -> dict:
    tok = build_tokenizer(cfg)
    builder = ContextBuilder(tok, cfg.policy.context_tokens, cfg.policy.history_turns)
    r = await evaluate(cfg, PolicyHolder(policy, 0), builder, None, True)
    return {"score": r["mean_score"], "success": r["success_rate"],
            "length": r["mean_length"]}


def run_one(name: str, spec: dict, out: str, minutes: float, admissible: str) -> dict:
    run_dir = os.path.join(out, name)
    cfg = bench_config(name, spec, run_dir, minutes, admissible)
    started = time.monotonic()
    initial = asyncio.run(dev_eval(cfg, build_policy(cfg, build_tokenizer(cfg))))
    print(f"[{name}] (a) initial: {initial}", flush=True)
    warm, stats = warm_policy(cfg)
    warmed = asyncio.run(dev_eval(cfg, warm))
    print(f"[{name}] (b) warm-start ({stats['bc/examples']:.0f} steps of "
          f"{stats['bc/demonstrations']:.0f} gold episodes, nll {stats['bc/nll']:.3f}): "
          f"{warmed}", flush=True)
    asyncio.run(publish_warmstart(cfg, warm, stats))
    summary = run_summary(cfg)
    final = summary["evals"][-1] if summary["evals"] else {}
    online = {"score": final.get("score", float("nan")),
              "success": final.get("success", float("nan")),
              "version": final.get("version", -1)}
    print(f"[{name}] (c) warm-start + online RL ({summary['env_steps']} env steps, "
          f"{summary['env_steps_per_s']:.1f} steps/s, {summary['policy_versions']} versions): "
          f"{online}", flush=True)
    return {"initial": initial, "warmstart": warmed, "online": online,
            "curve": [(e["version"], e["score"], e["success"]) for e in summary["evals"]],
            "env_steps": summary["env_steps"], "steps_per_s": summary["env_steps_per_s"],
            "online_beats_warmstart": online["score"] > warmed["score"],
            "seconds": round(time.monotonic() - started, 1)}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        curve = r["curve"]
        if curve:
            ax.plot([v for v, _, _ in curve], [s for _, s, _ in curve], "o-",
                    label="online RL (dev score)")
        ax.axhline(r["initial"]["score"], color="gray", ls=":", label="initial")
        ax.axhline(r["warmstart"]["score"], color="orange", ls="--", label="warm-start")
        ax.set_title(name)
        ax.set_xlabel("policy version")
        ax.set_ylabel("dev score")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/realenv", help="run directories and the PNG")
    p.add_argument("--minutes", type=float, default=12.0, help="online RL budget per bench")
    p.add_argument("--only", nargs="*", choices=sorted(BENCHES), help="run these benches")
    p.add_argument("--admissible", default="snap", choices=["off", "hint", "snap"])
    args = p.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.only or list(BENCHES):
        results[name] = run_one(name, BENCHES[name], args.out, args.minutes, args.admissible)
    png = os.path.join(args.out, "realenv.png")
    plot(results, png)
    met = sum(r["online_beats_warmstart"] for r in results.values())
    print(f"online RL beats warm-start on dev score in {met} of {len(results)}; curves: {png}")
    print_result({"bench": "realenv", "results": {
        k: {kk: vv for kk, vv in v.items() if kk != "curve"} for k, v in results.items()},
        "targets_met": met, "png": png})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
