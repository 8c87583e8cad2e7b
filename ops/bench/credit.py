"""Credit assignment: which advantage learns the workshop in the fewest environment steps.

Four variants, the same task, policy, optimiser and environment-step budget, 3 seeds each,
each a real run of the loop (``gyre_async.runtime.loop.run_loop``) on the embedded bus:

outcome_only        GRPO: every step's advantage is its trajectory's outcome normalised
                    in its group (``credit = "outcome"``, no milestone rewards); trains
                    once trajectories end (sync mode: one episode per slot per version).
gae                 plain GAE over whole trajectories: one segment per trajectory (no
                    boundary bootstrap), trained at trajectory end (sync mode), milestones on.
gyre                Gyre: segments (milestone / max length) trained as they arrive in the
                    async loop, bootstrapped at boundaries, fused with the group outcome
                    advantage once known; milestone rewards on.
gyre_no_milestones  gyre without milestone rewards (outcome reward only).

Every variant samples ``group_size`` episodes per task (GRPO groups). The budget counts
environment steps sampled; a version's x-coordinate is the number of steps sampled before
it was published (read from the event log). Validation: sampled decoding on unseen seeds.
A run stops at the budget or at the first evaluation reaching ``--target``.

Writes ``<out>/credit_curves.png``; last line:
{"bench": "credit", "steps_to_target": {...}, "final_success": {...}, ...}
(steps_to_target: median over seeds of the first evaluation at or above the target, a seed
that never reaches it counting as never; null when most seeds never reach it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import time

from _common import QUICKSTART, ROOT, finished_summary, make_config, print_result, run_summary

from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_events
from gyre_async.config import load_config
from schemas.events import EvalResult, PolicyVersion, TrajectoryStep
from schemas.topics import EVAL, POLICY_VERSION, TRAJECTORY_STEP

VARIANTS = ("outcome_only", "gae", "gyre", "gyre_no_milestones")


def configure(base, variant: str, seed: int, run_dir: str, args):
    """The run config of one variant and seed: only credit assignment differs."""
    sync = variant in ("outcome_only", "gae")
    milestone = 0.0 if variant in ("outcome_only", "gyre_no_milestones") else 0.1
    segmenter = {"max_segment_steps": args.max_steps, "close_on_milestone": False} \
        if variant == "gae" else {}
    credit = {"outcome_only": "outcome", "gae": "gae"}.get(variant, "fusion")
    return make_config(
        base,
        run={"run_id": f"credit-{variant}-{seed}", "run_dir": run_dir, "seed": seed,
             "mode": "sync" if sync else "async"},
        loop={"max_env_steps": args.budget, "max_wall_s": args.max_wall,
              "target_success": max(args.stop_at, args.target)},
        task={"env_config": {"n_orders": args.orders, "max_steps": args.max_steps},
              "train_seed_start": seed * 10_000_000},
        sampler={"group_size": args.group_size},
        segmenter=segmenter,
        arbiter={"milestone_reward": milestone},
        learner={"credit": credit, "max_versions": 0},
        # sync versions hold ~2-3x the steps of async ones: evaluate about as often per step
        evaluator={"every_versions": 2 if sync else 5, "greedy": False},
    )


async def curve(run_dir: str) -> list[tuple[int, float, int]]:
    """(env steps sampled before the version was published, success, version) per eval."""
    step_ts: list[float] = []
    published: dict[int, float] = {}
    evals: list[EvalResult] = []
    async with open_bus(f"sqlite:///{os.path.abspath(run_dir)}/events.db", reader=True) as bus:
        # a measurement: a log that does not read back in full stops it (raise)
        async for _record, event in read_events(bus, [TRAJECTORY_STEP, POLICY_VERSION, EVAL],
                                                on_bad="raise"):
            match event:
                case TrajectoryStep():
                    step_ts.append(event.ts)
                case PolicyVersion():
                    published.setdefault(event.version, event.ts)
                case EvalResult():
                    evals.append(event)
    step_ts.sort()
    points = []
    for e in sorted(evals, key=lambda e: e.policy_version):
        ts = published.get(e.policy_version, 0.0)
        steps = sum(1 for t in step_ts if t <= ts) if e.policy_version else 0
        points.append((steps, e.success_rate, e.policy_version))
    return points


def record_run(args, label: str, seed: int, summary: dict, points, started: float) -> None:
    """One run's line: to stderr, and appended to ``<out>/runs.txt`` unless summarizing."""
    line = (f"{label} seed {seed}: {summary['env_steps']} steps, "
            f"{summary['policy_versions']} versions, {time.monotonic() - started:.0f} s, "
            f"first >= target at {first_at(points, args.target)}, curve "
            f"{[(s, round(ok, 2)) for s, ok, _ in points]}")
    print(line, file=sys.stderr, flush=True)
    if not args.summarize:
        with open(os.path.join(args.out, "runs.txt"), "a") as f:
            f.write(line + "\n")


def first_at(points, target: float) -> int | None:
    return next((s for s, ok, _ in points if ok >= target), None)


def median_or_none(xs: list[int | None]) -> int | None:
    """Median with None as +infinity; None when most are None."""
    if not xs:
        return None
    inf = float("inf")
    m = statistics.median([inf if x is None else x for x in xs])
    return None if m == inf else int(m)


def plot(curves: dict[str, list[list[tuple[int, float, int]]]], target: float, path: str,
         budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colours = dict(zip(VARIANTS, ("tab:gray", "tab:orange", "tab:blue", "tab:green")))
    for variant, runs in curves.items():
        for i, points in enumerate(runs):
            xs = [p[0] for p in points]
            ys = [p[1] for p in points]
            ax.plot(xs, ys, marker="o", ms=3, lw=1.2, alpha=0.8, color=colours[variant],
                    label=variant if i == 0 else None)
    ax.axhline(target, ls="--", color="k", lw=0.8, label=f"target {target:.0%}")
    ax.set_xlim(0, budget * 1.05)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("environment steps sampled")
    ax.set_ylabel("validation success (sampled decoding)")
    seeds = max((len(runs) for runs in curves.values()), default=0)
    ax.set_title(f"Credit assignment on the workshop ({seeds} seeds per variant)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(QUICKSTART))
    p.add_argument("--out", default=str(ROOT / "runs/bench-credit"))
    p.add_argument("--budget", type=int, default=110_000, help="env steps per run")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--only-seeds", default="",
                   help="comma-separated seeds to run (e.g. '2'): several processes can share "
                        "one --out, then --summarize reports them together")
    p.add_argument("--orders", type=int, default=10,
                   help="workshop orders per episode (10: the quickstart task, ~83-step oracle)")
    p.add_argument("--max-steps", type=int, default=300, help="workshop episode cap")
    p.add_argument("--group-size", type=int, default=4, help="episodes per task (GRPO group)")
    p.add_argument("--target", type=float, default=0.5, help="validation success to reach")
    p.add_argument("--max-wall", type=float, default=3600.0, help="safety stop per run (s)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--stop-at", type=float, default=None,
                   help="a run stops early once validation reaches this (default: --target)")
    p.add_argument("--reuse", action="store_true",
                   help="keep runs already finished in --out (a cut-short bench resumes)")
    p.add_argument("--summarize", action="store_true",
                   help="run nothing: report the runs finished in --out (seeds may be fewer)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 seed, 3k steps, 2 orders (checks the pipeline only)")
    args = p.parse_args(argv)
    if args.stop_at is None:
        args.stop_at = args.target
    if args.quick:
        args.budget, args.seeds, args.orders, args.max_steps = 3000, 1, 2, 60
        args.max_wall = 240.0
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    base = load_config(args.config)
    os.makedirs(args.out, exist_ok=True)
    curves: dict[str, list] = {v: [] for v in variants}
    finals: dict[str, list[float]] = {v: [] for v in variants}
    seeds = [int(x) for x in args.only_seeds.split(",") if x] or list(range(args.seeds))
    for seed in seeds:  # seeds outermost: a cut-short bench still compares all
        for variant in variants:
            run_dir = os.path.join(args.out, f"{variant}-s{seed}")
            started = time.monotonic()
            summary = finished_summary(run_dir) if args.reuse or args.summarize else None
            if args.summarize and summary is None:
                continue
            if summary is None:
                if os.path.exists(run_dir):
                    shutil.rmtree(run_dir)
                summary = run_summary(configure(base, variant, seed, run_dir, args))
            points = asyncio.run(curve(run_dir))
            curves[variant].append(points)
            finals[variant].append(points[-1][1] if points else 0.0)
            record_run(args, f"{variant:>18}", seed, summary, points, started)
    png = os.path.join(args.out, "credit_curves.png")
    plot(curves, args.target, png, args.budget)
    per_seed = {v: [first_at(c, args.target) for c in curves[v]] for v in variants}
    steps = {v: median_or_none(per_seed[v]) for v in variants}
    gyre, outcome = steps.get("gyre"), steps.get("outcome_only")
    if gyre is None:
        ratio = None
    else:  # a variant that never got there needed more than the whole budget
        ratio = round(gyre / (outcome if outcome is not None else args.budget), 3)
    print_result({
        "bench": "credit", "target": args.target, "budget_env_steps": args.budget,
        "seeds_per_variant": {v: len(curves[v]) for v in variants},
        "task": {"n_orders": args.orders, "max_steps": args.max_steps,
                 "group_size": args.group_size},
        "steps_to_target_per_seed": per_seed,
        "gyre_over_outcome_only": ratio,
        "gyre_over_outcome_only_is_upper_bound": outcome is None and gyre is not None,
        "plot": png,
        "steps_to_target": steps,
        "final_success": {v: round(statistics.mean(f), 3) if f else None
                          for v, f in finals.items()},
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
