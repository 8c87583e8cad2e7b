"""Episodes survive a sampler crash: long episodes, the sampler SIGKILLed again and again.

    python ops/bench/resume.py                       # 24 kills, 320-step episodes
    python ops/bench/resume.py --kills 20 --max-steps 400 --seed 3

What it does (the machinery is ``ops/chaos.py``'s, the invariants
``gyre_async.audit.invariants``'):

1. ``gyre launch`` of the tiny loop (sampler, segmenter, arbiter, learner on the embedded
   bus, restarts unlimited) on a workshop long enough that no policy finishes it within
   ``--max-steps`` (``--orders`` orders need ~8.4 steps each): every episode that is not
   broken off runs to the step cap, so each is ``--max-steps`` (>= 300) steps long;
2. SIGKILLs the sampler ``--kills`` times, each a random ``--min-gap``..``--max-gap``
   seconds after the launcher has restarted it (so kills land while it rebuilds, while it
   plays on, at the gate, anywhere);
3. after the last kill waits until every episode open at that moment has ended (the last
   incarnation continued it to its end, or ended it with an error), stops the launcher
   and reads the log back.

Measured from the log alone (the sampler's own counters die with each kill):

- ``episodes``: trajectories that ended (those a final stop left open are not counted,
  ``open_at_end``); ``completed_fraction``: the share that ended by the environment (done
  or the step cap) rather than by an ``env-error`` (abandoned, rebuild mismatch, failure);
- ``rebuilt_episodes``: trajectories with steps published both before and after a kill
  (only a rebuilt episode can: a killed sampler publishes nothing more);
  ``resume_seconds_median``: for each such continuation, from the kill to the first step
  of the continued episode (restart, reload, replay and the gate included);
- ``observation_mismatches``: ``env-error``s with reason ``rebuild-mismatch``;
- ``lost`` / ``duplicated`` / ``corrupt`` / ``order``: violations of the run invariants
  (as ``ops/chaos.py``); ``step_gaps``: trajectories whose step indices are not 0..n-1.

Last line, JSON: ``{"bench": "resume", "kills", "episodes", "completed_fraction",
"rebuilt_episodes", "observation_mismatches", "resume_seconds_median", "lost",
"duplicated", ...}``. Exit 0 when completed_fraction >= 0.99, no mismatch, nothing lost,
duplicated, corrupt or out of order, and at least ``--kills`` kills landed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

from _common import TINY, make_config, ops_script, print_result, write_config

from gyre_async.runtime.launcher import wait_until
from schemas.config import Config

ROLE = "sampler"


def long_config(run_dir: Path, run_id: str, args) -> Config:
    """``ops/chaos.py``'s config (the tiny loop, no version or wall-clock budget) with a
    workshop whose episodes all run to the step cap."""
    return make_config(TINY, run={"run_dir": str(run_dir), "run_id": run_id},
                       loop={"max_wall_s": 0}, learner={"max_versions": 0,
                                                        "batch_steps": args.batch_steps},
                       task={"env_config": {"n_orders": args.orders,
                                            "max_steps": args.max_steps}})


async def read_trajectories(url: str, run_id: str):
    """(steps by trajectory, env-errors by trajectory) of the sampler, from the log."""
    from gyre_async.bus import open_bus
    from gyre_async.bus.reading import read_events
    from schemas.events import EnvError, TrajectoryStep
    from schemas.topics import TRAJECTORY_STEP

    steps: dict[str, dict[int, tuple[float, bool]]] = defaultdict(dict)
    errors: dict[str, EnvError] = {}
    async with open_bus(url) as bus:
        async for _, event in read_events(bus, [TRAJECTORY_STEP], on_bad="skip"):
            if event.run_id != run_id or event.producer != ROLE:
                continue
            if isinstance(event, TrajectoryStep):
                steps[event.trajectory_id].setdefault(
                    event.step_index, (event.ts, event.done or event.truncated))
            elif isinstance(event, EnvError):
                errors.setdefault(event.trajectory_id, event)
    return steps, errors


def open_ids(steps, errors) -> set[str]:
    return {tid for tid, by_index in steps.items()
            if tid not in errors and not any(end for _, end in by_index.values())}


def measure(steps, errors, kills: list[float]) -> dict:
    ended = {tid for tid, by_index in steps.items()
             if any(end for _, end in by_index.values())}
    failed = set(errors) - ended
    episodes = len(ended) + len(failed)
    rebuilt: set[str] = set()
    resume_s: list[float] = []
    gaps = 0
    for tid, by_index in steps.items():
        indices = sorted(by_index)
        gaps += indices != list(range(len(indices)))
        for a, b in zip(indices, indices[1:]):
            before, after = by_index[a][0], by_index[b][0]
            crossed = [k for k in kills if before < k < after]
            if crossed:
                rebuilt.add(tid)
                resume_s.append(after - crossed[-1])
    reasons: dict[str, int] = defaultdict(int)
    for tid in failed:
        reasons[errors[tid].reason or errors[tid].kind] += 1
    lengths = [len(steps[tid]) for tid in ended]
    return {
        "episodes": episodes,
        "completed_fraction": round(len(ended) / episodes, 4) if episodes else 0.0,
        "rebuilt_episodes": len(rebuilt),
        "observation_mismatches": reasons.get("rebuild-mismatch", 0),
        "resume_seconds_median": round(statistics.median(resume_s), 2) if resume_s else None,
        "resume_seconds_max": round(max(resume_s), 2) if resume_s else None,
        "continuations": len(resume_s),
        "ended_by_error": dict(reasons),
        "episode_steps_min": min(lengths) if lengths else 0,
        "episode_steps_median": statistics.median(lengths) if lengths else 0,
        "open_at_end": len(open_ids(steps, errors)),
        "step_gaps": gaps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=24, help="sampler SIGKILLs (default 24)")
    p.add_argument("--min-gap", type=float, default=2.0, help="min seconds alive before a kill")
    p.add_argument("--max-gap", type=float, default=12.0, help="max seconds alive before a kill")
    p.add_argument("--orders", type=int, default=60, help="workshop orders per episode")
    p.add_argument("--max-steps", type=int, default=320, help="episode step cap (>= 300)")
    p.add_argument("--batch-steps", type=int, default=256, help="learner.batch_steps")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds to wait for the first version, and for the open episodes "
                        "to end after the last kill")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--work-dir", help="keep the run here (default: a temporary directory)")
    args = p.parse_args(argv)
    args.seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    # what Chaos reads: no write point pauses (only the sampler is killed here)
    args.pause, args.pause_prob, args.aim_timeout = 0.0, 0.0, 0.0

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gyre-resume-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    run_id = f"resume-{uuid.uuid4().hex[:8]}"
    run_dir = work / "run"
    url = f"sqlite:///{run_dir}/events.db"
    config = long_config(run_dir, run_id, args)
    cfg = write_config(config, run_dir.parent / "chaos.toml")
    max_staleness = config.loop.max_staleness
    chaos = ops_script("chaos").Chaos(args, run_dir, url, run_id)
    rng = random.Random(args.seed)
    error = None
    started = time.monotonic()
    proc: subprocess.Popen | None = None
    try:
        proc = chaos.start(cfg)
        wait_until("the sampler up", lambda: chaos.alive_pid(ROLE), 120)
        wait_until("the initial policy version", lambda: chaos.versions() >= 1,
                   args.timeout, 1.0)
        for _ in range(args.kills):
            wait_until(f"{ROLE} alive", lambda: chaos.alive_pid(ROLE), 120)
            time.sleep(rng.uniform(args.min_gap, args.max_gap))
            if proc.poll() is not None:
                raise RuntimeError(f"the launcher exited ({proc.returncode})")
            chaos.kill(ROLE, aimed=False)
        last_open = open_ids(*asyncio.run(read_trajectories(url, run_id)))
        print(f"resume: {len(last_open)} episodes open at the last kill", file=sys.stderr)

        def all_ended() -> bool:
            steps, errors = asyncio.run(read_trajectories(url, run_id))
            return not (last_open & open_ids(steps, errors))

        wait_until("the episodes open at the last kill to end", all_ended, args.timeout, 5.0)
    except (TimeoutError, RuntimeError) as exc:
        error = str(exc)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    steps, errors = asyncio.run(read_trajectories(url, run_id))
    report, _stale_dropped = asyncio.run(ops_script("chaos").audit(url, run_id, run_dir,
                                                                   max_staleness))
    print(report.describe(), file=sys.stderr)
    kills = [k["t"] for k in chaos.kills]
    result = {"bench": "resume", "kills": len(kills), **measure(steps, errors, kills),
              "lost": len(report.lost), "duplicated": len(report.duplicated),
              "corrupt": len(report.corrupt), "order": len(report.order),
              "steps": report.counts.get("steps", 0),
              "versions": report.counts.get("versions", 0),
              "seconds": round(time.monotonic() - started, 1), "seed": args.seed,
              "work_dir": str(work), "error": error}
    ok = (error is None and report.ok and result["kills"] >= args.kills
          and result["completed_fraction"] >= 0.99 and result["observation_mismatches"] == 0
          and result["step_gaps"] == 0)
    headline = ("bench", "kills", "episodes", "completed_fraction", "rebuilt_episodes",
                "observation_mismatches", "resume_seconds_median", "lost", "duplicated")
    print_result({**{k: result[k] for k in headline}, **result})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
