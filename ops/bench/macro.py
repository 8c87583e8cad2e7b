"""Macro-actions vs primitive actions: environment steps to reach the quickstart's target.

Two runs of the quickstart config (same task, policy, seeds and hyper-parameters), one with
the workshop's built-in macros enabled (``[macros] builtin = "workshop"``: ``gather_<item>``
fixed sequences and the scripted ``wait_furnace``, see gyre_async/envs/workshop_macros.py),
one without. Each stops once validation reaches ``loop.target_success``, or after
``--max-env-steps`` (a budget in steps, so a busy machine changes the runtime, not the
result; ``--seconds`` is a wall-clock safety stop). Steps are **primitive environment
steps** in both arms (a macro call counts every env step it expanded into).

steps_to_target: the environment steps sampled by every policy version older than the first
version whose validation success reached the target (what it cost to produce that policy).
null when the arm did not reach the target within its budget.

    nice -n 10 python ops/bench/macro.py            # the quickstart task (~10-30 min)
    nice -n 10 python ops/bench/macro.py --quick    # 3 orders per episode, 20k steps each

Last line: {"bench": "macro", "steps_to_target": {"macro": ..., "primitive": ...},
            "target_success": ..., "reached": {...}, "versions_to_target": {...}, ...}
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from _common import QUICKSTART, make_config, print_result, run_summary, scratch_dir

from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_events
from gyre_async.config import bus_url, load_config
from gyre_async.envs.macros import env_steps_of
from schemas.events import EvalResult, TrajectoryStep
from schemas.topics import EVAL, TRAJECTORY_STEP


def configure(cfg, arm: str, run_dir: str, quick: bool, seconds: float, max_env_steps: int):
    return make_config(
        cfg, run={"run_dir": run_dir, "run_id": f"bench-macro-{arm}"},
        loop={"max_wall_s": seconds, "max_env_steps": max_env_steps},
        task={"env_config": {"n_orders": 3} if quick else {}},
        macros={"builtin": "workshop" if arm == "macro" else ""})


async def measure(cfg) -> dict:
    """Steps to target from the run's event log (see the module docstring)."""
    evals: list[EvalResult] = []
    steps: list[tuple[int, int]] = []  # (policy version, primitive env steps)
    async with open_bus(bus_url(cfg)) as bus:
        # a measurement: a log that does not read back in full stops it (raise)
        async for _record, event in read_events(bus, [EVAL, TRAJECTORY_STEP], on_bad="raise"):
            match event:
                case EvalResult():
                    evals.append(event)
                case TrajectoryStep():
                    steps.append((event.policy_version, env_steps_of(event)))
    evals.sort(key=lambda e: e.policy_version)
    hit = next((e for e in evals if e.success_rate >= cfg.loop.target_success), None)
    decisions = len(steps)
    total = sum(n for _, n in steps)
    out = {"reached": hit is not None, "env_steps_total": total, "decisions_total": decisions,
           "evals": [(e.policy_version, round(e.success_rate, 3)) for e in evals]}
    if hit is not None:
        out["version"] = hit.policy_version
        out["success"] = hit.success_rate
        out["steps_to_target"] = sum(n for v, n in steps if v < hit.policy_version)
        out["decisions_to_target"] = sum(1 for v, _ in steps if v < hit.policy_version)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(QUICKSTART))
    p.add_argument("--quick", action="store_true",
                   help="3 orders per episode, 20k env steps per arm (a smoke run)")
    p.add_argument("--max-env-steps", type=int, default=0,
                   help="env-step budget per arm (default 120000; --quick: 20000)")
    p.add_argument("--seconds", type=float, default=1500.0, help="wall safety stop per arm")
    p.add_argument("--keep", default="", help="keep the run directories under this path")
    p.add_argument("--arms", default="macro,primitive", help="which arms to run (comma list)")
    args = p.parse_args(argv)
    base = load_config(args.config)
    if not base.loop.target_success:
        raise SystemExit(f"{args.config} sets no loop.target_success to measure against")
    results = {}
    for arm in args.arms.split(","):
        keep = Path(args.keep) / arm if args.keep else None
        with scratch_dir(f"gyre-macro-{arm}-", keep) as run_dir:
            budget = args.max_env_steps or (20_000 if args.quick else 120_000)
            cfg = configure(base, arm, run_dir, args.quick, args.seconds, budget)
            started = time.monotonic()
            run_summary(cfg)
            res = asyncio.run(measure(cfg))
            res["wall_s"] = round(time.monotonic() - started, 1)
        results[arm] = res
        print(f"{arm:>9}: reached={res['reached']} at v{res.get('version')} "
              f"steps_to_target={res.get('steps_to_target')} "
              f"(decisions {res.get('decisions_to_target')}), {res['env_steps_total']} env "
              f"steps in {res['wall_s']} s; evals {res['evals']}", file=sys.stderr)
    m, q = results.get("macro", {}), results.get("primitive", {})
    ratio = (round(m["steps_to_target"] / q["steps_to_target"], 3)
             if m.get("reached") and q.get("reached") else None)
    print_result({
        "bench": "macro",
        "steps_to_target": {"macro": m.get("steps_to_target"),
                            "primitive": q.get("steps_to_target")},
        "target_success": base.loop.target_success,
        "reached": {"macro": m.get("reached"), "primitive": q.get("reached")},
        "versions_to_target": {"macro": m.get("version"), "primitive": q.get("version")},
        "decisions_to_target": {"macro": m.get("decisions_to_target"),
                                "primitive": q.get("decisions_to_target")},
        "macro_over_primitive": ratio,
        "quick": args.quick,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
