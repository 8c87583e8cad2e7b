"""Credit assignment on a truly long task: ``ops/bench/credit.py``'s comparison on workshop-long.

The same machinery as ``credit.py`` (its ``configure``, ``curve`` and ``plot``), on
``ops/configs/long300.toml`` (``workshop-long``: every seed needs >= 300 steps, cap 1,000):

gyre           segments closed at milestones / max length, trained as they arrive (async),
               bootstrapped at boundaries, fused with the group outcome advantage.
outcome_only   GRPO on the trajectory outcome alone (sync, no milestone rewards).
gae            GAE over whole trajectories (one segment each, sync), milestones on.

3 seeds, the same environment-step budget per run; seeds are outermost, so a cut-short
bench still compares every variant on the seeds it finished. ``--end-by`` (UTC ``HH:MM``)
shares the time left among the runs left as each run's wall-clock cap, so the bench ends in
time on a shared machine; a run stopped by that cap sampled fewer steps than the budget,
and its line (``runs.txt``) and the JSON say how many. ``--config ops/configs/long1000.toml``
runs the 1,000-step setting.

Target: Gyre reaches 50% validation success in every seed within a budget where outcome-only
reaches it in none. Last line:
{"bench": "long", "steps_to_target_per_seed": {...}, "env_steps_per_seed": {...}, ...}
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import shutil
import statistics
import sys
import time

import msgspec
from _common import CONFIGS, ROOT, finished_summary, make_config, print_result, run_summary
from credit import configure, curve, first_at, median_or_none, plot, record_run  # its sibling

from gyre_async.config import load_config
from gyre_async.envs.workshop import SETTINGS

VARIANTS = ("gyre", "outcome_only", "gae")


def seconds_until(hhmm: str) -> float:
    """Seconds from now until the next ``HH:MM`` UTC (today, or tomorrow if it has passed)."""
    now = dt.datetime.now(dt.UTC)
    hour, minute = (int(x) for x in hhmm.split(":"))
    end = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    if end <= now:
        end += dt.timedelta(days=1)
    return (end - now).total_seconds()


def long_config(base, variant: str, seed: int, run_dir: str, args):
    """credit.py's config of one variant, with evaluations spaced for long episodes.

    An evaluation plays 32 episodes of up to the cap, as many steps as a sync version: every
    ``--sync-eval-every`` sync version and every ``--eval-every`` async one (~1k steps each).
    """
    sync = variant in ("outcome_only", "gae")
    every = args.sync_eval_every if sync else args.eval_every
    return make_config(configure(base, variant, seed, run_dir, args),
                       evaluator={"every_versions": every})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(CONFIGS / "long300.toml"))
    p.add_argument("--out", default=str(ROOT / "runs/bench-long"))
    p.add_argument("--budget", type=int, default=100_000, help="env steps per run")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--target", type=float, default=0.5)
    p.add_argument("--eval-every", type=int, default=10, help="async versions per evaluation")
    p.add_argument("--sync-eval-every", type=int, default=2,
                   help="sync versions per evaluation (each holds ~32 whole episodes)")
    p.add_argument("--only-seeds", default="",
                   help="comma-separated seeds (several processes can share one --out; "
                        "then --summarize reports them together)")
    p.add_argument("--summarize", action="store_true",
                   help="run nothing: report the runs finished in --out")
    p.add_argument("--max-wall", type=float, default=3600.0, help="wall cap per run (s)")
    p.add_argument("--end-by", default="", help="UTC HH:MM: share the time left among runs")
    p.add_argument("--reuse", action="store_true", help="keep runs finished in --out")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    base = load_config(args.config)
    setting = dict(base.task.env_config)
    # credit.configure writes n_orders / max_steps into env_config: keep the setting's own
    own = msgspec.structs.replace(SETTINGS[base.task.env], **setting)
    args.orders, args.max_steps, args.stop_at = own.n_orders, own.max_steps, args.target
    cap = args.max_wall
    deadline = time.monotonic() + seconds_until(args.end_by) if args.end_by else None
    os.makedirs(args.out, exist_ok=True)
    curves: dict[str, list] = {v: [] for v in variants}
    steps_run: dict[str, list[int]] = {v: [] for v in variants}
    seeds = [int(x) for x in args.only_seeds.split(",") if x] or list(range(args.seeds))
    plan = [(seed, v) for seed in seeds for v in variants]
    for i, (seed, variant) in enumerate(plan):
        run_dir = os.path.join(args.out, f"{variant}-s{seed}")
        started = time.monotonic()
        summary = finished_summary(run_dir) if args.reuse or args.summarize else None
        if args.summarize and summary is None:
            continue
        if summary is None:
            wall = cap
            if deadline is not None:
                wall = min(cap, (deadline - time.monotonic()) / (len(plan) - i))
                if wall < 60:
                    print(f"out of time before {variant} seed {seed}", file=sys.stderr)
                    break
            if os.path.exists(run_dir):
                shutil.rmtree(run_dir)
            run_args = argparse.Namespace(**{**vars(args), "max_wall": wall})
            summary = run_summary(long_config(base, variant, seed, run_dir, run_args))
        points = asyncio.run(curve(run_dir))
        curves[variant].append(points)
        steps_run[variant].append(int(summary["env_steps"]))
        record_run(args, f"{variant:>12}", seed, summary, points, started)
    png = os.path.join(args.out, "long_curves.png")
    plot({v: c for v, c in curves.items() if c}, args.target, png, args.budget)
    per_seed = {v: [first_at(c, args.target) for c in curves[v]] for v in variants}
    gyre_all = bool(per_seed.get("gyre")) and all(x is not None for x in per_seed["gyre"])
    outcome_none = all(x is None for x in per_seed.get("outcome_only", []))
    print_result({
        "bench": "long", "env": base.task.env, "target": args.target,
        "budget_env_steps": args.budget, "task": {**setting, "max_steps": args.max_steps},
        "seeds_per_variant": {v: len(curves[v]) for v in variants},
        "env_steps_per_seed": steps_run,
        "steps_to_target_per_seed": per_seed,
        "steps_to_target": {v: median_or_none(per_seed[v]) for v in variants},
        "best_success": {v: [round(max((ok for _, ok, _ in c), default=0.0), 3)
                             for c in curves[v]] for v in variants},
        "final_success": {v: round(statistics.mean(c[-1][1] for c in curves[v] if c), 3)
                          if any(curves[v]) else None for v in variants},
        "target_met": gyre_all and outcome_none and bool(per_seed.get("outcome_only")),
        "plot": png,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
