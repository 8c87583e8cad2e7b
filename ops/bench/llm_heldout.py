"""Held-out figures of a finished LLM run: choose the version on validation games, report it
on test games that no choice has seen.

The bench's in-loop validation picks its best version on the same games it then reports, so
its best figure carries a selection bias that grows with the number of versions compared,
and on 32 sampled games it moves by ~0.09 from sampling alone. This script separates the two
jobs, as one separates a validation split from a test split:

1. **the base** (a fresh policy: LoRA adapters start at zero, so it is the base model
   exactly) plays ``--test-episodes`` games of the environment's ``test`` split;
2. **selection**: every ``--every``-th policy version the run published by an update (and
   its last one) plays ``--dev-episodes`` games of the ``dev`` split; the best (success,
   then score, then the earlier version) is chosen there. Version 0 plays them too, as the
   line the updates are read against (it is not a candidate: (c) is what RL made);
3. **the report**: the chosen version, and the run's last version, play the same test games
   as the base, with the same decoding and the same sampling seed. When version 0 is a warm
   start (behaviour cloning before RL), it plays the test games too (``start``): the base
   model is then the line of the whole recipe, version 0 the line of what RL added.

Each finished play is kept in ``--plays`` (JSON lines, by default ``heldout-plays.jsonl``
beside the run directory), keyed by the weights' sha256 and every setting that shapes a
game (split, games, policy, task, evaluator, segmenter, sampler, seed, engine): an
interrupted judging resumes where it stopped, and runs of the same settings and seed share
the base model's plays (a 96-game judging of the long task takes tens of minutes here).

Every version's weights are loaded from the run's checkpoints (sha256 verified) as the
evaluator loads them, and played through the evaluator's own code (``evaluate``), by
``--engine``: ``vllm`` (run it with the vLLM virtualenv, ``source ops/vllm_venv.sh; $PY
ops/bench/llm_heldout.py ...``; a run that acted through torch, ``backend = "hf"``, is played
by the engine with each version merged into the base weights) or ``torch``. Nothing else
runs meanwhile: these are the run's figures, not its speed.

Last line, one JSON object:
{"bench": "llm_heldout", "base_success": x, "best_success": x, "best_success_ci_low": x,
 "final_success": x, "test_episodes": n, "best_version": v, "selection": [...], ...}
and a PNG: validation (dev) success per version, the test figures as points.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import time

import msgspec
from _common import make_config, print_result, two_proportion_p
from _common import wilson_interval as wilson

from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_events
from gyre_async.compose import build_context_builder, build_tokenizer
from gyre_async.core.evaluation import EvalProgress, evaluate, validation_policy
from gyre_async.core.rollout import PolicyHolder
from gyre_async.policy.context import ContextBuilder
from schemas.config import Config
from schemas.events import PolicyVersion
from schemas.topics import POLICY_VERSION


async def published_versions(run_dir: str, run_id: str) -> list[PolicyVersion]:
    """The run's own versions (init, warm-start, updates: not rollbacks, which republish old
    weights), first publication of each, in order."""
    seen: dict[int, PolicyVersion] = {}
    async with open_bus(f"sqlite:///{run_dir}/events.db", reader=True) as bus:
        async for _, e in read_events(bus, [POLICY_VERSION], on_bad="skip", run_id=run_id):
            if isinstance(e, PolicyVersion) and e.reason != "rollback":
                seen.setdefault(e.version, e)
    return [seen[v] for v in sorted(seen)]


def chosen_for_selection(versions: list[PolicyVersion], every: int) -> list[PolicyVersion]:
    """Every ``every``-th version made by an update, and the last one."""
    updates = [v for v in versions if v.reason == "update"]
    picked = [v for v in updates if v.version % every == 0]
    if updates and updates[-1] not in picked:
        picked.append(updates[-1])
    return picked


#: the sampler settings a validation play reads (gyre_async/core/evaluation.py)
PLAY_SAMPLER_FIELDS = ("batch_wait_s", "step_timeout_s")


class PlayBook:
    """Finished plays, one JSON line each, so that no play is paid for twice (see the module
    docstring). A line names its key; a line that does not parse (a write cut short) is
    ignored and that play runs again."""

    def __init__(self, path: str):
        self.path = path
        self.kept: dict[str, dict] = {}
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        row = json.loads(line)
                        self.kept[row["key"]] = row["figures"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        continue

    @staticmethod
    def key(cfg: Config, engine: str, weights: str) -> str:
        """What decides a play's games and actions: the weights (``weights``: a checkpoint's
        sha256, or ``base``) and every config section that shapes an episode; the run's
        name, directory, budget and learner settings are left out, and of the sampler's only
        what a validation play reads (its batching wait and step timeout: the training plays'
        temperature or group size do not change a judged game)."""
        shaping = {name: msgspec.to_builtins(getattr(cfg, name))
                   for name in ("policy", "task", "evaluator", "segmenter", "macros")}
        shaping["sampler"] = {name: getattr(cfg.sampler, name) for name in PLAY_SAMPLER_FIELDS}
        shaping.update(seed=cfg.run.seed, engine=engine, weights=weights)
        return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()

    def get(self, key: str) -> dict | None:
        return self.kept.get(key)

    def put(self, key: str, figures: dict) -> None:
        self.kept[key] = figures
        with open(self.path, "a") as f:
            f.write(json.dumps({"key": key, "figures": figures}) + "\n")


def choose(selection: list[dict]) -> dict:
    """The best candidate on validation: success, then score, then milestones reached per
    game, then the earlier version. Milestones decide where a game's score does not show
    progress: Simon Says scores every lost game -1 however far it got, so with no game
    won every candidate tied and the earliest was chosen (plays kept from before milestones
    were counted read as none)."""
    return max((e for e in selection if e["candidate"]),
               key=lambda e: (e["success"], e["score"], e.get("milestones", 0.0),
                              -e["version"]))


def split_config(cfg: Config, split: str, episodes: int, engine: str,
                 overrides: dict[str, str | int | float] | None = None,
                 concurrency: int = 0) -> Config:
    """The run's validation settings on ``split``; ``overrides`` change the games themselves
    (e.g. a larger map than the run trained on: a transfer check, not the run's task);
    ``concurrency`` > 0 caps the games played at once (0: the run's own setting)."""
    evaluator: dict = {"seeds": list(range(episodes)),
                       "env_config": {**(overrides or {}), "split": split},
                       "engine": "sampler" if engine == "vllm" else "learner"}
    if concurrency:
        evaluator["concurrency"] = concurrency
    return make_config(cfg, evaluator=evaluator)


def vllm_judged(cfg: Config, engine: str) -> Config:
    """The run's config as ``engine`` plays it. A run that acted through torch (``backend =
    "hf"``) can be judged by a vLLM engine: the checkpoints are the same LoRA adapters over
    the same base, and the engine plays them merged into the base weights (on vLLM's CPU
    backend an adapter slows every prefill many times over; ``policy.vllm_lora``).
    Plays are keyed by engine and policy, so one judge's figures never stand in for the
    other's."""
    if engine != "vllm" or cfg.policy.backend == "vllm":
        return cfg
    if cfg.policy.backend != "hf":
        raise SystemExit(f"--engine vllm: the run's policy.backend is {cfg.policy.backend!r}: "
                         "only a pretrained model (hf or vllm) plays through vLLM "
                         "(use --engine torch)")
    return make_config(cfg, policy={"backend": "vllm", "vllm_lora": "merged"})


def env_overrides(pairs: list[str]) -> dict[str, str | int | float]:
    """``KEY=VALUE`` pairs (the value may hold ``=``, as TextWorldExpress params do; numbers
    become numbers, as the config's own values are)."""
    out: dict[str, str | int | float] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env-param {pair!r}: expected KEY=VALUE, e.g. "
                             "params=numLocations=9,includeDoors=0,numDistractorItems=0")
        for kind in (int, float):
            try:
                out[key] = kind(value)
                break
            except ValueError:
                continue
        else:
            out[key] = value
    return out


async def judged(book: PlayBook, engine: str, cfg: Config, holder: PolicyHolder,
                 builder: ContextBuilder, version: PolicyVersion | None, label: str) -> dict:
    """``version`` (``None``: the base model, the fresh policy ``holder`` starts with, so it
    plays before any version is loaded) plays ``cfg``'s games, or the figures ``book`` kept
    of that very play."""
    key = PlayBook.key(cfg, engine, "base" if version is None else version.checkpoint_hash)
    kept = book.get(key)
    if kept is not None:
        print(f"[heldout] {label}: {kept['wins']}/{kept['episodes']} won (kept in "
              f"{book.path})", flush=True)
        return kept
    if version is not None:
        await asyncio.to_thread(holder.load, version.checkpoint, version.checkpoint_hash,
                                version.version)
    figures = await play(cfg, holder, builder, label)
    book.put(key, figures)
    return figures


async def play(cfg: Config, holder: PolicyHolder, builder: ContextBuilder, label: str) -> dict:
    started = time.monotonic()
    r = await evaluate(cfg, holder, builder, None, cfg.evaluator.greedy,
                       EvalProgress(label))
    n = r["episodes"]
    wins = round(r["success_rate"] * n)
    figures = {"version": holder.version, "success": r["success_rate"], "wins": wins,
               "episodes": n, "score": round(r["mean_score"], 4),
               "length": round(r["mean_length"], 2),
               "milestones": round(sum(r["milestone_rates"].values()), 3),
               "seconds": round(time.monotonic() - started, 1)}
    print(f"[heldout] {label}: {wins}/{n} won, score {figures['score']}, "
          f"length {figures['length']} ({figures['seconds']} s)", flush=True)
    return figures


def plot(selection: list[dict], test: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.plot([e["version"] for e in selection], [e["success"] for e in selection], "o-",
            color="tab:blue", label="validation (dev games): selection")
    base = test["base"]
    low, high = wilson(base["wins"], base["episodes"])
    ax.axhline(base["success"], color="gray", ls=":", label="base model, test games")
    ax.axhspan(low, high, color="gray", alpha=0.12)
    for key, colour, marker in (("start", "tab:purple", "D"), ("best", "tab:red", "*"),
                                ("final", "tab:green", "s")):
        e = test.get(key)
        if e is None:
            continue
        lo, hi = wilson(e["wins"], e["episodes"])
        ax.errorbar([e["version"]], [e["success"]], yerr=[[e["success"] - lo], [hi - e["success"]]],
                    fmt=marker, color=colour, ms=9, capsize=4,
                    label=f"{key} (v{e['version']}), test games, 95% CI")
    ax.set_xlabel("policy version")
    ax.set_ylabel("success rate")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def heldout(args: argparse.Namespace) -> dict:
    cfg = vllm_judged(make_config(os.path.join(args.run_dir, "config.json")), args.engine)
    versions = await published_versions(args.run_dir, cfg.run.run_id)
    if not versions:
        raise SystemExit(f"{args.run_dir}/events.db holds no policy-version: not a finished run")
    selection_set = chosen_for_selection(versions, args.every)
    if not selection_set:
        raise SystemExit("the run published no update: nothing to select from")
    overrides = env_overrides(args.env_param)
    dev = split_config(cfg, "dev", args.dev_episodes, args.engine, overrides, args.concurrency)
    test = split_config(cfg, "test", args.test_episodes, args.engine, overrides,
                        args.concurrency)
    tokenizer = build_tokenizer(cfg)
    holder = PolicyHolder(validation_policy(dev, tokenizer), 0)
    builder = build_context_builder(cfg, tokenizer)
    book = PlayBook(args.plays or os.path.join(
        os.path.dirname(os.path.abspath(args.run_dir)), "heldout-plays.jsonl"))
    try:
        figures = {"base": await judged(book, args.engine, test, holder, builder, None,
                                        "base model, test games")}
        selection = []
        for v in [versions[0], *selection_set]:
            played = await judged(book, args.engine, dev, holder, builder, v,
                                  f"version {v.version}, dev games")
            selection.append({**played, "candidate": v.reason == "update"})
        best = choose(selection)
        by_version = {v.version: v for v in selection_set}
        last = selection_set[-1]
        plays = [("best", by_version[best["version"]]), ("final", last)]
        if versions[0].reason == "warmstart":  # the line of what RL added to the warm start
            plays.append(("start", versions[0]))
        for key, v in plays:
            if key == "final" and v.version == best["version"]:
                figures["final"] = figures["best"]
                continue
            figures[key] = await judged(book, args.engine, test, holder, builder, v,
                                        f"{key}: version {v.version}, test games")
    finally:
        holder.close()
    n = args.test_episodes
    base, chosen, final = figures["base"], figures["best"], figures["final"]
    start = figures.get("start")
    p_start = (float(f"{two_proportion_p(start['wins'], chosen['wins'], n):.2g}")
               if start else None)
    low, high = wilson(chosen["wins"], n)
    env = {**cfg.task.env_config, **overrides}
    title = (f"{cfg.policy.model} on {cfg.task.env} {env.get('game', '')} "
             f"({env.get('params', '')}):\nchosen on {args.dev_episodes} dev games, "
             f"reported on {n} test games")
    png = args.png or os.path.join(os.path.dirname(os.path.abspath(args.run_dir)),
                                   "heldout.png")
    plot(selection, figures, png, title)
    return {
        "bench": "llm_heldout", "run_dir": args.run_dir,
        "base_success": base["success"], "best_success": chosen["success"],
        "best_success_ci_low": round(low, 4), "best_success_ci_high": round(high, 4),
        "final_success": final["success"], "best_version": chosen["version"],
        "final_version": final["version"], "improvement": round(chosen["success"]
                                                                - base["success"], 4),
        "p_best_above_base": float(f"{two_proportion_p(base['wins'], chosen['wins'], n):.2g}"),
        "base_score": base["score"], "best_score": chosen["score"],
        # version 0 when it is a warm start: what RL itself added is best - start
        "start_success": start["success"] if start else None,
        "start_score": start["score"] if start else None,
        "best_minus_start": round(chosen["success"] - start["success"], 4) if start else None,
        "p_best_above_start": p_start,
        "test_episodes": n, "dev_episodes": args.dev_episodes, "engine": args.engine,
        "env_overrides": overrides,
        "decoding": "greedy" if cfg.evaluator.greedy else
                    f"sampled at {cfg.evaluator.temperature}",
        "selection": selection, "test": figures, "png": png,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True,
                   help="a finished run (its config.json, events.db and checkpoints)")
    p.add_argument("--every", type=int, default=4,
                   help="select among every N-th update version (and the last one)")
    p.add_argument("--dev-episodes", type=int, default=32,
                   help="validation games per version, for the choice")
    p.add_argument("--test-episodes", type=int, default=96,
                   help="test games for the base, the chosen and the last version")
    p.add_argument("--engine", default="vllm", choices=["vllm", "torch"],
                   help="what plays: a vLLM engine (needs the vLLM virtualenv; a torch run's "
                        "versions are merged into its base weights) or torch")
    p.add_argument("--env-param", action="append", default=[], metavar="KEY=VALUE",
                   help="change the evaluation games (repeatable), e.g. "
                        "params=numLocations=9,includeDoors=0,numDistractorItems=0 to check "
                        "transfer to a larger map than the run trained on")
    p.add_argument("--concurrency", type=int, default=0, metavar="N",
                   help="games played at once (0: the run's evaluator.concurrency; the LLM "
                        "bench's runs say 32). With segment contexts each game playing holds "
                        "its whole context's keys/values (SmolLM2-135M: 46 KB per token): "
                        "32 long Simon Says games at once held 16 GB here, 16 about 7 GB")
    p.add_argument("--png", default="", help="the plot (default: heldout.png beside the run)")
    p.add_argument("--plays", default="",
                   help="finished plays kept here and reused (default: heldout-plays.jsonl "
                        "beside the run directory)")
    p.add_argument("--out", default="", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.every < 1 or args.dev_episodes < 1 or args.test_episodes < 1:
        p.error("--every, --dev-episodes and --test-episodes must be at least 1")
    if args.concurrency < 0:
        p.error("--concurrency must be 0 (the run's own setting) or a number of games")
    print_result(asyncio.run(heldout(args)), args.out or None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
