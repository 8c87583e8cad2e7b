"""Framework overhead: share of busy time spent in the bus, serialization and storage.

Runs the whole loop in one process (embedded bus, no tool latency) for a fixed budget and
reads the busy-time counters (``gyre_async.timing``): bus = SQLite work, codec = msgpack
encode/decode, storage = Zarr segment and checkpoint I/O, against policy forward passes,
environment steps and PPO updates. Waiting is not counted anywhere.

``env`` is wall time inside ``env.step`` (it includes event-loop scheduling, so it overstates
the environment's own compute); ``framework_share_excluding_env`` leaves it out of the
denominator altogether: the conservative figure.

Last line: {"bench": "overhead", "framework_share": ..., "framework_share_excluding_env": ...}
"""

from __future__ import annotations

import argparse
import sys

from _common import QUICKSTART, make_config, print_result, run_summary, scratch_dir

from gyre_async import timing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(QUICKSTART))
    p.add_argument("--seconds", type=float, default=60.0, help="wall-clock budget of the run")
    args = p.parse_args(argv)
    with scratch_dir("gyre-overhead-") as tmp:
        cfg = make_config(args.config, run={"run_dir": tmp, "run_id": "overhead"},
                          loop={"max_wall_s": args.seconds}, learner={"max_versions": 0},
                          task={"env_config": {"latency_mean_s": 0.0}})
        timing.reset()
        summary = run_summary(cfg)
    seconds = timing.snapshot()
    share = timing.framework_share(seconds)
    strict = timing.framework_share({k: v for k, v in seconds.items() if k != "env"})
    print(f"env steps {summary['env_steps']} in {summary['wall_seconds']} s, "
          f"{summary['policy_versions']} policy versions", file=sys.stderr)
    for k, v in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<8} {v:8.2f} s busy", file=sys.stderr)
    print_result({"bench": "overhead", "framework_share": round(share, 4),
                  "framework_share_excluding_env": round(strict, 4),
                  "busy_seconds": {k: round(v, 2) for k, v in seconds.items()},
                  "env_steps": summary["env_steps"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
