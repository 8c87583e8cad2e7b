"""Async vs sync: the same task with long-tail tool latency, the same wall-clock budget.

sync  = strict sample-then-train: every version samples one episode per environment slot,
        waits for the slowest one, then the learner trains while sampling stands still;
async = Gyre's loop: sampling, scoring and learning overlap, bounded by max_staleness.
Both runs use the quickstart task and policy, tool latency drawn log-normal per step
(long tail), and end with a validation of the policy they produced.

Last line: {"bench": "async_vs_sync", "async_steps_per_s": ..., "sync_steps_per_s": ...,
            "speedup": ..., "async_success": ..., "sync_success": ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import msgspec

from gyre_async.config import load_config
from gyre_async.runtime.loop import run_loop

ROOT = Path(__file__).resolve().parents[2]


def configure(cfg, mode: str, run_dir: str, seconds: float, latency: float, sigma: float):
    r = msgspec.structs.replace
    return r(
        cfg,
        run=r(cfg.run, run_dir=run_dir, run_id=f"bench-{mode}", mode=mode),
        loop=r(cfg.loop, max_wall_s=seconds, target_success=0.0),
        learner=r(cfg.learner, max_versions=0),
        evaluator=r(cfg.evaluator, every_versions=10_000),  # only version 0 and the final one
        task=r(cfg.task, env_config={**cfg.task.env_config, "latency_mean_s": latency,
                                     "latency_sigma": sigma, "latency_max_s": 5.0}),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "ops/configs/quickstart.toml"))
    p.add_argument("--seconds", type=float, default=240.0, help="wall-clock budget per mode")
    p.add_argument("--latency", type=float, default=0.05, help="mean tool latency (s)")
    p.add_argument("--sigma", type=float, default=2.0, help="log-normal sigma (tail weight)")
    args = p.parse_args(argv)
    base = load_config(args.config)
    results = {}
    for mode in ("sync", "async"):
        with tempfile.TemporaryDirectory(prefix=f"gyre-{mode}-") as tmp:
            cfg = configure(base, mode, tmp, args.seconds, args.latency, args.sigma)
            s = asyncio.run(run_loop(cfg, progress=False))
        rate = s["env_steps_per_s"]  # over the sampling span (evaluations excluded)
        results[mode] = {"steps_per_s": rate, "success": s["final_success"],
                         "score": s["final_score"], "versions": s["policy_versions"]}
        print(f"{mode:>5}: {s['env_steps']} env steps, {rate:.1f} steps/s, "
              f"{s['policy_versions']} versions, final success {s['final_success']}, "
              f"score {s['final_score']}", file=sys.stderr)
    a, b = results["async"], results["sync"]
    print(json.dumps({
        "bench": "async_vs_sync",
        "async_steps_per_s": round(a["steps_per_s"], 2),
        "sync_steps_per_s": round(b["steps_per_s"], 2),
        "speedup": round(a["steps_per_s"] / max(b["steps_per_s"], 1e-9), 3),
        "async_success": a["success"], "sync_success": b["success"],
        "async_score": a["score"], "sync_score": b["score"],
        "async_versions": a["versions"], "sync_versions": b["versions"],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
