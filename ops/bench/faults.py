"""Failed episodes: masked out of the learning signal vs counted as zero-outcome members.

The quickstart task (the workshop, 10 orders, groups of ``--group-size`` episodes per task so
the group outcome advantage has something to compare), with a share of training episodes
crashing at a uniformly random step (``task.fail_episode_rate``: the sampler's fault wrapper,
``gyre_async.envs.faults``, deterministic per seed). Three variants,
the same tasks, policy, optimiser and environment-step budget, 3 seeds each, each a real run
of the loop (``gyre_async.runtime.loop.run_loop``) on the embedded bus:

masked      ``learner.mask_failed = true`` (the default): failed episodes stay out of their
            group's baseline, get no outcome advantage, and bootstrap their last segment.
zero        ``learner.mask_failed = false``: failed episodes are group members with the
            return they had (no success), as before.
fault_free  ``fail_episode_rate = 0`` (the same task ids and seeds).

Validation is fault-free in every variant (the wrapper is the sampler's only). A run stops at the
budget or at the first evaluation reaching ``--target``; steps to the target are read from
the event log the way ``credit.py`` reads them (env steps sampled before the version was
published). ``--finish-by HH:MM`` (UTC) shares the time left among the runs still to do, so
a bench on a loaded machine ends in time (a run cut short counts as never reaching it).

Last line: {"bench": "faults", "steps_to_50": {"masked": [...], "zero": [...],
"fault_free": [...]}, "median_ratio_masked_vs_free": x, ...} (per-seed lists in seed order,
null: never reached; the ratio of medians, a median with a null counting as the budget).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import shutil
import statistics
import sys
import time

from _common import QUICKSTART, ROOT, finished_summary, make_config, print_result, run_summary
from credit import curve, first_at, median_or_none  # ops/bench/credit.py (same folder)

from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_events
from gyre_async.config import load_config
from schemas.events import EnvError, SegmentClosed, failure_of
from schemas.topics import SEGMENT_CLOSED, TRAJECTORY_STEP

VARIANTS = ("masked", "zero", "fault_free")


def configure(base, variant: str, seed: int, run_dir: str, args, max_wall: float):
    """One variant and seed: only the fault rate and ``learner.mask_failed`` differ."""
    rate = 0.0 if variant == "fault_free" else args.fail_rate
    return make_config(
        base,
        run={"run_id": f"faults-{variant}-{seed}", "run_dir": run_dir, "seed": seed},
        loop={"max_env_steps": args.budget_steps, "max_wall_s": max_wall,
              "target_success": args.target},
        task={"env_config": {"n_orders": args.orders, "max_steps": args.max_steps},
              "train_seed_start": seed * 10_000_000, "fail_episode_rate": rate,
              "fail_within_steps": args.fail_within},
        sampler={"group_size": args.group_size},
        learner={"mask_failed": variant != "zero", "max_versions": 0},
        evaluator={"greedy": False},
    )


async def failures(run_dir: str) -> dict:
    """Episodes ended and failed (by kind), read from the run's log."""
    ended: set[str] = set()
    kinds: dict[str, int] = {}
    async with open_bus(f"sqlite:///{os.path.abspath(run_dir)}/events.db", reader=True) as bus:
        async for _, event in read_events(bus, [TRAJECTORY_STEP, SEGMENT_CLOSED],
                                          on_bad="raise"):
            if isinstance(event, EnvError):
                kind = failure_of(event)
                kinds[kind] = kinds.get(kind, 0) + 1
                ended.add(event.trajectory_id)  # also those with nothing left to close
            elif isinstance(event, SegmentClosed) and event.trajectory_done:
                ended.add(event.trajectory_id)
    return {"episodes": len(ended), "failed": kinds}


def wall_for(args) -> float:
    """Seconds the next run may take: --max-wall, capped by the time left to --finish-by
    (less a minute for the final evaluation and the drain); 0: no time left."""
    if not args.finish_by:
        return args.max_wall
    hour, minute = (int(x) for x in args.finish_by.split(":"))
    now = datetime.datetime.now(datetime.UTC)
    end = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    left = (end - now).total_seconds() - 60.0
    return min(args.max_wall, left) if left > 120.0 else 0.0


def ratio_of_medians(num: list[int | None], den: list[int | None], budget: int) -> float | None:
    """median(num) / median(den), a seed that never got there counting as the budget."""
    if not num or not den:
        return None
    top = statistics.median([budget if x is None else x for x in num])
    bottom = statistics.median([budget if x is None else x for x in den])
    return round(top / bottom, 3) if bottom else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(QUICKSTART))
    p.add_argument("--out", default=str(ROOT / "runs/bench-faults"))
    p.add_argument("--budget-steps", type=int, default=110_000, help="env steps per run")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--fail-rate", type=float, default=0.1, help="share of episodes that fail")
    p.add_argument("--fail-within", type=int, default=100,
                   help="the failing step is uniform in 0..N-1 (100: about a solved "
                        "episode's length, so nearly every scheduled fault happens)")
    p.add_argument("--orders", type=int, default=10, help="workshop orders (the quickstart's)")
    p.add_argument("--max-steps", type=int, default=300, help="workshop episode cap")
    p.add_argument("--group-size", type=int, default=4, help="episodes per task (GRPO group)")
    p.add_argument("--target", type=float, default=0.5, help="validation success to reach")
    p.add_argument("--max-wall", type=float, default=1800.0, help="safety stop per run (s)")
    p.add_argument("--finish-by", default="",
                   help="HH:MM UTC: no run goes past it (runs not started by then are skipped)")
    p.add_argument("--only-seeds", default="",
                   help="comma-separated seeds to run (e.g. '2'): several processes can share "
                        "one --out, then --summarize reports them together")
    p.add_argument("--reuse", action="store_true", help="keep runs already finished in --out")
    p.add_argument("--summarize", action="store_true",
                   help="run nothing: report the runs finished in --out")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if set(variants) - set(VARIANTS):
        p.error(f"unknown variants; choose from {', '.join(VARIANTS)}")
    base = load_config(args.config)
    os.makedirs(args.out, exist_ok=True)
    seeds = [int(x) for x in args.only_seeds.split(",") if x] or list(range(args.seeds))
    plan = [(seed, v) for seed in seeds for v in variants]  # seeds outermost
    per_seed: dict[str, list[int | None]] = {v: [] for v in variants}
    failed: dict[str, list[dict]] = {v: [] for v in variants}
    steps_run: dict[str, list[int]] = {v: [] for v in variants}
    for seed, variant in plan:
        run_dir = os.path.join(args.out, f"{variant}-s{seed}")
        started = time.monotonic()
        summary = finished_summary(run_dir) if args.reuse or args.summarize else None
        if summary is None:
            if args.summarize or not wall_for(args):
                continue  # not run (yet): left out, not counted as a failure to reach
            if os.path.exists(run_dir):
                shutil.rmtree(run_dir)
            summary = run_summary(configure(base, variant, seed, run_dir, args, wall_for(args)))
        points = asyncio.run(curve(run_dir))
        seen = asyncio.run(failures(run_dir))
        reached = first_at(points, args.target)
        per_seed[variant].append(reached)
        failed[variant].append(seen)
        steps_run[variant].append(summary["env_steps"])
        print(f"{variant:>10} seed {seed}: {summary['env_steps']} steps, "
              f"{summary['policy_versions']} versions, {time.monotonic() - started:.0f} s, "
              f"{seen['episodes']} episodes, failed {seen['failed']}, first >= "
              f"{args.target} at {reached}, curve {[(s, round(ok, 2)) for s, ok, _ in points]}",
              file=sys.stderr, flush=True)
    medians = {v: median_or_none(per_seed[v]) for v in variants}
    print_result({
        "bench": "faults", "target": args.target, "budget_env_steps": args.budget_steps,
        "fail_episode_rate": args.fail_rate, "fail_within_steps": args.fail_within,
        "task": {"n_orders": args.orders, "max_steps": args.max_steps,
                 "group_size": args.group_size},
        "steps_to_50" if args.target == 0.5 else "steps_to_target": per_seed,
        "median_steps": medians,
        "median_ratio_masked_vs_free": ratio_of_medians(
            per_seed.get("masked", []), per_seed.get("fault_free", []), args.budget_steps),
        "median_ratio_zero_vs_free": ratio_of_medians(
            per_seed.get("zero", []), per_seed.get("fault_free", []), args.budget_steps),
        "episodes_failed": {v: [sum(s["failed"].values()) for s in failed[v]]
                            for v in variants},
        "episodes": {v: [s["episodes"] for s in failed[v]] for v in variants},
        "env_steps_run": steps_run,  # a null in steps_to_50: never reached within these
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
